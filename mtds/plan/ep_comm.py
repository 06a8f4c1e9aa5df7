"""What expert parallelism (docs/moe.md, mtds.model.dispatch) sends, per MoE block and micro-batch.

Each rank routes its b · (s/c) tokens to k experts each; the dispatcher sends every assignment's row (h values)
to the rank holding its expert and the expert's output back (dropless: every assignment travels). Every TP rank
of a replica exchanges the whole rows with the same TP rank of its EP peers (the experts are TP-split inside,
their input whole). With the experts' load balanced, (e − 1)/e of the b · (s/c) · k rows leave the rank:

  one all-to-all      b · (s/c) · k · h · w bytes held, (e − 1)/e of them sent (w bytes per value)
  per block           forward 2 (dispatch, return), backward 2 (the same exchanges reversed),
                      + 2 when full recomputation reruns the forward.

The group is e consecutive data ranks: stride t·c, spanning e·t·c GPUs (mtds.parallel.layout, DeepSpeed's
arrangement), timed by comm.all_to_all on the cluster's links (NVLink within a node, the network across).
Not modelled: the per-block exchange of the E expert counts (E integers) and load imbalance (a hot expert's
rank receives more than the average).

Overlap (:func:`exposed_layer_time`): nothing hides the all-to-alls, except under DualPipeV with
``overlap_moe_expert_parallel_comm``. There, in the steady state, each rank runs one chunk's forward beside the
other chunk's backward (an overlapped pair): the forward's dispatch and return run under the backward's compute,
the backward's (and recomputation's) exchanges under the forward's compute, and only what exceeds it is exposed,
max(0, a2a − compute). DeepSpeed's DualPipeVSchedule gives rank r 2m − 3p + 1 + r such pairs of its 2m chunk
passes (counted from its instruction stream, lab.pipe_sim.dualpipev_sim; tests/test_plan_moe.py); the planner
takes rank 0's, the fewest. Fill and drain (the bubble's passes) overlap nothing.
"""
from __future__ import annotations

from mtds.plan import comm, compute
from mtds.plan.candidate import Candidate, Workload
from mtds.plan.hardware import Cluster
from mtds.plan.model_spec import ModelSpec


def a2a_tensor_bytes(model: ModelSpec, layout: Candidate, work: Workload) -> float:
    """The rows one rank holds for one all-to-all: b (s/c) k h w bytes."""
    return (layout.microbatch * layout.local_seq(model.seq) * model.moe_top_k * model.hidden
            * work.bytes_per_value)


def a2a_sent_bytes(model: ModelSpec, layout: Candidate, work: Workload) -> float:
    """Bytes leaving one rank in one all-to-all: (e − 1)/e of the rows (0 at e = 1 or on a dense model)."""
    e = layout.ep
    if e == 1 or not model.moe_blocks:
        return 0.0
    return (e - 1) / e * a2a_tensor_bytes(model, layout, work)


def exchanges_per_block(layout: Candidate) -> int:
    """All-to-alls per MoE block and micro-batch: 2 forward + 2 backward, + 2 under full recomputation."""
    return 6 if layout.recompute == "full" else 4


def layer_time(model: ModelSpec, layout: Candidate, work: Workload, cluster: Cluster) -> float:
    """Seconds of one layer (averaged over the l blocks: only moe_fraction of them are MoE) and micro-batch."""
    if layout.ep == 1 or not model.moe_blocks:
        return 0.0
    # an expert-parallel group: e consecutive ranks of the d·c data axis, t apart (mtds.parallel.layout)
    one = comm.all_to_all(a2a_tensor_bytes(model, layout, work), layout.ep, layout.tp, cluster)
    return model.moe_fraction * exchanges_per_block(layout) * one


def forward_time(model: ModelSpec, layout: Candidate, work: Workload, cluster: Cluster) -> float:
    """The forward's share of :func:`layer_time` (dispatch and return)."""
    if layout.ep == 1 or not model.moe_blocks:
        return 0.0
    return layer_time(model, layout, work, cluster) * 2 / exchanges_per_block(layout)


def overlapped_share(layout: Candidate, m: int) -> float:
    """The share of a rank's 2m chunk passes that DualPipeV runs as overlapped forward-backward pairs, where
    ``overlap_moe_expert_parallel_comm`` hides the all-to-alls (0 otherwise): rank 0's (2m − 3p + 1) / 2m."""
    if not layout.overlap_moe_expert_parallel_comm or layout.pipeline_schedule != "dualpipev":
        return 0.0
    return max(0, 2 * m - 3 * layout.pp + 1) / (2 * m)


def exposed_layer_time(model: ModelSpec, layout: Candidate, work: Workload, cluster: Cluster, m: int) -> float:
    """The all-to-all seconds of one layer and micro-batch not hidden under compute (see the module docstring):
    :func:`layer_time` where nothing overlaps it; in an overlapped pair, each direction's exchanges beyond the
    other chunk's compute they run under."""
    whole = layer_time(model, layout, work, cluster)
    share = overlapped_share(layout, m)
    if not whole or not share:
        return whole
    forward = forward_time(model, layout, work, cluster)
    forward_compute = compute.layer_forward(model, layout, work, cluster).forward
    backward_compute = compute.layer_compute_time(model, layout, work, cluster) - forward_compute
    paired = max(0.0, forward - backward_compute) + max(0.0, whole - forward - forward_compute)
    return (1.0 - share) * whole + share * paired
