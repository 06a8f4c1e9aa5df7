"""Load HF checkpoints (dir, file or state dict) into whole models or a pipeline stage's layers,
slicing each full tensor to this rank's tensor-parallel shard."""
from __future__ import annotations

import re
from typing import Any, Callable, Mapping

import torch

from mtds.model.shard import load_full_state
from mtds.model.config import ModelConfig

from mtds.hf.checkpoint import HFCheckpoint
from mtds.hf.common import UnsupportedHFConfig
from mtds.hf.registry import adapter_for, hf_state_to_layers, weight_table


def open_hf_checkpoint(cfg: ModelConfig, source: Any, *, strict: bool = True) -> Callable[[str], torch.Tensor]:
    """get_tensor(key) over a HF dir / file / state dict, resolving the adapter's key aliases and
    checkpoints saved without the base-model prefix. strict: refuse keys the table does not explain
    (an unexpected weight means the HF model differs from what we would build)."""
    adapter = adapter_for(cfg.architecture)
    ckpt = source if isinstance(source, HFCheckpoint) else HFCheckpoint(source)
    available = set(ckpt.keys())

    def resolve(key: str) -> str:
        candidates = [key, *adapter.KEY_ALIASES.get(key, ())]
        candidates += [c[len(adapter.BASE_PREFIX):] for c in list(candidates) if c.startswith(adapter.BASE_PREFIX)]
        for c in candidates:
            if c in available:
                return c
        raise KeyError(f"HF checkpoint has no tensor {key!r} (tried {candidates})")

    if strict:
        used = {resolve(k) for row in weight_table(cfg) for k in row.hf_keys}
        ignored = [re.compile(p) for p in adapter.IGNORED_KEYS]
        tied_copies = {"lm_head.weight", "embed_out.weight"} if cfg.tie_word_embeddings else set()
        extra = sorted(k for k in available - used - tied_copies if not any(p.search(k) for p in ignored))
        if extra:
            raise UnsupportedHFConfig(f"{len(extra)} HF tensor(s) have no place in the {cfg.architecture} model "
                                      f"mtds builds, e.g. {extra[:3]}")
    return lambda key: ckpt.get(resolve(key))


def load_hf_into_modules(cfg: ModelConfig, modules: Mapping[int, torch.nn.Module], source: Any, tp_group=None,
                         *, strict: bool = True, read: dict[str, int] | None = None) -> None:
    """Load HF weights into the given global layers only (e.g. one pipeline stage's), sliced to this
    rank's tensor-parallel shards. Tensors of layers not in ``modules`` are never read. ``read``: filled with
    {HF tensor name: its number of elements} of every tensor read (whole, before slicing)."""
    get_tensor = open_hf_checkpoint(cfg, source, strict=strict)
    if read is not None:
        get_any = get_tensor

        def get_tensor(key: str) -> torch.Tensor:
            tensor = get_any(key)
            read[key] = tensor.numel()
            return tensor
    for index, tensors in hf_state_to_layers(cfg, get_tensor, layers=modules.keys()):
        load_full_state(modules[index], tensors, tp_group, strict=strict)


def load_hf_into_model(model, hf_dir_or_state_dict: Any, *, strict: bool = True) -> None:
    """Load a HF checkpoint directory (safetensors or .bin, sharded or not) or state dict into a GPTModel."""
    load_hf_into_modules(model.cfg, model.global_layers(), hf_dir_or_state_dict, model.tp_group, strict=strict)
