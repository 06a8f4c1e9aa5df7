"""Layout-independent initialisation: every global layer draws from its own seeded stream.

A layer's weights depend only on (seed, global layer index, cfg): the tp layers keep the slice of
the *full* tensor's fill (built chunk by chunk, mtds/tp/init_shard.py), and each layer re-seeds, so neither t nor the pipeline split (which
layers a stage builds, in which order) changes a single initial weight.
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable, Iterator

import torch

from mtds.model.config import ModelConfig
from mtds.tp.init_shard import NormalInit

# A large prime stride keeps per-layer streams apart for any realistic base seed.
_LAYER_STRIDE = 1_000_003


def seed_for(seed: int, global_layer_index: int) -> int:
    return seed + _LAYER_STRIDE * global_layer_index


@contextlib.contextmanager
def seeded(seed: int, global_layer_index: int) -> Iterator[None]:
    """Run a layer's construction on a private CPU stream; the caller's RNG state is untouched.

    Only the CPU generator is forked and seeded (params are built on CPU, then moved): torch.manual_seed
    would also reseed CUDA generators outside the fork.
    """
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed_for(seed, global_layer_index))
        yield


def normal_init(std: float) -> Callable[[torch.Tensor], None]:
    """normal_(0, std); as a ``NormalInit`` the tp layers can build each shard without the full matrix."""
    return NormalInit(std)


def output_init(cfg: ModelConfig) -> Callable[[torch.Tensor], None]:
    """GPT-2: projections that write into the residual stream scaled by 1/sqrt(2 L) (two per layer),
    so the residual's variance does not grow with depth."""
    return normal_init(cfg.init_std / math.sqrt(2.0 * cfg.num_layers))
