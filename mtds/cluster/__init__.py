"""Emulated multi-node cluster on one Linux machine (network namespaces, veth, a bridge, tc shaping)
and DeepSpeed's multi-node launch inside it. ``mtds-cluster --help`` explains the console script."""
from mtds.cluster.cluster import Cluster, ClusterSpec, status
from mtds.cluster.netns import ClusterError, remove_namespaces, unavailable_reason

__all__ = ["Cluster", "ClusterSpec", "ClusterError", "remove_namespaces", "status", "unavailable_reason"]
