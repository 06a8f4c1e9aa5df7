"""Context parallelism's attention (Megatron's ``--context-parallel-size C``, ``--cp-comm-type a2a|p2p``).

The sequence is split over the C ranks of a context-parallel group with causal load balancing
(:mod:`mtds.cp.chunks`); attention is the one place where the ranks need each other's tokens:
``p2p`` passes K/V around a ring (:mod:`mtds.cp.ring`), ``a2a`` swaps the sequence split for a head
split with all-to-alls (:mod:`mtds.cp.ulysses`). Both take and return [b, h, s/C, d] tensors in the
load-balanced local order, causal over global positions, optionally masked to documents.
"""
from __future__ import annotations

from mtds.cp.chunks import (ContextParallelError, check_cp_sequence, gather_order, held_order, local_positions,
                            split_sequence)
from mtds.cp.ring import ring_attention
from mtds.cp.ulysses import check_ulysses_heads, ulysses_attention
from mtds.parallel.choices import CP_COMM_TYPES

COMM_TYPES = dict(zip(CP_COMM_TYPES, (ring_attention, ulysses_attention)))     # p2p: ring, a2a: Ulysses


def cp_attention(comm_type: str, q, k, v, *, group=None, segments=None, scale=None):
    """``ring_attention`` for "p2p", ``ulysses_attention`` for "a2a" (same arguments, same result)."""
    try:
        kernel = COMM_TYPES[comm_type]
    except KeyError:
        raise ContextParallelError(f"--cp-comm-type must be one of {sorted(COMM_TYPES)}, got {comm_type!r}") from None
    return kernel(q, k, v, group=group, segments=segments, scale=scale)


__all__ = ["ContextParallelError", "check_cp_sequence", "local_positions", "split_sequence", "gather_order",
           "held_order", "ring_attention", "ulysses_attention", "check_ulysses_heads", "cp_attention", "COMM_TYPES"]
