"""Alpha-beta cost of ring collectives and point-to-point messages.

A ring collective over n ranks with per-GPU link bandwidth B and per-step latency alpha takes
mtds.parallel.ring.link_bytes / B + mtds.parallel.ring.steps x alpha:
    all-reduce      2 (n-1)/n * S / B + 2 (n-1) alpha
    all-gather      (n-1)/n * S / B + (n-1) alpha     (S = gathered size)
    reduce-scatter  (n-1)/n * S / B + (n-1) alpha     (S = input size)
    all-to-all      (n-1)/n * S / B + (n-1) alpha     (S = the tensor each rank holds; a pairwise exchange,
                                                       (n-1)/n of it leaves the rank, one latency per peer)
B is the effective link bandwidth from Cluster.link_gbps (datasheet x efficiency). Which link a
group uses follows from the rank order (tensor innermost, then data, then pipeline): a group of
n ranks with stride k spans n*k consecutive GPUs.
"""
from __future__ import annotations

from mtds.parallel import ring
from mtds.plan.hardware import Cluster


def _bw(cluster: Cluster, n: int, stride: int) -> float:
    return cluster.link_gbps(n * stride) * 1e9


def ring_time(kind: str, nbytes: float, n: int, stride: int, cluster: Cluster) -> float:
    """Seconds of one ring collective of ``kind`` on the link a group of n ranks with this stride uses."""
    if n <= 1:
        return 0.0
    return ring.link_bytes(kind, nbytes, n) / _bw(cluster, n, stride) + ring.steps(kind, n) * cluster.calib.hop_latency_s


def all_reduce(nbytes: float, n: int, stride: int, cluster: Cluster) -> float:
    return ring_time("all_reduce", nbytes, n, stride, cluster)


def all_gather(nbytes: float, n: int, stride: int, cluster: Cluster) -> float:
    return ring_time("all_gather", nbytes, n, stride, cluster)


def reduce_scatter(nbytes: float, n: int, stride: int, cluster: Cluster) -> float:
    return ring_time("reduce_scatter", nbytes, n, stride, cluster)


def all_to_all(nbytes: float, n: int, stride: int, cluster: Cluster) -> float:
    """One all-to-all of a tensor of ``nbytes`` per rank over n ranks (context parallelism's Ulysses, expert
    parallelism's dispatch and return)."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes / _bw(cluster, n, stride) + (n - 1) * cluster.calib.hop_latency_s


def p2p(nbytes: float, cross_node: bool, cluster: Cluster) -> float:
    """One send between neighbouring pipeline stages."""
    span = cluster.per_node + 1 if cross_node else 2
    return nbytes / (cluster.link_gbps(span) * 1e9) + cluster.calib.hop_latency_s
