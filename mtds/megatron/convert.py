"""Both directions between a Megatron-LM torch_dist checkpoint and an mtds checkpoint.

megatron -> mtds: the model config from the checkpoint's args and the flags (args.py), every tensor checked
against it by key and shape (keys.py), read at its global shape (dist_ckpt.py), re-laid out, and written as
an mtds weights-only checkpoint at any (t, p) (mtds.checkpoint.writer).
mtds -> megatron: full layers from any mtds checkpoint (mtds.checkpoint.reader), re-laid out, written as
one process's torch_dist checkpoint, which Megatron-core loads at any (t, p).

Memory: the whole model once, in each direction (a key holds one tensor of every layer).
"""
from __future__ import annotations

import argparse
import os
from typing import Any, Mapping

import torch

from mtds.model.config import ModelConfig

from mtds.megatron import dist_ckpt, keys
from mtds.megatron.args import args_from_config, config_from_args, merge_args
from mtds.megatron.common import read_common
from mtds.megatron.errors import MegatronCheckpointError


class MegatronCheckpoint:
    """A torch_dist checkpoint, its model config (args + flags) checked against its tensors."""

    def __init__(self, path: str, flags: Mapping[str, Any] | None = None):
        if not os.path.isdir(path):
            raise MegatronCheckpointError(f"Megatron checkpoint directory {path!r} does not exist")
        self.tag_dir = dist_ckpt.resolve_dir(path)
        dist_ckpt.check_backend(self.tag_dir)
        self.shapes = dist_ckpt.tensor_shapes(self.tag_dir)
        self.common = read_common(self.tag_dir, dist_ckpt.object_keys(self.tag_dir))
        args = merge_args(self.common.get("args"), flags or {})
        embedding = self.shapes.get("embedding.word_embeddings.weight")
        if embedding is None:
            raise MegatronCheckpointError(f"{self.tag_dir} has no embedding.word_embeddings.weight: not a "
                                          f"Megatron GPTModel checkpoint")
        fc2 = self.shapes.get(keys.LAYERS + "mlp.linear_fc2.weight")
        self.cfg: ModelConfig = config_from_args(args, vocab_size=embedding[0],
                                                 ffn_hidden_size=fc2[-1] if fc2 else None)
        self.stored = keys.check_keys(self.cfg, self.shapes)

    def layers(self):
        tensors = dist_ckpt.load_tensors(self.tag_dir, {s: self.shapes[s] for s in self.stored.values()})
        return keys.to_layers(self.cfg, {key: tensors[s] for key, s in self.stored.items()})


def megatron_to_mtds(path: str, out: str, *, tp: int, pp: int, flags: Mapping[str, Any] | None = None,
                     dtype: torch.dtype | None = None) -> str:
    ckpt = MegatronCheckpoint(path, flags)
    return write_converted(ckpt.cfg, ckpt.layers, out, tp=tp, pp=pp, dtype=dtype)


def write_converted(cfg, layers, out: str, *, tp: int, pp: int, dtype: torch.dtype | None = None) -> str:
    """A converted model's layers as an mtds checkpoint at (tp, pp): the layout checked against the model
    first, an existing non-empty ``out`` refused (both importers, Megatron-LM's and Megatron-DeepSpeed's)."""
    from mtds.checkpoint.writer import write_weights_checkpoint
    from mtds import rules
    rules.check_shards(cfg.facts(), tp=tp, pp=pp)
    if os.path.isdir(out) and os.listdir(out):
        raise FileExistsError(f"output directory {out!r} is not empty")
    return write_weights_checkpoint(out, cfg, layers, tp=tp, pp=pp, dtype=dtype)


def mtds_to_megatron(ckpt_dir: str, out: str, *, iteration: int | None = None,
                     dtype: torch.dtype | None = None) -> str:
    from mtds.checkpoint.reader import open_checkpoint
    ckpt = open_checkpoint(ckpt_dir)
    args = args_from_config(ckpt.cfg)      # refuses a model Megatron cannot express, before any work
    if os.path.isdir(out) and os.listdir(out):
        raise FileExistsError(f"output directory {out!r} is not empty")
    tensors = keys.from_layers(ckpt.cfg, ckpt.layers())
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    step = ckpt.meta.step if iteration is None else iteration
    common = {"args": argparse.Namespace(**args, iteration=step), "checkpoint_version": 3.0, "iteration": step}
    return dist_ckpt.write(out, step, tensors, common, extra_states(ckpt.cfg))


def extra_states(cfg: ModelConfig) -> dict[str, None]:
    """The ShardedObjects Megatron-core's linear layers save (``_extra_state``, None without Transformer
    Engine), one per layer under ``shard_<layer>_<num_layers>``: its loader asks for them by these keys."""
    linears = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")
    return {f"{keys.LAYERS}{m}._extra_state/shard_{i}_{cfg.num_layers}": None
            for m in linears for i in range(cfg.num_layers)}


__all__ = ["MegatronCheckpoint", "MegatronCheckpointError", "megatron_to_mtds", "mtds_to_megatron"]
