"""Read HF checkpoints one tensor at a time: safetensors (single or index.json shards), pytorch_model.bin
(single or sharded), or an in-memory state dict."""
from __future__ import annotations

import json
import os
from typing import Any, Mapping

import torch

_LAYOUTS = (("model.safetensors.index.json", "safetensors"), ("model.safetensors", "safetensors"),
            ("pytorch_model.bin.index.json", "bin"), ("pytorch_model.bin", "bin"))


class HFCheckpoint:
    """keys() and get(key); opens each shard file lazily and once."""

    def __init__(self, source: str | os.PathLike | Mapping[str, torch.Tensor]):
        self._state: Mapping[str, torch.Tensor] | None = None
        self._files: dict[str, Any] = {}
        if isinstance(source, Mapping):
            self._state, self._where = source, {}
            return
        path = os.fspath(source)
        if os.path.isdir(path):
            found = [name for name, _ in _LAYOUTS if os.path.isfile(os.path.join(path, name))]
            if not found:
                raise FileNotFoundError(f"no HF weights in {path}: expected one of {[n for n, _ in _LAYOUTS]}")
            path = os.path.join(path, found[0])
        if path.endswith(".index.json"):
            with open(path) as f:
                weight_map = json.load(f)["weight_map"]
            folder = os.path.dirname(path)
            self._where = {key: os.path.join(folder, name) for key, name in weight_map.items()}
        else:
            self._where = {key: path for key in self._open(path).keys()}

    def _open(self, file: str) -> Any:
        if file not in self._files:
            if file.endswith(".safetensors"):
                from safetensors import safe_open
                self._files[file] = safe_open(file, framework="pt", device="cpu")
            else:   # mmap: a shard is paged in as its tensors are read, not loaded whole; tensors only
                from mtds.checkpoint.safe_load import safe_load
                self._files[file] = safe_load(file, mmap=True, allowed=[])
        return self._files[file]

    def keys(self) -> list[str]:
        return list(self._state) if self._state is not None else list(self._where)

    def get(self, key: str) -> torch.Tensor:
        if self._state is not None:
            return self._state[key]
        handle = self._open(self._where[key])
        return handle.get_tensor(key) if hasattr(handle, "get_tensor") else handle[key]
