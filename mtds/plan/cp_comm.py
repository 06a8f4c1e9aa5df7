"""What context parallelism (mtds.cp, docs/long_context.md) sends, and how much of it the step waits for.

Per transformer layer and micro-batch, on one rank of a group of c ranks (h_q, h_kv query and KV heads,
e = head_dim, t-way TP, w bytes per value, b micro-batch, s the whole sequence):

  p2p (ring)   forward: c − 1 hops, each K and V of s/c tokens to the ring neighbour,
                   hop = 2 · b · (s/c) · (h_kv/t) · e · w bytes;
               backward: the same c − 1 hops carry K/V and the dK/dV accumulators, 2 × the bytes.
               Each hop is started before the block it overlaps is computed (mtds.cp.ring), so only
               max(0, hop time − block compute time) is exposed per hop; a block is 1/c of the layer's
               attention core (scores, softmax, context), the backward's 2 × the forward's.
  a2a (Ulysses) forward: 4 all-to-alls (q, k, v in, the output back), each rank sending (c − 1)/c of its
                   tensor of b · (s/c) · (heads/t) · e · w bytes (heads = h_q for q and the output, h_kv
                   for k and v): (c − 1)/c · 2 · b · (s/c) · (h_q + h_kv)/t · e · w bytes in all;
               backward: the gradients of the same 4 tensors, the same bytes. Nothing overlaps them.

  ratio of the forward bytes p2p / a2a = c · h_kv / (h_q + h_kv).

Recomputation (full, or selective: the attention core, ring included) repeats the forward's traffic.
Links: the group is c ranks at stride t (rank order t innermost, then c), spanning c·t consecutive GPUs:
NVLink when c·t fits in a node, else the inter-node link bounds every hop (Cluster.link_gbps). A hop pays
one latency, an all-to-all c − 1 (a pairwise exchange).
"""
from __future__ import annotations

from mtds.plan import comm, compute
from mtds.plan.candidate import Candidate, Workload
from mtds.plan.hardware import Cluster
from mtds.plan.model_spec import ModelSpec


def _local_heads_bytes(model: ModelSpec, layout: Candidate, work: Workload, width: float) -> float:
    """Bytes of one [b, s/c, width/t] tensor (width = heads · e)."""
    return layout.microbatch * layout.local_seq(model.seq) * width / layout.tp * work.bytes_per_value


def p2p_hop_bytes(model: ModelSpec, layout: Candidate, work: Workload) -> float:
    """One forward ring hop: K and V of the rank's s/c tokens, 2 b (s/c) (h_kv/t) e w bytes."""
    return 2.0 * _local_heads_bytes(model, layout, work, model.cp_widths[1])


def p2p_forward_bytes(model: ModelSpec, layout: Candidate, work: Workload) -> float:
    """What one rank sends in one layer's forward: (c − 1) hops."""
    return (layout.cp - 1) * p2p_hop_bytes(model, layout, work)


def a2a_tensor_bytes(model: ModelSpec, layout: Candidate, work: Workload) -> tuple[float, float, float, float]:
    """The 4 tensors the forward's all-to-alls exchange (q, k, v, output), whole per rank: b (s/c) heads/t e w."""
    q = _local_heads_bytes(model, layout, work, model.cp_widths[0])
    kv = _local_heads_bytes(model, layout, work, model.cp_widths[1])
    return q, kv, kv, q


def a2a_forward_bytes(model: ModelSpec, layout: Candidate, work: Workload) -> float:
    """What one rank sends in one layer's forward: (c − 1)/c of each of the 4 tensors."""
    c = layout.cp
    return (c - 1) / c * sum(a2a_tensor_bytes(model, layout, work))


def forward_bytes(model: ModelSpec, layout: Candidate, work: Workload) -> float:
    """Forward bytes one rank sends per layer and micro-batch for its comm type (0 at c = 1)."""
    if layout.cp == 1:
        return 0.0
    if layout.cp_comm_type == "a2a":
        return a2a_forward_bytes(model, layout, work)
    return p2p_forward_bytes(model, layout, work)


def _link_bytes_per_s(layout: Candidate, cluster: Cluster) -> float:
    return cluster.link_gbps(layout.cp * layout.tp) * 1e9


def hop_time(nbytes: float, layout: Candidate, cluster: Cluster) -> float:
    """One point-to-point send to the ring neighbour."""
    return nbytes / _link_bytes_per_s(layout, cluster) + cluster.calib.hop_latency_s


def all_to_all_time(nbytes: float, layout: Candidate, cluster: Cluster) -> float:
    """One all-to-all of a tensor of ``nbytes`` per rank over the group: (c − 1)/c of it leaves each rank."""
    return comm.all_to_all(nbytes, layout.cp, layout.tp, cluster)


def exposed_forward_time(model: ModelSpec, layout: Candidate, work: Workload, cluster: Cluster) -> float:
    """Seconds of one layer's forward the step waits for context-parallel traffic (see the module docstring)."""
    if layout.cp == 1:
        return 0.0
    if layout.cp_comm_type == "a2a":
        return sum(all_to_all_time(x, layout, cluster) for x in a2a_tensor_bytes(model, layout, work))
    block = compute.layer_forward(model, layout, work, cluster).attention_core / layout.cp
    hop = hop_time(p2p_hop_bytes(model, layout, work), layout, cluster)
    return (layout.cp - 1) * max(0.0, hop - block)


def exposed_backward_time(model: ModelSpec, layout: Candidate, work: Workload, cluster: Cluster) -> float:
    """Backward: a2a the same 4 all-to-alls; p2p twice the bytes per hop against twice the block compute."""
    if layout.cp == 1:
        return 0.0
    if layout.cp_comm_type == "a2a":
        return exposed_forward_time(model, layout, work, cluster)
    block = 2.0 * compute.layer_forward(model, layout, work, cluster).attention_core / layout.cp
    hop = hop_time(2.0 * p2p_hop_bytes(model, layout, work), layout, cluster)
    return (layout.cp - 1) * max(0.0, hop - block)


def layer_time(model: ModelSpec, layout: Candidate, work: Workload, cluster: Cluster) -> float:
    """Exposed context-parallel seconds of one layer, one micro-batch: forward + backward, + the forward's
    again when recomputation reruns the attention (full or selective)."""
    fwd = exposed_forward_time(model, layout, work, cluster)
    recomputed = fwd if layout.recompute in ("full", "selective") else 0.0
    return fwd + exposed_backward_time(model, layout, work, cluster) + recomputed
