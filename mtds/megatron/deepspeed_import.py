"""Megatron-DeepSpeed checkpoints -> mtds: its GPT pipeline model (GPTModelPipe) as DeepSpeed's pipeline
engine saves it, read through DeepSpeed's own reader, ``deepspeed.checkpoint.DeepSpeedCheckpoint``.

The folder (``--save`` of Megatron-DeepSpeed, or one ``global_step<N>`` tag folder in it) holds, per
pipeline layer and TP rank, ``layer_XX-model_YY-model_states.pt`` (the layer's state_dict), and per
(stage, TP rank) ``mp_rank_ZZ_model_states.pt`` (DeepSpeed's engine state with Megatron-DeepSpeed's
``args``). DeepSpeedCheckpoint finds the source (t, p), which files hold the embedding, each transformer
layer and the final norm on each TP rank; here each layer's TP pieces are merged as Megatron's layers split
them -- column-parallel (query_key_value, dense_h_to_4h, the vocabulary-parallel embedding and head) on
rows, row-parallel (dense, dense_4h_to_h) on columns, the rest replicated and checked equal -- renamed to
mtds's names and written by mtds's checkpoint writer at any (t, p).

query_key_value's rows differ between Megatron-DeepSpeed versions with the same checkpoint_version (3.0):
before its FPDT commit (676a482c, 2024-12) each rank's rows are per head [q_h, k_h, v_h]
(``[sq, b, np, 3 * hn]`` in ParallelAttention); from it on they are [q | k | v] of the rank's heads. That
commit added ``ds_sequence_parallel_fpdt`` to the arguments, so its presence in the saved args tells which.

Safety: DeepSpeedCheckpoint opens the ``mp_rank_*`` files with ``torch.load(weights_only=False)``, which can
run code from the pickle. Every such file is first disassembled (torch's
``get_unsafe_globals_in_checkpoint``) and refused unless each class it names is on an allow-list:
argparse.Namespace, numpy's array rebuilders (the RNG state), Megatron's enums (``megatron.*.enums.*``,
never called beyond their constructor; stubs when Megatron is not installed) and the DeepSpeed classes of
mtds.checkpoint.safe_load. Layer files are read with ``weights_only=True`` and no extra classes.
"""
from __future__ import annotations

import argparse
import contextlib
import enum
import glob
import importlib
import os
import re
import sys
import types
from typing import Any, Iterator, Mapping

import torch

from mtds.model.config import ModelConfig

from mtds.megatron import keys
from mtds.megatron.args import DEFAULTS, config_from_args
from mtds.megatron.common import Opaque
from mtds.megatron.errors import MegatronCheckpointError

MODEL_STATES = "mp_rank_*_model_states.pt"
LAYER_FILES = "layer_*-model_*-model_states.pt"
ALLOWED = {"argparse.Namespace", "numpy.ndarray", "numpy.dtype", "numpy.core.multiarray._reconstruct",
           "numpy._core.multiarray._reconstruct", "numpy.dtypes.UInt32DType"}
ENUM = re.compile(r"^megatron(\.\w+)*\.enums\.[A-Z]\w*$")     # a class of a Megatron enums module
FPDT_MARKER = "ds_sequence_parallel_fpdt"

# Megatron-DeepSpeed's parameter names (megatron/model/transformer.py, language_model.py) -> mtds's, and how
# Megatron's tensor parallelism splits them: "col" rows, "row" columns, "rep" replicated.
BLOCK = {"input_layernorm.weight": ("input_norm.weight", "rep"), "input_layernorm.bias": ("input_norm.bias", "rep"),
         "self_attention.query_key_value.weight": ("attention.qkv.weight", "qkv"),
         "self_attention.query_key_value.bias": ("attention.qkv.bias", "qkv"),
         "self_attention.dense.weight": ("attention.out_proj.weight", "row"),
         "self_attention.dense.bias": ("attention.out_proj.bias", "rep"),
         "post_attention_layernorm.weight": ("post_attention_norm.weight", "rep"),
         "post_attention_layernorm.bias": ("post_attention_norm.bias", "rep"),
         "mlp.dense_h_to_4h.weight": ("mlp.fc_in.weight", "col"), "mlp.dense_h_to_4h.bias": ("mlp.fc_in.bias", "col"),
         "mlp.dense_4h_to_h.weight": ("mlp.fc_out.weight", "row"), "mlp.dense_4h_to_h.bias": ("mlp.fc_out.bias", "rep")}
