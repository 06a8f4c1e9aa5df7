"""Ring collectives: the bytes each rank puts on its link, and the latency steps, for a group of n ranks.

The one definition of these volumes; the collective tracer (mtds.observe.comm_trace), the planner
(mtds.plan.comm, mtds.plan.tp_comm, mtds.plan.calibrate), the emulated-cluster formulas
(mtds.cluster) and benchmarks/comm_formulas.py all import it.

For a tensor of S bytes (all-gather: the gathered result; reduce-scatter: the full input), ring
algorithms (Thakur et al. 2005; Patarasuk & Yuan 2009) send over each rank's link, which is
what NCCL's "bus bandwidth" convention counts:
    all-reduce      2 (n-1)/n x S   in 2 (n-1) steps (a reduce-scatter, then an all-gather)
    all-gather        (n-1)/n x S   in n-1 steps
    reduce-scatter    (n-1)/n x S   in n-1 steps
    all-to-all        (n-1)/n x S   (each rank keeps 1/n of its input)
    broadcast, reduce, gather, scatter, send/recv: S;  barrier: nothing
A group of one rank moves nothing.

Pure Python, so that the planner can import it without torch.
"""
from __future__ import annotations

# Multiples of (n-1)/n x S per kind; kinds not listed send S once.
_RING_FACTOR = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1, "all_to_all": 1}


def link_bytes(kind: str, nbytes: float, n: int) -> float:
    """Bytes on each rank's link for one collective of ``kind`` over n ranks; nbytes is the full tensor S."""
    if n <= 1 or kind == "barrier":
        return 0.0
    factor = _RING_FACTOR.get(kind)
    if factor is None:
        return float(nbytes)
    return factor * (n - 1) * nbytes / n      # multiply first: exact for whole byte counts


def all_reduce(nbytes: float, n: int) -> float:
    """2 (n-1)/n x S."""
    return link_bytes("all_reduce", nbytes, n)


def all_gather(nbytes: float, n: int) -> float:
    """(n-1)/n x S, S the gathered result."""
    return link_bytes("all_gather", nbytes, n)


def reduce_scatter(nbytes: float, n: int) -> float:
    """(n-1)/n x S, S the full input."""
    return link_bytes("reduce_scatter", nbytes, n)


def payload_link_bytes(kind: str, payload: float, n: int) -> float:
    """:func:`link_bytes` in the tracer's payload convention, the tensor one rank hands to the call: for an
    all-gather that is its shard (S = n x shard, so (n-1) x shard); for every other kind it is S."""
    return link_bytes(kind, payload * n if kind == "all_gather" else payload, n)


def steps(kind: str, n: int) -> int:
    """Latency steps (messages in sequence) of a ring collective: 2 (n-1) for an all-reduce, n-1 for
    an all-gather or a reduce-scatter."""
    if n <= 1:
        return 0
    return (n - 1) * (2 if kind == "all_reduce" else 1)


def as_run(kind: str, backend: str) -> str:
    """The collective a backend actually runs: gloo implements reduce-scatter as an all-reduce and
    keeps its shard (measured on the emulated cluster: 1.50 x S per node at 2 x 2 ranks, the
    all-reduce's volume); NCCL runs a ring reduce-scatter."""
    return "all_reduce" if kind == "reduce_scatter" and backend == "gloo" else kind
