"""Stream full logical layers into a HuggingFace directory (config.json + safetensors shards + index),
holding at most one output shard in memory, and copy the tokenizer when one is known."""
from __future__ import annotations

import json
import os
import shutil
from typing import Iterator

import torch

from mtds.model.config import ModelConfig
from mtds.hf.registry import hf_config_dict, weight_table
from mtds.hf.table import rows_by_layer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                   "tokenizer.model", "added_tokens.json")
DEFAULT_SHARD_BYTES = 2 * 2 ** 30


def _save(tensors: dict[str, torch.Tensor], path: str) -> None:
    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata={"format": "pt"})


def write_hf_dir(out_dir: str, cfg: ModelConfig, layers: Iterator[tuple[int, dict[str, torch.Tensor]]], *,
                 max_shard_bytes: int = DEFAULT_SHARD_BYTES, tokenizer: str | None = None,
                 dtype: torch.dtype | None = None) -> list[str]:
    """Write ``out_dir``; returns the weight file names."""
    os.makedirs(out_dir, exist_ok=True)
    config = hf_config_dict(cfg)   # refuses a ModelConfig the HF architecture cannot express, before any work
    rows = rows_by_layer(weight_table(cfg))
    files: list[str] = []
    current: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        nonlocal current, size
        if current:
            name = f"part-{len(files):05d}.safetensors.tmp"
            _save(current, os.path.join(out_dir, name))
            files.append(name)
            current, size = {}, 0

    for layer, tensors in layers:
        for row in rows[layer]:
            for key, t in zip(row.hf_keys, row.to_hf(tensors[row.name]), strict=True):
                t = t if dtype is None or not t.is_floating_point() else t.to(dtype)
                current[key] = t
                size += t.numel() * t.element_size()
        del tensors
        if size >= max_shard_bytes:
            flush()
    flush()

    final = (["model.safetensors"] if len(files) == 1 else
             [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))])
    weight_map = {}
    for tmp, name in zip(files, final):
        os.replace(os.path.join(out_dir, tmp), os.path.join(out_dir, name))
        if len(final) > 1:
            from safetensors import safe_open
            with safe_open(os.path.join(out_dir, name), framework="pt") as f:
                weight_map.update({k: name for k in f.keys()})
    if len(final) > 1:
        total = sum(os.path.getsize(os.path.join(out_dir, n)) for n in final)
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    if dtype is not None:
        config["torch_dtype"] = str(dtype).removeprefix("torch.")
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if tokenizer:
        copy_tokenizer(tokenizer, out_dir)
    return final


def copy_tokenizer(source: str, out_dir: str) -> bool:
    """Copy tokenizer files from a local directory; False if ``source`` is not one (e.g. a hub name)."""
    if not os.path.isdir(source):
        return False
    copied = False
    for name in TOKENIZER_FILES:
        path = os.path.join(source, name)
        if os.path.isfile(path):
            shutil.copy2(path, os.path.join(out_dir, name))
            copied = True
    return copied