EMBEDDING = {"word_embeddings.weight": ("word_embeddings.weight", "col"),
             "position_embeddings.weight": ("position_embeddings.weight", "rep")}
FINAL_NORM = {"weight": ("norm.weight", "rep"), "bias": ("norm.bias", "rep")}
HEAD = {"lm_head.weight": ("weight", "col")}

# Megatron-DeepSpeed switches whose models were not checked against an oracle here: refused while set.
UNVERIFIED = {"swiglu": "SwiGLU", "use_rotary_position_embeddings": "rotary position embeddings",
              "apply_layernorm_1p": "LayerNorm 1p", "apply_residual_connection_post_layernorm": "post-LN residuals",
              "squared_relu": "squared ReLU", "num_experts_switch": "Megatron-LM's switch MoE",
              FPDT_MARKER: "FPDT attention"}


def resolve_tag_dir(path: str) -> str:
    """The folder with the model-state files: ``path`` itself, or the tag DeepSpeed's ``latest`` names."""
    if not os.path.isdir(path):
        raise MegatronCheckpointError(f"Megatron-DeepSpeed checkpoint directory {path!r} does not exist")
    if glob.glob(os.path.join(path, MODEL_STATES)):
        return path
    latest = os.path.join(path, "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            tag = f.read().strip()
        if glob.glob(os.path.join(path, tag, MODEL_STATES)):
            return os.path.join(path, tag)
        raise MegatronCheckpointError(f"{latest} names tag {tag!r}, which has no {MODEL_STATES} files")
    raise MegatronCheckpointError(f"{path} has no {MODEL_STATES} files and no 'latest' file: not a "
                                  f"Megatron-DeepSpeed (DeepSpeed) checkpoint folder")


def _unsafe_globals(path: str) -> list[str]:
    """Classes/functions the pickle names that torch's weights_only loader does not allow by default
    (the process's own add_safe_globals are set aside while looking)."""
    ser = torch.serialization
    user = ser.get_safe_globals()
    ser.clear_safe_globals()
    try:
        return ser.get_unsafe_globals_in_checkpoint(path)
    except Exception as err:    # noqa: BLE001 -- not a torch zip file, truncated, ...
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise MegatronCheckpointError(f"cannot read {path}: {first}") from None
    finally:
        ser.add_safe_globals(user)


def check_pickles(paths: list[str]) -> set[str]:
    """Refuse any file naming a class off the allow-list; returns the Megatron enum names found."""
    from mtds.checkpoint.safe_load import allowed_globals
    allowed = ALLOWED | {f"{c.__module__}.{c.__qualname__}" for c in allowed_globals()}
    enums = set()
    for path in paths:
        for name in _unsafe_globals(path):
            if ENUM.match(name):
                enums.add(name)
            elif name not in allowed:
                raise MegatronCheckpointError(
                    f"refusing to load {path}: it needs {name}, which is not a type Megatron-DeepSpeed's model "
                    f"states hold (unpickling it could run arbitrary code); only convert checkpoints you trust")
    return enums


_ABSENT = object()


@contextlib.contextmanager
def megatron_enum_stubs(names: set[str]):
    """Modules holding a stub enum for each name in ``names`` whose module cannot be imported, while the
    body runs (DeepSpeed's reader unpickles the args with them); importable ones are left alone."""
    added = {}
    for name in sorted(names):
        module, _, cls = name.rpartition(".")
        try:
            found = getattr(importlib.import_module(module), cls, None)
        except ImportError:
            found = None
        else:
            if not (isinstance(found, type) and issubclass(found, enum.Enum)):
                raise MegatronCheckpointError(f"refusing to load the checkpoint: it needs {name}, which is not "
                                              f"an enum of the installed Megatron")
            continue
        parts = module.split(".")
        for sub in (".".join(parts[:i]) for i in range(1, len(parts) + 1)):
            if sub not in added and sys.modules.get(sub) is None:
                added[sub] = sys.modules.get(sub, _ABSENT)
                sys.modules[sub] = types.ModuleType(sub)
        # called with the member's value, kept as the stub's args (common.py's Opaque)
        setattr(sys.modules[module], cls, type(cls, (Opaque,), {"__module__": module}))
    try:
        yield
    finally:
        for sub, old in added.items():
            if old is _ABSENT:
                sys.modules.pop(sub, None)
            else:
                sys.modules[sub] = old


def _plain_args(args: Any) -> dict[str, Any]:
    if isinstance(args, argparse.Namespace):
        return vars(args)
    if isinstance(args, dict):
        return dict(args)
    raise MegatronCheckpointError("the checkpoint's mp_rank files carry no 'args': not saved by Megatron-DeepSpeed "
                                  "(its save_checkpoint stores the run's arguments there)")


def megatron_args(saved: Mapping[str, Any]) -> dict[str, Any]:
    """Megatron-DeepSpeed's arguments in the names of mtds.megatron.args (Megatron-LM's), refusing what was
    not verified here."""
    for name, what in UNVERIFIED.items():
        if saved.get(name):
            raise MegatronCheckpointError(f"args.{name} = {saved[name]!r}: {what} is not supported for "
                                          f"Megatron-DeepSpeed checkpoints")
    experts = saved.get("num_experts") or [1]
    if any(n > 1 for n in (experts if isinstance(experts, (list, tuple)) else [experts])):
        raise MegatronCheckpointError(f"args.num_experts = {experts!r}: MoE checkpoints are not supported")
    heads = saved.get("num_attention_heads")
    if saved.get("num_key_value_heads") not in (None, heads):
        raise MegatronCheckpointError(f"args.num_key_value_heads = {saved['num_key_value_heads']} != "
                                      f"num_attention_heads = {heads}: grouped-query attention is not supported "
                                      f"for Megatron-DeepSpeed checkpoints")
    if saved.get("normalization", "layernorm") != "layernorm":
        raise MegatronCheckpointError(f"args.normalization = {saved['normalization']!r} is not supported for "
                                      f"Megatron-DeepSpeed checkpoints (only layernorm)")
    if not saved.get("add_position_embedding", True):
        raise MegatronCheckpointError("args.add_position_embedding = False: a model without position embeddings "
                                      "is not supported")
    if not saved.get("add_bias_linear", True):
        raise MegatronCheckpointError("args.add_bias_linear = False (--disable-bias-linear) is not supported for "
                                      "Megatron-DeepSpeed checkpoints")
    if saved.get("checkpoint_version", 3.0) < 2.0:
        raise MegatronCheckpointError(f"checkpoint_version {saved['checkpoint_version']} < 2.0 stores "
                                      f"query_key_value in an older order; not supported")
    out = {**DEFAULTS, **{k: saved[k] for k in DEFAULTS if k in saved}}
    # ParallelMLP: openai_gelu -> tanh GELU; onnx_safe -> exact (erf) GELU; else the fused bias-GELU (tanh
    # approximation) when bias_gelu_fusion, F.gelu (exact) otherwise.
    out.update(position_embedding_type="learned_absolute", normalization="LayerNorm",
               norm_epsilon=saved.get("layernorm_epsilon", DEFAULTS["norm_epsilon"]), swiglu=False,
               openai_gelu=bool(saved.get("openai_gelu")), add_qkv_bias=False, group_query_attention=False,
               bias_gelu_fusion=bool(saved.get("bias_gelu_fusion", True)) and not saved.get("onnx_safe"),
               add_bias_linear=True)
    return out


class MegatronDeepSpeedCheckpoint:
    """A Megatron-DeepSpeed GPTModelPipe checkpoint opened through DeepSpeedCheckpoint."""

    def __init__(self, path: str):
        from deepspeed.checkpoint import DeepSpeedCheckpoint
        self.tag_dir = resolve_tag_dir(path)
        if not glob.glob(os.path.join(self.tag_dir, LAYER_FILES)):
            raise MegatronCheckpointError(f"{self.tag_dir} has no {LAYER_FILES} files: only GPTModelPipe (DeepSpeed's "
                                          f"pipeline engine) checkpoints are read, not --no-pipeline-parallel ones")
        model_files = sorted(glob.glob(os.path.join(self.tag_dir, MODEL_STATES)))
        enums = check_pickles(model_files)
        # GPTModelPipe's last spec is the head: tied, a partial of the embedding (no file), so the final norm is
        # the last layer file; untied, LMHeadPipe's file (lm_head.weight) follows the norm.
        last = sorted(glob.glob(os.path.join(self.tag_dir, LAYER_FILES)), key=_layer_index)[-1]
        self.untied = "lm_head.weight" in self._load(last)
        try:
            with megatron_enum_stubs(enums):
                self.ds = DeepSpeedCheckpoint(self.tag_dir, final_layer_norm_idx=-2 if self.untied else -1)
                saved = dict(_plain_args(self.ds.get_args()))
                saved["checkpoint_version"] = self.ds.get_checkpoint_info("checkpoint_version") or 0
        except (AssertionError, RuntimeError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise MegatronCheckpointError(f"DeepSpeed's reader refuses {self.tag_dir}: {first}") from None
        self.args = saved
        self.blocked_qkv = FPDT_MARKER in saved
        if bool(saved.get("untie_embeddings_and_output_weights")) != self.untied:
            raise MegatronCheckpointError(f"args.untie_embeddings_and_output_weights = "
                                          f"{saved.get('untie_embeddings_and_output_weights')!r} but the head "
                                          f"{'has' if self.untied else 'has no'} file of its own")
        self.tp, self.pp = self.ds.tp_degree, self.ds.pp_degree
        embedding = [self._load(f) for f in self.ds.get_embedding_files(0)]
        words = self.tp * embedding[0]["word_embeddings.weight"].shape[0] if embedding else 0
        self.cfg: ModelConfig = config_from_args(megatron_args(saved), vocab_size=words)
        # DeepSpeedCheckpoint groups the blocks L // p per stage (more groups than p when p does not divide L)
        self.stages = sorted({stage for _, stage in self.ds.transformer_file_map})
        n = sum(len(self.ds.transformer_file_map[(0, s)]) for s in self.stages)
        if n != self.cfg.num_layers:
            raise MegatronCheckpointError(f"the checkpoint has {n} transformer layer files per TP rank, "
                                          f"args.num_layers = {self.cfg.num_layers}")
        self.expected = _expected(self.cfg)

    @staticmethod
    def _load(path: str) -> dict[str, torch.Tensor]:
        from mtds.checkpoint.safe_load import UnreadableFileError, UnsafeCheckpointError, safe_load
        try:
            state = safe_load(path, allowed=[])
        except (UnreadableFileError, UnsafeCheckpointError) as err:
            raise MegatronCheckpointError(str(err)) from None
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise MegatronCheckpointError(f"{path} is not a layer's state_dict")
        return state

    def _merge(self, layer: int, table: Mapping[str, tuple[str, str]], files: list[str]) -> dict[str, torch.Tensor]:
        """One layer's full tensors in mtds's names from its TP pieces (``files`` in TP rank order)."""
        pieces = [self._load(f) for f in files]
        names = set(pieces[0])
        for f, p in zip(files, pieces):
            if set(p) != names:
                raise MegatronCheckpointError(f"{f} holds {sorted(set(p) ^ names)} unlike TP rank 0's file")
        unknown = sorted(names - set(table))
        if unknown:
            raise MegatronCheckpointError(f"{files[0]} holds {unknown}, which the model the arguments describe has "
                                          f"no place for")
        where = layer if layer in (0, self.cfg.num_layers + 1, self.cfg.num_layers + 2) else 1
        want = {t: shape for (lay, t), shape in self.expected.items() if lay == where}
        out = {}
        for name in names:
            target, kind = table[name]
            out[target] = merge(self.cfg, name, kind, [p[name] for p in pieces], files, blocked_qkv=self.blocked_qkv)
            if tuple(out[target].shape) != want.get(target):
                raise MegatronCheckpointError(f"{name} of {files[0]} merges to shape {list(out[target].shape)}, the "
                                              f"arguments give {list(want[target]) if target in want else 'none'}")
        missing = sorted(set(want) - set(out))
        if missing:
            raise MegatronCheckpointError(f"{files[0]} lacks the tensors mtds names {missing}")
        return out

    def layers(self) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """(mtds global layer, {mtds name: full tensor}) in layer order, one layer in memory at a time."""
        ds, L = self.ds, self.cfg.num_layers
        yield 0, self._merge(0, EMBEDDING, [ds.get_embedding_files(r)[0] for r in range(self.tp)])
        layer = 1
        for stage in self.stages:
            for k in range(len(ds.transformer_file_map[(0, stage)])):
                files = [ds.transformer_file_map[(r, stage)][k][0] for r in range(self.tp)]
                yield layer, self._merge(layer, BLOCK, files)
                layer += 1
        yield L + 1, self._merge(L + 1, FINAL_NORM, [ds.get_final_norm_files(r)[0] for r in range(self.tp)])
        if self.untied:
            from deepspeed.checkpoint.reshape_utils import get_files_with_prefix
            files = get_files_with_prefix(ds.layer_files, ds.layer_keys[-1] + "-")
            yield L + 2, self._merge(L + 2, HEAD, files)


def _layer_index(path: str) -> int:
    return int(re.search(r"layer_(\d+)-model_", os.path.basename(path)).group(1))


def _expected(cfg: ModelConfig) -> dict[tuple[int, str], tuple[int, ...]]:
    """{(0 embedding | 1 any block | L+1 final norm | L+2 head, mtds name): full shape}."""
    shapes = keys.expected_shapes(cfg)
    out = {}
    for row in keys.table(cfg):
        shape = shapes[row.key]
        out[(1, row.name) if row.layer is None else (row.layer, row.name)] = shape[1:] if row.layer is None else shape
    return out


def merge(cfg: ModelConfig, name: str, kind: str, parts: list[torch.Tensor], files: list[str], *,
          blocked_qkv: bool) -> torch.Tensor:
    """The full tensor from its TP pieces, as Megatron's parallel layers split it."""
    if kind == "rep":
        for f, p in zip(files[1:], parts[1:]):
            if p.shape != parts[0].shape or not torch.equal(p, parts[0]):
                raise MegatronCheckpointError(f"{name} differs between {files[0]} and {f}; Megatron keeps it "
                                              f"replicated over TP ranks")
        return parts[0].clone()
    if kind == "row":
        return torch.cat(parts, dim=1)
    if kind == "col":
        return torch.cat(parts, dim=0)
    if blocked_qkv:        # each rank: [q | k | v] of its heads
        thirds = [p.chunk(3) for p in parts]
        return torch.cat([torch.cat([t[i] for t in thirds]) for i in range(3)])
    # each rank: [q_h, k_h, v_h] per head of its own; whole heads per rank, so the rows concatenate into the
    # per-group interleave of keys.qkv_to_mtds with one head per group
    return keys.qkv_to_mtds(cfg, torch.cat(parts))


def megatron_deepspeed_to_mtds(path: str, out: str, *, tp: int, pp: int, dtype: torch.dtype | None = None) -> str:
    from mtds.megatron.convert import write_converted
    ckpt = MegatronDeepSpeedCheckpoint(path)
    return write_converted(ckpt.cfg, ckpt.layers, out, tp=tp, pp=pp, dtype=dtype)


__all__ = ["MegatronDeepSpeedCheckpoint", "megatron_deepspeed_to_mtds", "check_pickles", "merge"]
