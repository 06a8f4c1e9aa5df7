"""Bytes a node's link must send per training step, from the model and the layout (2 or more nodes,
ranks numbered node by node, as DeepSpeed's launcher does).

Ring collectives put mtds.parallel.ring.link_bytes on every edge of the ring (all-reduce 2 (n-1)/n x S,
all-gather and reduce-scatter (n-1)/n x S; gloo runs reduce-scatter as an all-reduce, mtds.parallel.ring.as_run).
When a group's ranks sit node by node, exactly one edge of its ring leaves each node, so a node's link
carries one edge per group that spans nodes.
"""
from __future__ import annotations

from mtds.parallel import ring


def ring_edge_bytes(kind: str, nbytes: float, n: int, backend: str = "gloo") -> float:
    """Bytes on one ring edge for a collective over n ranks; nbytes is the full (unsharded) size."""
    if kind not in ("all_reduce", "all_gather", "reduce_scatter"):
        raise ValueError(f"unknown collective {kind!r}")
    return ring.link_bytes(ring.as_run(kind, backend), nbytes, n)


def ptdp_link_bytes(*, microbatches: int, micro_batch: int, seq: int, hidden: int, vocab: int, tp: int,
                    pp: int, nodes: int, tied: bool = True, bytes_per_value: int = 4) -> float:
    """PTD-P with the pipeline split across nodes (tensor and data parallel groups inside a node), per
    node and step, in each direction: the stage-boundary activations (forward) or their gradients
    (backward) of every micro-batch, b s h values (DeepSpeed splits them over the t ranks of a stage and
    all-gathers on arrival, so the node sends b s h in all), plus the tied word-embedding gradient
    all-reduce between the first and the last stage (t groups of 2 ranks, V/t x h each)."""
    if nodes < 2 or pp < 2:
        return 0.0
    if pp != nodes:
        raise ValueError("this formula covers one pipeline stage per node (pp == nodes)")
    activations = microbatches * micro_batch * seq * hidden * bytes_per_value
    embedding = tp * ring_edge_bytes("all_reduce", vocab // tp * hidden * bytes_per_value, 2) if tied else 0.0
    # With pp > 2 a middle node sends activations forward and gradients backward: twice as much.
    return activations * (1 if pp == 2 else 2) + embedding


def zero3_link_bytes(*, params: int, world: int, nodes: int, microbatches: int = 1, gathered: float | None = None,
                     bytes_per_value: int = 4, backend: str = "gloo") -> float:
    """ZeRO-3 over all ranks, per node and step: parameter all-gathers of `gathered` values in all and a
    gradient reduce-scatter of P values per micro-batch. With DeepSpeed's default persistence and reuse
    settings and one micro-batch every parameter is gathered once (gathered = P, measured). With several
    micro-batches how many are gathered again depends on DeepSpeed's prefetch/reuse heuristics (measured
    2.68 P at 4 micro-batches for gpt2-tiny), so callers may pass the volume the tracer saw."""
    if nodes < 2:
        return 0.0
    gathered_bytes = (params if gathered is None else gathered) * bytes_per_value
    return (ring_edge_bytes("all_gather", gathered_bytes, world)
            + microbatches * ring_edge_bytes("reduce_scatter", params * bytes_per_value, world, backend))


def zero1_link_bytes(*, params: int, world: int, nodes: int, bytes_per_value: int = 4,
                     grad_reduce: str = "reduce-scatter") -> float:
    """ZeRO-1 data parallelism over all ranks, P values: the gradients reduce-scattered (mtds's default,
    a ring over point-to-point messages even on gloo: mtds.parallel.dp_reduce) or all-reduced (DeepSpeed's own,
    ``--zero1-grad-reduce all-reduce``), then the updated parameter partitions all-gathered."""
    if nodes < 2:
        return 0.0
    full = params * bytes_per_value
    grads = ring.link_bytes("reduce_scatter", full, world) if grad_reduce == "reduce-scatter" \
        else ring_edge_bytes("all_reduce", full, world)
    return grads + ring_edge_bytes("all_gather", full, world)
