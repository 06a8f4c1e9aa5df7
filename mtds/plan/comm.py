"""Alpha-beta cost of ring collectives and point-to-point messages.

Ring algorithms (Patarasuk & Yuan 2009; Thakur et al. 2005) on n ranks with per-GPU link
bandwidth B and per-step latency alpha, for a buffer of S bytes per rank:
    all-reduce      2 (n-1)/n * S / B + 2 (n-1) alpha
    all-gather      (n-1)/n * S / B + (n-1) alpha     (S = gathered size)
    reduce-scatter  (n-1)/n * S / B + (n-1) alpha     (S = input size)
B is the effective link bandwidth from Cluster.link_gbps (datasheet x efficiency). Which link a
group uses follows from the rank order (tensor innermost, then data, then pipeline): a group of
n ranks with stride k spans n*k consecutive GPUs.
"""
from __future__ import annotations

from mtds.plan.hardware import Cluster


def _bw(cluster: Cluster, n: int, stride: int) -> float:
    return cluster.link_gbps(n * stride) * 1e9


def all_reduce(nbytes: float, n: int, stride: int, cluster: Cluster) -> float:
    if n <= 1:
        return 0.0
    return 2.0 * (n - 1) / n * nbytes / _bw(cluster, n, stride) + 2 * (n - 1) * cluster.calib.hop_latency_s


def all_gather(nbytes: float, n: int, stride: int, cluster: Cluster) -> float:
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes / _bw(cluster, n, stride) + (n - 1) * cluster.calib.hop_latency_s


reduce_scatter = all_gather  # same volume and steps as all-gather on a ring


def p2p(nbytes: float, cross_node: bool, cluster: Cluster) -> float:
    """One send between neighbouring pipeline stages."""
    span = cluster.per_node + 1 if cross_node else 2
    return nbytes / (cluster.link_gbps(span) * 1e9) + cluster.calib.hop_latency_s
