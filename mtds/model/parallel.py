"""The one check the model makes about tensor parallelism: every rank must get whole heads."""
from __future__ import annotations

from mtds.model.config import ModelConfig
from mtds.tp.layers import tp_world_and_rank


def check_tensor_parallel(cfg: ModelConfig, group) -> tuple[int, int]:
    """(t, tp_rank) for ``group``, after refusing shapes t cannot split evenly."""
    t, rank = tp_world_and_rank(group)
    for what, size in (("num_heads", cfg.num_heads), ("num_kv_heads", cfg.kv_heads),
                       ("ffn_hidden_size", cfg.ffn_size)):
        if size % t:
            raise ValueError(f"tensor parallel size {t} does not divide {what}={size}: "
                             f"choose t from {[d for d in range(1, size + 1) if size % d == 0]}")
    return t, rank
