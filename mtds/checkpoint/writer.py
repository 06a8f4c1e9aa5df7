"""Write a weights-only mtds checkpoint at a given (t, p) from a stream of full logical layers.

The files are exactly what DeepSpeed writes for that layout (see dsformat.py), so ``train.py --load``
resumes from them at that layout through DeepSpeed's own loader (module only: no optimizer state yet).

Memory: with p > 1 every layer becomes its own t files as it streams past, so peak memory is about
one layer. With p = 1 DeepSpeed keeps each TP rank's whole module in one file; we build one rank's
file at a time (re-reading the source per rank), so peak memory is about 1/t of the model.
"""
from __future__ import annotations

import os
import shutil
from typing import Callable, Iterator

import torch

from mtds.model.config import ModelConfig

from mtds.checkpoint.dsformat import engine_state, mp_rank_file, own_storage, write_layer_file
from mtds.checkpoint.complete import STAGING_SUFFIX, Marker
from mtds.checkpoint.meta import CheckpointMeta
from mtds.checkpoint.names import sequential_name
from mtds.checkpoint.shard_spec import shard
from mtds.checkpoint.commit import commit, describe_files, write_manifest

Layers = Iterator[tuple[int, dict[str, torch.Tensor]]]
WEIGHTS_TAG = "global_step0"


def _meta(cfg: ModelConfig, tp: int, pp: int, tokenizer: str | None) -> CheckpointMeta:
    return CheckpointMeta(model=cfg.to_dict(), tp=tp, pp=pp, dp=1, step=0, tokenizer=tokenizer, weights_only=True,
                          pipeline=pp > 1)


def write_weights_checkpoint(out_dir: str, cfg: ModelConfig, layers: Callable[[], Layers], *, tp: int, pp: int,
                             dtype: torch.dtype | None = None, tokenizer: str | None = None) -> str:
    """``layers()`` returns a fresh lazy iterator of (global layer, {name: full tensor}); returns the tag dir."""
    # Written like a training save (complete.py): a staging folder, a manifest, the marker, a rename.
    tag_dir = os.path.join(out_dir, WEIGHTS_TAG + STAGING_SUFFIX)
    shutil.rmtree(tag_dir, ignore_errors=True)
    os.makedirs(tag_dir)
    meta = _meta(cfg, tp, pp, tokenizer)
    client = {"mtds_meta": meta.__dict__.copy(), "mtds_step": 0}

    def cast(x: torch.Tensor) -> torch.Tensor:
        return x if dtype is None or not x.is_floating_point() else x.to(dtype)

    if pp > 1:
        for layer, tensors in layers():
            for r in range(tp):
                write_layer_file(tag_dir, layer, r, {n: cast(shard(cfg, layer, n, full, tp, r))
                                                     for n, full in tensors.items()})
            del tensors
        for mp in range(tp * pp):
            torch.save(engine_state(module=None, mp_world_size=tp * pp, dp_world_size=1, client_state=client),
                       mp_rank_file(tag_dir, mp))
    else:
        for r in range(tp):
            module = {sequential_name(cfg, layer, n): own_storage(cast(shard(cfg, layer, n, full, tp, r)))
                      for layer, tensors in layers() for n, full in tensors.items()}
            torch.save(engine_state(module=module, mp_world_size=tp, dp_world_size=1, client_state=client),
                       mp_rank_file(tag_dir, r))
            del module
    write_manifest(tag_dir, 0, describe_files(tag_dir, sorted(os.listdir(tag_dir))))
    return commit(out_dir, WEIGHTS_TAG, tag_dir, Marker(step=0, world_size=1), meta)
