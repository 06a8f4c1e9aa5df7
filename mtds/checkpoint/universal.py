"""DeepSpeed universal checkpointing for mtds models: the patterns it needs, the conversion, and the
one gap we fill (the two module shapes name parameters differently).

``universal_info`` describes, over DeepSpeed parameter names of *both* namings (pipeline "3.mlp...",
sequential "layers.2.mlp..."), how each tensor is split: everything not listed is column-parallel
(DeepSpeed joins it on dim 0). A missing row-parallel pattern would reload wrong weights silently, so
the patterns come from the same table (spec.py) the readers use, and the tests reshard across t.
"""
from __future__ import annotations

import argparse
import glob
import os
import shutil

from mtds.model.config import ModelConfig

from mtds.checkpoint.complete import resolve_tag_dir
from mtds.checkpoint.errors import CheckpointFormatError
from mtds.checkpoint.meta import LATEST, CheckpointMeta
from mtds.checkpoint.names import ds_name, parse

UNIVERSAL_SUFFIX = "_universal"
DONE_MARKER = "mtds_universal_done"

# Layer prefixes of both namings; DeepSpeed matches with re.match (anchored at the start).
_BLOCK = r"^(\d+|layers\.\d+)\."
_ANY = r"^(\d+\.|layers\.\d+\.|embedding\.|final_norm\.|lm_head\.|tied_modules\.embed\.)"


