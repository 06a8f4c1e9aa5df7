"""Predict step time, throughput and memory of one layout: the planner's core.

Step time of one pipeline (PTD-P, arXiv 2104.04473, eq. 1 extended with communication):
    T_step = m * (l/p) * (t_layer + t_tp)           compute + tensor-parallel collectives
           + m * (t_output + t_tp_ends)              last stage's logits/loss and the collectives of
                                                     the vocab-parallel ends (embedding too if p = 1)
           + t_optimizer                             Adam step
           + m * t_grad_accumulation                 add each microbatch's weight grads to the
                                                     fp32 buffer (unfused, calibration)
           + bubble(schedule; F, B, W of one         pipeline bubble: (p-1)(F+B+W)/v for 1f1b and
                    microbatch on one stage)         interleaved, (p-1)(F+B-W) zb-h1, (p-1)(F/2+B+W)
                                                     dualpipev (mtds.plan.pipeline)
           + 2 (v m + p - 1) * t_p2p                 activations/gradients between stages
           + t_tied_embedding                        first/last stage embedding-gradient all-reduce
           + exposed data-parallel communication
           + m * engine overhead                     DeepSpeed's per-micro-batch hooks and bookkeeping,
                                                     calibrated on CPU hosts (mtds.plan.host_costs)
with m = B/(b d) microbatches. Tensor parallelism issues 2 all-reduces of s b h values in the
forward and 2 in the backward of every layer (Megatron, arXiv 1909.08053 Section 3), plus 2 more
when the forward is recomputed; sequence parallelism swaps each for an all-gather +
reduce-scatter pair of the same volume (Korthikanti 2022 Section 4.2.2). Pipeline messages carry
s b h values, divided by t with the scatter/gather optimisation (PTD-P Section 4.1).
Context parallelism (c ranks, mtds.plan.cp_comm) adds its ring hops or all-to-alls to every layer
(+ m * (l/p) * t_cp, exposed part only), every per-token size above becomes the rank's s/c, and the
gradient reduction and ZeRO run over the d·c ranks at stride t that hold the same parameters.
Data parallelism all-reduces 16-bit gradients once per step (ZeRO 1/2: reduce-scatter +
all-gather, same volume); ZeRO-3 all-gathers parameters in forward and backward and
reduce-scatters gradients for every microbatch: 3 Psi per microbatch (ZeRO, arXiv 1910.02054
Section 7.2.2), partly hidden behind compute by prefetching.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from mtds.plan import comm, compute, cp_comm, ep_comm, host_costs, pipeline, tp_comm
from mtds.parallel.choices import RECOMPUTE_MODES
from mtds.plan.candidate import Candidate, Workload
from mtds.plan.hardware import Cluster
from mtds.plan.memory import GIB, MemoryBreakdown, grad_buffer_bytes, predict_memory, stage_expert_params, stage_params
from mtds.plan.model_spec import ModelSpec
from mtds.plan.runnable import cannot, rule_problems


@dataclass(frozen=True)
class Prediction:
    """Everything the planner reports about one layout."""

    layout: Candidate
    step_time_s: float
    time_breakdown_s: dict            # compute, tp_comm, pp_comm, dp_comm, bubble, engine (host_costs)
    memory: MemoryBreakdown
    memory_capacity_gib: float
    tflops_per_gpu: float             # hardware FLOPs (with recomputation), as PTD-P reports
    model_tflops_per_gpu: float
    mfu: float
    hfu: float
    days_to_train: float
    fits: bool
    reasons: tuple = field(default=())   # why infeasible (empty if feasible)
    not_runnable: tuple = field(default=())  # why train.py refuses it: the rulebook's lines (mtds.plan.runnable)
    stages: dict = field(default_factory=dict)  # the partition modelled (mtds.plan.balance.StageReport.as_dict)

    @property
    def feasible(self) -> bool:
        return not self.reasons

    def as_dict(self) -> dict:
        mem = self.memory.gib()
        return {
            **self.layout.as_dict(),
            "step_time_s": self.step_time_s,
            "time_breakdown_s": dict(self.time_breakdown_s),
            "tflops_per_gpu": self.tflops_per_gpu,
            "model_tflops_per_gpu": self.model_tflops_per_gpu,
            "mfu": self.mfu,
            "hfu": self.hfu,
            "days_to_train": self.days_to_train,
            "memory_gib_per_gpu": mem["total"],
            "memory_breakdown_gib": {k: v for k, v in mem.items() if k != "total"},
            "memory_capacity_gib": self.memory_capacity_gib,
            "fits": self.fits,
            "feasible": self.feasible,
            "reasons": list(self.reasons),
            "runnable": not self.not_runnable,
            "not_runnable": list(self.not_runnable),
            **({"stages": dict(self.stages)} if self.stages else {}),
        }


def planner_problems(model: ModelSpec, layout: Candidate, cluster: Cluster, explicit_stages: bool = False) -> list[str]:
    """What the planner itself cannot place or model (train.py's rules are the rulebook's): sizes, the cluster's GPU
    count, a recompute mode, and -- without an explicit partition (``explicit_stages``) -- l/(p v) blocks per
    stage, which its uniform formulas assume."""
    t, p, d, b, v = layout.tp, layout.pp, layout.dp, layout.microbatch, layout.virtual_stages
    if min(t, p, d, b, v, layout.cp, layout.ep) < 1:
        return ["all sizes must be >= 1"]
    out = []
    if layout.gpus != cluster.gpus:
        sizes = "t*c*p*d" if layout.cp > 1 else "t*p*d"
        out.append(f"{sizes} = {layout.gpus} != {cluster.gpus} GPUs")
    if model.layers % (p * v) and not explicit_stages:
        out.append(f"layers={model.layers} not divisible by p*v={p * v}")
    if layout.recompute not in RECOMPUTE_MODES:
        out.append(f"recompute must be one of {RECOMPUTE_MODES}")
    if layout.pipeline_schedule == "dualpipev" and v != 2:      # a candidate's v counts DualPipeV's two chunks
        out.append("dualpipev runs two chunks per rank (v=2)")
    return out


def structural_problems(model: ModelSpec, layout: Candidate, work: Workload, cluster: Cluster,
                        explicit_stages: bool = False, found: list | None = None) -> list[str]:
    """Why ``layout`` cannot work: :func:`planner_problems` and the rulebook's rules no build of train.py could
    keep (``found``: the candidate's rule problems, :func:`mtds.plan.runnable.rule_problems`, if known)."""
    out = planner_problems(model, layout, cluster, explicit_stages)
    if out == ["all sizes must be >= 1"]:
        return out
    if found is None:
        found = rule_problems(model, layout, work, cluster.gpu.hbm_gib * GIB)
    return out + cannot(found)


def predict(model: ModelSpec, layout: Candidate, work: Workload, cluster: Cluster, stages=None,
            zero1_grad_reduce: str = "reduce-scatter", found: list | None = None) -> Prediction:
    """Evaluate one layout (structural problems are reported, numbers still computed if possible).
    ``zero1_grad_reduce``: how ZeRO-1/2 reduce gradients -- "reduce-scatter" (mtds's, Megatron's
    distributed optimizer: RS + parameter AG, 2 Psi (d-1)/d) or "all-reduce" (DeepSpeed's own ZeRO-1:
    AR + AG, 3 Psi (d-1)/d).
    ``stages``: the partition the run uses (an ``mtds.parallel.pipeline_layout.StageLayout``, p > 1): its critical
    rank sets the compute and the bubble (:func:`partition_times`); None: l/p blocks per rank, the LM
    head's rank critical (the uniform partition of a model whose l divides by p·v).
    ``found``: the candidate's problems by the rulebook (mtds.plan.runnable.rule_problems), where the caller
    has them already."""
    if found is None:       # the rulebook's problems of this candidate (mtds.plan.runnable), unless known
        found = rule_problems(model, layout, work, cluster.gpu.hbm_gib * GIB, stages)
    reasons = structural_problems(model, layout, work, cluster, explicit_stages=stages is not None, found=found)
    t, p, v = layout.tp, layout.pp, layout.virtual_stages
    d = layout.dp_cp         # the ranks that sum gradients and share ZeRO partitions (d·c, stride t)
    w = work.bytes_per_value
    m = max(1, layout.microbatches(work.global_batch))
    s, b, h = layout.local_seq(model.seq), layout.microbatch, model.hidden
    layers_per_stage = model.layers / p

    t_layer = compute.layer_compute_time(model, layout, work, cluster)
    t_tp_one = comm.all_reduce(s * b * h * w, t, 1, cluster)
    t_out = compute.output_layer_time(model, layout, work, cluster)
    n_local = max(stage_params(model, layout, "first"), stage_params(model, layout, "last") if p > 1 else 0.0)
    n_opt = n_local / (d if layout.zero_stage >= 1 else 1)
    # DeepSpeed's optimizer stage: ZeRO-2/3 on a pipeline run on its stage-1 optimizer (mtds.deepspeed_compat.zero2_reduce,
    # zero3_params)
    ds_stage = 1 if layout.zero_stage in (2, 3) and p > 1 else layout.zero_stage

    # every microbatch adds its weight gradients into the (fp32) accumulation buffer; with
    # ZeRO-2/3 only the local 1/d partition is accumulated (d·c with context parallelism)
    n_acc = n_local / (1 if layout.whole_gradients else d)
    t_acc = compute.grad_accumulation_time(n_acc, w, grad_buffer_bytes(layout, work, cluster.calib.main_grad_bytes),
                                           cluster)
    compute_s = (m * layers_per_stage * t_layer + m * t_out + m * t_acc
                 + compute.optimizer_time(n_opt, cluster, host_costs.optimizer_tensors(model, ds_stage, t, p)))
    # the last stage's GPU (the LM head and loss; with p = 1 also the embedding): mtds.plan.tp_comm
    grad_bytes_tp = grad_buffer_bytes(layout, work, cluster.calib.main_grad_bytes)
    tp_s = tp_comm.per_step_time(model, layout, work, cluster, "last" if p > 1 else "all", m, grad_bytes_tp)
    cp_s = m * layers_per_stage * cp_comm.layer_time(model, layout, work, cluster)
    # the steady state's exposed all-to-alls (DualPipeV's overlapped pairs hide some); the bubble's passes carry theirs
    ep_s = m * layers_per_stage * ep_comm.exposed_layer_time(model, layout, work, cluster, m)
    bubble_s = pipeline.bubble_time(layout.pipeline_schedule, p, v,
                                    *stage_pass_times(model, layout, work, cluster, t_tp_one, t_acc))
    pp_s = 0.0
    if p > 1:
        cross_node = t * d * p > cluster.per_node       # d = d·c: the whole world
        # each of the t ranks sends its 1/t slice, the receiver all-gathers it over NVLink
        # (scatter/gather optimisation, PTD-P Section 4.1); with sequence parallelism the
        # activations between layers are already split along the sequence, so no all-gather
        # DeepSpeed's DualPipeV refuses pipe_partitioned: it sends the whole activation
        # (a peer without the optimisation, Megatron-core without sequence parallelism: pipeline_scatter_gather off)
        scatter_gather = layout.pipeline_schedule != "dualpipev" and layout.pipeline_scatter_gather
        t_p2p = comm.p2p(s * b * h * w / (t if scatter_gather else 1), cross_node, cluster)
        if scatter_gather and not layout.sequence_parallel:
            t_p2p += comm.all_gather(s * b * h * w, t, 1, cluster)
        pp_s = pipeline.p2p_messages(layout.pipeline_schedule, p, v, m) * t_p2p
        if not model.untied_head:
            # tied input/output embedding: first and last stage all-reduce its gradient once per step (an untied
            # head has no copy to keep equal: nothing crosses, as the link counters show on llama-tiny)
            embedding_grad = model.padded_vocab(t) / t * h * grad_buffer_bytes(layout, work, cluster.calib.main_grad_bytes)
            pp_s += comm.all_reduce(embedding_grad, 2, t * d * (p - 1), cluster)

    # experts' gradients are summed over their expert-data-parallel group (d·c / e ranks), the rest over d·c
    n_expert = stage_expert_params(model, layout)
    grad_bytes = (n_local - n_expert) * w
    # (d_expert 1 on a dense model: no expert collective, not even its latency)
    expert_grad_bytes, d_expert = n_expert * w, max(1, d // layout.ep) if n_expert else 1
    if layout.zero_stage >= 3 and p == 1:
        if cluster.calib.collective_backend == "gloo":   # persistent parameters, gloo's reduce-scatter
            per_mb = host_costs.zero3_traffic(model, d, t, w, cluster, "gloo")
        else:
            per_mb = (2 * comm.all_gather(grad_bytes, d, t, cluster) + comm.reduce_scatter(grad_bytes, d, t, cluster)
                      + 2 * comm.all_gather(expert_grad_bytes, d_expert, t * layout.ep, cluster)
                      + comm.reduce_scatter(expert_grad_bytes, d_expert, t * layout.ep, cluster))
        z = m * per_mb / cluster.calib.zero3_comm_efficiency
        busy = compute_s + tp_s
        # prefetching overlaps gathers with compute, but both contend for SMs and HBM: the
        # combined time is the k-norm (C^k + Z^k)^(1/k) (k=1 serial, k->inf perfect overlap)
        k = cluster.calib.zero3_overlap_exponent
        dp_s = (busy ** k + z ** k) ** (1.0 / k) - busy
    else:
        # ZeRO-0: all-reduce; ZeRO-1/2 reduce-scatter + all-gather, the same ring volume (on gloo too: mtds's
        # ZeRO-1 reduce-scatter is its own ring of sends, mtds/parallel/dp_reduce.py, not gloo's reduce_scatter, which
        # all-reduces -- that one is ZeRO-3's, host_costs.zero3_traffic); DeepSpeed's own ZeRO-1 all-reduces
        # the gradients and then all-gathers the updated parameters
        dp_s = (1.0 - cluster.calib.dp_overlap) * (comm.all_reduce(grad_bytes, d, t, cluster)
                                                    + comm.all_reduce(expert_grad_bytes, d_expert, t * layout.ep,
                                                                      cluster))
        if layout.zero_stage in (1, 2) and zero1_grad_reduce == "all-reduce" and not layout.zero2_per_micro_batch:
            dp_s += (1.0 - cluster.calib.dp_overlap) * comm.all_gather(grad_bytes, d, t, cluster)
        if layout.zero2_per_micro_batch and m > 1:
            # ZeRO-2 on a pipeline, per micro-batch: m - 1 more reduce-scatters of all but the tied embedding, each
            # between two micro-batches' compute (mtds runs them blocking: no overlap)
            tied = 0.0 if model.untied_head else model.padded_vocab(t) / t * h * w
            dp_s += (m - 1) * comm.reduce_scatter(max(0.0, grad_bytes - tied), d, t, cluster)
        if layout.zero3_pipeline_gathers:
            # ZeRO-3 on a pipeline, micro-batch mode: the stage's parameters all-gathered before every forward and
            # backward pass (m x 2 x chunks a step), blocking; the one per step is ZeRO-1's all-gather, above
            dp_s += (m * layout.zero3_pipeline_gathers - 1) * comm.all_gather(grad_bytes, d, t, cluster)

    stage_info = {}
    if stages is not None and p > 1:
        compute_s, tp_s, bubble_s, stage_info = partition_times(model, layout, work, cluster, stages, m, t_acc,
                                                                compute_s, t_tp_one)
        cp_s = 0.0   # the critical rank's block costs carry it, as they carry the layers' TP collectives
        # the all-to-alls are not in the block costs (the balancer's, which train.py's default partition shares):
        # the critical rank's blocks carry them here
        ep_s *= critical_blocks(layout, stages, stage_info["critical_rank"]) / layers_per_stage
    engine_s = host_costs.engine_overhead(model, ds_stage, m, cluster, p)
    step = compute_s + tp_s + cp_s + ep_s + bubble_s + pp_s + dp_s + engine_s
    mem = predict_memory(model, layout, work, cluster)
    capacity = cluster.gpu.hbm_gib
    fits = mem.total <= capacity * GIB
    if not fits:
        reasons.append(f"needs {mem.total / GIB:.1f} GiB per GPU > {capacity:.0f} GiB")

    n = cluster.gpus
    hw = model.hardware_flops(work.global_batch, layout.recompute) / (n * step) / 1e12
    mf = model.model_flops(work.global_batch) / (n * step) / 1e12
    peak = cluster.gpu.peak_tflops
    # days = (T / (B s)) steps x step time; equals PTD-P's 8 T Psi / (n X) under full recompute
    days = work.train_tokens / (work.global_batch * s) * step / 86400.0
    return Prediction(
        layout=layout, step_time_s=step,
        time_breakdown_s={"compute": compute_s, "tp_comm": tp_s, "pp_comm": pp_s, "dp_comm": dp_s, "bubble": bubble_s,
                          "engine": engine_s, **({"cp_comm": cp_s} if layout.cp > 1 else {}),
                        **({"ep_comm": ep_s} if layout.ep > 1 else {})},
        memory=mem, memory_capacity_gib=capacity, tflops_per_gpu=hw, model_tflops_per_gpu=mf,
        mfu=mf / peak, hfu=hw / peak, days_to_train=days, fits=fits, reasons=tuple(reasons),
        not_runnable=tuple(problem.message for problem in found), stages=stage_info,
    )


def critical_blocks(layout: Candidate, stages, rank: int) -> int:
    """Transformer blocks held by pipeline rank ``rank`` under ``stages`` (its virtual stages summed)."""
    from mtds.plan.balance import rank_of_stage
    return sum(n for k, n in enumerate(stages.blocks) if rank_of_stage(k, layout.pp, layout.pipeline_schedule) == rank)


def partition_times(model: ModelSpec, layout: Candidate, work: Workload, cluster: Cluster, stages, m: int,
                    t_acc: float, compute_s: float, t_tp_one: float) -> tuple:
    """(compute, TP, bubble seconds, stage report) of a step under an explicit partition.

    Per micro-batch the critical rank (mtds.plan.balance: its blocks, and E / L where it holds them,
    with their TP collectives) replaces the uniform l/p blocks + LM head; the per-step parts (gradient
    accumulation, optimizer, the sequence-parallel gradient sum) stay. The bubble: with unequal stages
    1F1B's fill and drain take the other ranks' F + B + W once each, sum(ranks) − critical (= (p − 1) x
    stage for equal stages), so the schedule's (F, B, W) are scaled by the mean other rank's time over
    the uniform stage's. On a shared host, compute and bubble are scaled by host_costs.busy_share."""
    from mtds.plan import balance
    p = layout.pp
    report = balance.stage_report(model, layout, work, cluster, stages)
    costs = balance.layer_costs(model, layout, work, cluster)
    uniform_rank = model.layers / p * costs.block
    uniform_compute = m * (model.layers / p * compute.layer_compute_time(model, layout, work, cluster)
                           + compute.output_layer_time(model, layout, work, cluster))
    compute_s = compute_s - uniform_compute + m * report.critical_s
    tp_s = sequence_parallel_grad_time(model, layout, work, cluster, m)
    others = (sum(report.rank_s) - report.critical_s) / (p - 1)
    scale = others / uniform_rank if uniform_rank else 1.0
    f, b, w = stage_pass_times(model, layout, work, cluster, t_tp_one, t_acc)
    bubble_s = pipeline.bubble_time(layout.pipeline_schedule, p, layout.virtual_stages, f * scale, b * scale,
                                    w * scale)
    # on a shared host the idle ranks' cores go to the busy ones (host_costs.busy_share)
    share = host_costs.busy_share(cluster, sum(report.rank_s) / p / report.critical_s)
    return compute_s * share, tp_s, bubble_s * share, report.as_dict()


def stage_pass_times(model: ModelSpec, layout: Candidate, work: Workload, cluster: Cluster, t_tp_one: float,
                     t_acc: float) -> tuple[float, float, float]:
    """(F, B, W) seconds of one microbatch on one pipeline stage. F: forward compute + its 2 TP
    collectives per layer (+ the exposed context-parallel traffic); W: the weight-gradient GEMMs (same FLOPs
    as the forward's) + the gradient-accumulation pass; B: the rest of the backward (input gradients,
    recomputation, the backward TP and CP traffic). F + B + W = the stage's whole per-microbatch time."""
    lps = model.layers / layout.pp
    fwd = compute.layer_forward(model, layout, work, cluster)
    layer_comm = (tp_comm.layer_time(model, layout, work, cluster) + cp_comm.layer_time(model, layout, work, cluster)
                  + ep_comm.layer_time(model, layout, work, cluster))
    stage = lps * (compute.layer_compute_time(model, layout, work, cluster) + layer_comm) + t_acc
    f = lps * (fwd.forward + 2 * t_tp_one + cp_comm.exposed_forward_time(model, layout, work, cluster)
               + ep_comm.forward_time(model, layout, work, cluster))
    w_pass = lps * fwd.linear + t_acc
    return f, stage - f - w_pass, w_pass


def sequence_parallel_grad_time(model: ModelSpec, layout: Candidate, work: Workload, cluster: Cluster,
                                m: int) -> float:
    """With sequence parallelism, the parameters replicated over the TP group see 1/t of the
    sequence, so their gradients are all-reduced over the TP group: once per step under ZeRO-0/1 (as
    Megatron's allreduce_layernorm_grads), per tensor per microbatch under ZeRO-2/3
    (mtds.plan.tp_comm.shared_gradient_collectives)."""
    gb = grad_buffer_bytes(layout, work, cluster.calib.main_grad_bytes)
    return tp_comm.collectives_time(tp_comm.shared_gradient_collectives(model, layout, gb, m), layout.tp, cluster)
