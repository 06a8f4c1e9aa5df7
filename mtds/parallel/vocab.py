"""The vocabulary as tensor parallelism splits it (Megatron's padding rule)."""
from __future__ import annotations


def padded_vocab_size(vocab_size: int, tp_size: int, multiple: int = 128) -> int:
    """Megatron pads the vocabulary up to a multiple of ``multiple * t`` so every shard is equal and aligned:
    ceil(V / (multiple t)) x multiple t. The one definition: the embedding (mtds.tp), the model config
    (mtds.model.config), the planner and the benchmarks use it."""
    step = multiple * tp_size
    return -(-vocab_size // step) * step