def universal_info(cfg: ModelConfig, tp: int) -> dict:
    """``universal_checkpoint_info`` for a checkpoint saved at tensor-parallel size ``tp``."""
    d = cfg.head_dim
    qkv = (cfg.num_heads * d, cfg.kv_heads * d, cfg.kv_heads * d)
    sub_params, widths = [], {}

    def fused(name: str, sizes: tuple[int, ...], trailing: tuple[int, ...]) -> None:
        pattern = _BLOCK + name.replace(".", r"\.") + "$"
        sub_params.append({"patterns": [pattern], "shape": (sizes, *trailing), "partition_dim": 0})
        widths[pattern] = [[size // tp] * tp for size in sizes]

    fused("attention.qkv.weight", qkv, (cfg.hidden_size,))
    if cfg.qkv_bias:
        fused("attention.qkv.bias", qkv, ())
    if cfg.activation == "swiglu":
        ffn = (cfg.ffn_size, cfg.ffn_size)
        fused("mlp.fc_in.weight", ffn, (cfg.hidden_size,))
        if cfg.linear_bias:
            fused("mlp.fc_in.bias", ffn, ())
    head = [r"^(\d+\.|lm_head\.)weight$"] if not cfg.tie_word_embeddings else []
    # Strict conversion refuses patterns that match nothing, so list only what this model has.
    replicated = [_ANY + r"(.*_)?norm\.(weight|bias)$"]                     # block norms and the final norm
    if cfg.position_embedding == "learned":
        replicated.append(_ANY + r"position_embeddings\.weight$")
    # row-parallel biases are added once after the reduce: replicated
    row_biases = [name for name, has in ((r"attention\.out_proj", cfg.has_out_proj_bias),
                                         (r"mlp\.fc_out", cfg.linear_bias)) if has]
    if row_biases:
        replicated.append(_BLOCK + rf"({'|'.join(row_biases)})\.bias$")
    return {
        "universal_checkpoint_version": 0.4,
        "tp_replicated_parameter_patterns": replicated,
        "parameter_with_row_parallelism_patterns": [_BLOCK + r"(attention\.out_proj|mlp\.fc_out)\.weight$"],
        "vocabulary_parameter_patterns": [_ANY + r"word_embeddings\.weight$", *head],
        "pipeline_replicated_parameter_patterns": [r"^tied_modules\.embed\."],
        "parameter_with_sub_params": sub_params,
        "sub_param_shard_widths": widths,
        "original_vocab_size": cfg.vocab_size,
        "padded_vocab_size": cfg.padded_vocab_size(tp),
    }


def universal_dir(root: str, tag: str) -> str:
    return os.path.join(root, tag + UNIVERSAL_SUFFIX)


def ensure_universal(root: str, tag: str | None = None) -> str:
    """Convert ``root/tag`` (default: latest) to ``root/tag_universal`` once; return that folder.

    Call on one rank only. The conversion is DeepSpeed's ds_to_universal (ZeRO-1/2 partitions merged
    and TP slices joined per parameter), or ours for ZeRO-0 (zero0.py, same output layout, so DeepSpeed
    loads it into ZeRO-1/2 too); afterwards every parameter folder gets an alias under the other naming,
    so a pipeline checkpoint resumes without a pipeline (p = 1) and vice versa.
    """
    tag_dir = resolve_tag_dir(os.path.join(root, tag) if tag else root)
    root, tag = os.path.split(os.path.normpath(tag_dir))
    meta = CheckpointMeta.load(tag_dir)
    out = universal_dir(root, tag)
    # zero/optimizer_state.pt: ZeRO-0 conversions of earlier mtds versions lack it (ZeRO-0 engines only)
    if all(os.path.isfile(os.path.join(out, *f)) for f in ((DONE_MARKER,), ("zero", "optimizer_state.pt"))):
        return out
    if meta.model_config.num_experts:
        from mtds.checkpoint.reshard_experts import check_convertible
        check_convertible(tag_dir, meta)        # before anything is written
    if meta.weights_only:
        raise CheckpointFormatError(f"{tag_dir} holds weights only (no optimizer state): nothing to reshard")
    shutil.rmtree(out, ignore_errors=True)      # a conversion that did not finish
    if meta.model_config.num_experts:
        # DeepSpeed's converter would merge every EP shard's experts as one tensor's partitions: ours
        from mtds.checkpoint.reshard_experts import write_universal_from_moe       # (checked above)
        write_universal_from_moe(tag_dir, out, meta)
    elif meta.zero_stage == 0:
        # DeepSpeed's converter reads ZeRO partitions only; a ZeRO-0 checkpoint gets our own converter.
        from mtds.checkpoint.reshard_zero0 import write_universal_from_zero0
        write_universal_from_zero0(tag_dir, out, meta)
    else:
        _deepspeed_convert(tag_dir, out)
    _add_name_aliases(os.path.join(out, "zero"), meta.model_config)
    meta.save(out)
    with open(os.path.join(out, DONE_MARKER), "w") as f:
        f.write(tag)
    return out


def _deepspeed_convert(tag_dir: str, out: str) -> None:
    if not glob.glob(os.path.join(tag_dir, "*optim_states.pt")):
        raise CheckpointFormatError(f"{tag_dir} has no ZeRO optimizer files (partial checkpoint?)")
    from deepspeed.checkpoint import ds_to_universal
    args = argparse.Namespace(input_folder=tag_dir, output_folder=out, num_extract_workers=1, num_merge_workers=1,
                              keep_temp_folder=False, strict=True, inject_missing_state=False)
    try:
        ds_to_universal.main(args)
    except (AssertionError, KeyError, ValueError, RuntimeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointFormatError(f"DeepSpeed could not convert {tag_dir} to universal: {first}") from None


def _add_name_aliases(zero_dir: str, cfg: ModelConfig) -> None:
    """Symlink every parameter folder under its name in the other module shape."""
    for name in os.listdir(zero_dir):
        path = os.path.join(zero_dir, name)
        if not os.path.isdir(path):
            continue
        try:
            layer, inner = parse(cfg, name)
        except KeyError:
            continue
        for pipeline in (True, False):
            alias = os.path.join(zero_dir, ds_name(cfg, layer, inner, pipeline))
            if not os.path.exists(alias):
                os.symlink(name, alias)


__all__ = ["universal_info", "ensure_universal", "universal_dir", "LATEST"]
