"""Predicted memory per GPU: model states (ZeRO) + activations (Korthikanti) + reserve.

Evaluated for the first pipeline stage (most activations in flight) and the last stage (output
layer, logits); the larger total is reported.

Context parallelism (c > 1, mtds.cp): every activation term sees the rank's s/c tokens (Korthikanti's
formulas with s -> s/c), attention is flash-style whatever the calibration says (the ring and Ulysses
kernels keep no s x s scores, only a per-row log-sum-exp), the ring adds its in-flight K/V block
(:func:`cp_transient_bytes`), the logits are those of s/c tokens, and ZeRO partitions over d·c ranks.
"""
from __future__ import annotations

from dataclasses import dataclass

from mtds.plan.candidate import Candidate, Workload
from mtds.plan.hardware import Cluster
from mtds.plan.model_spec import ModelSpec
from mtds.plan.pipeline import activation_factor, interleaved_activation_factor  # noqa: F401 (re-export)

GIB = 1024.0 ** 3


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per GPU, by kind."""

    params: float
    grads: float
    optimizer: float
    activations: float
    other: float          # reserve, allocator fragmentation, ZeRO buffers

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.other

    def gib(self) -> dict:
        d = {k: getattr(self, k) / GIB for k in ("params", "grads", "optimizer", "activations", "other")}
        d["total"] = self.total / GIB
        return d


def stage_params(model: ModelSpec, layout: Candidate, stage: str) -> float:
    """Parameters held by one GPU of the first or last pipeline stage.

    Per layer, QKV/projection/MLP weights are split t ways; projection and FC2 biases and the
    norms are replicated (Megatron, arXiv 1909.08053 Section 3; ModelSpec.sharded_params_per_layer).
    The word embedding (padded vocab, split t ways) lives on the first stage; the last stage holds
    the LM head: a tied copy of it when p > 1, or its own matrix when the head is untied.
    MoE: the experts (:func:`stage_expert_params`) are included; the router is replicated.
    """
    t, p, h = layout.tp, layout.pp, model.hidden
    per_layer = (model.sharded_params_per_layer() / t + model.replicated_params_per_layer()
                 + model.expert_params_per_layer() / (t * layout.ep) + model.expert_whole_params_per_layer() / layout.ep)
    embed = model.padded_vocab(t) * h / t
    n = per_layer * model.layers / p
    if stage == "first":
        n += embed + (0 if model.rotary else model.seq * h)
    if stage == "last" or p == 1:
        head = embed if (p > 1 or model.untied_head) else 0.0
        n += model.norm_params + head  # final norm; the head (tied copy on a separate stage, or untied)
    return n


def stage_expert_params(model: ModelSpec, layout: Candidate) -> float:
    """Expert parameters one GPU holds (part of :func:`stage_params`): its l/p blocks' experts, split t ways
    inside each expert and over the e ranks of its expert-parallel group, E x 3 h F / (t e) per MoE block
    (MoE blocks spread evenly over the stages)."""
    per_layer = model.expert_params_per_layer() / layout.tp + model.expert_whole_params_per_layer()
    return per_layer / layout.ep * model.layers / layout.pp


def grad_buffer_bytes(layout: Candidate, work: Workload, main_grad_bytes: float | None) -> float:
    """Bytes per parameter of the gradient (accumulation) buffer.

    The ZeRO paper counts 16-bit gradients (2 bytes). Frameworks that accumulate in fp32
    (Megatron `main_grad`, DeepSpeed bf16 optimizer) keep `main_grad_bytes` (4) per parameter
    instead, unless DeepSpeed's own ZeRO-2/3 (p = 1) partitions the gradients. On a pipeline mtds's bf16 ZeRO-2/3
    keep BF16_Optimizer's fp32 accumulation (mtds.deepspeed_compat.bf16_zero2): whole in the step modes, the
    fp32 partition in the micro-batch modes (the division by d: ``whole_gradients``). fp32 training: 4.
    """
    w = work.bytes_per_value
    if main_grad_bytes is None or work.precision == "fp32" or (layout.zero_stage >= 2 and layout.pp == 1):
        return float(w)
    return float(max(w, main_grad_bytes))


def model_state_bytes(n_params: float, layout: Candidate, work: Workload,
                      main_grad_bytes: float | None = None, ranks: int | None = None) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes per GPU under ZeRO stage 0-3.

    Mixed-precision Adam (Rajbhandari et al. 2020, ZeRO, arXiv 1910.02054 Section 3.1):
    2 bytes params + 2 bytes grads + K=12 bytes fp32 master/momentum/variance per parameter;
    stage 1 shards the K part over d, stage 2 also the grads, stage 3 also the params (d·c with
    context parallelism: its ranks hold the same parameters and share the partitions).
    fp32 training: 4 + 4 + 8 (Adam m, v). With `main_grad_bytes` (the calibration's fp32
    accumulation buffer) the 2-byte gradient of stages 0-1 becomes 4 bytes (see grad_buffer_bytes).
    ``ranks``: the ranks sharing the partitions, if not d·c (experts: d·c / e, the expert-data-parallel group).
    """
    w = work.bytes_per_value
    k = 8.0 if work.precision == "fp32" else 12.0
    d, z = ranks or layout.dp_cp, layout.zero_stage
    # ZeRO-3 on a pipeline gathers the stage's whole parameters for each pass (mtds.deepspeed_compat.zero3_params)
    params = w * n_params / (d if z >= 3 and layout.pp == 1 else 1)
    grads = grad_buffer_bytes(layout, work, main_grad_bytes) * n_params / (1 if layout.whole_gradients else d)
    opt = k * n_params / (d if z >= 1 else 1)
    return params, grads, opt


def activation_bytes_per_layer(model: ModelSpec, layout: Candidate, work: Workload, stored: bool = True,
                               attention: str = "math") -> float:
    """Activation bytes one transformer layer keeps for one microbatch.

    Korthikanti et al. 2022 (arXiv 2205.05198) Table 2, with s, b, h, a, t:
      no TP:              s b h (34 + 5 a s / h)
      TP:                 s b h (10 + 24/t + 5 a s / (h t))
      TP + SP:            s b h (34/t + 5 a s / (h t))
      selective recompute drops the 5 a s/(h t) attention term (only with stored=True);
      full recompute stores only the layer input, 2 s b h (2 s b h / t with SP).
    stored=False gives the full working set of one layer during its (re)computation.
    Coefficients assume 16-bit activations; fp32 doubles them.
    attention="flash" (SDPA's flash / memory-efficient kernels): no 5 a s/(h t) term at all -- scores,
    softmax and dropout mask are recomputed in backward; only an fp32 logsumexp per (head, row) is kept,
    4 a s b / t bytes = 2 a/(h t) in these units. Selective recompute then saves nothing.
    Context parallelism (c > 1): s is the rank's s/c tokens and attention is "flash" (the ring and Ulysses
    keep only the log-sum-exp); Ulysses also keeps its local attention's output in head layout beside the
    projection's input, 2 (s/c) b q / t bytes (2 q/(h t) in these units; q = h unless head_dim is set).
    """
    s, b, h, a, t = layout.local_seq(model.seq), layout.microbatch, model.hidden, model.heads, layout.tp
    sbh = s * b * h
    scale = work.bytes_per_value / 2.0
    if attention not in ("math", "flash"):
        raise ValueError(f"attention kernel must be 'math' or 'flash', got {attention!r}")
    if layout.cp > 1:
        attention = "flash"
    attn = 5.0 * a * s / (h * t) if attention == "math" else 2.0 * a / (h * t)
    if stored and layout.recompute == "full":
        return scale * 2.0 * sbh / (t if layout.sequence_parallel else 1)
    linear = 34.0 / t if layout.sequence_parallel else 10.0 + 24.0 / t
    if stored and layout.recompute == "selective" and attention == "math":
        attn = 0.0
    if layout.cp > 1 and layout.cp_comm_type == "a2a":
        attn += 2.0 * model.cp_widths[0] / (h * t)
    return scale * sbh * (linear + attn)


def cp_transient_bytes(model: ModelSpec, layout: Candidate, work: Workload) -> float:
    """Bytes of the ring's blocks in flight (p2p, c > 1), held once per rank (by the layer computing).

    Forward receives the next K/V block while it computes on the current one: 2 b (s/c) (h_kv/t) e values
    (e = head_dim, h_kv the KV heads; the current block is the rank's own K/V or the previous arrival).
    Backward sends the dK/dV accumulators one hop behind the K/V, so its peak is twice that:
    4 b (s/c) (h_kv/t) e values. Ulysses (a2a) holds nothing beyond the activations (its gathered q/k/v
    replace the local ones: same size)."""
    if layout.cp == 1 or layout.cp_comm_type != "p2p":
        return 0.0
    kv_width = model.cp_widths[1] / layout.tp        # (h_kv / t) e
    block = 2.0 * layout.microbatch * layout.local_seq(model.seq) * kv_width
    return 2.0 * block * work.bytes_per_value


def in_flight_layers(model: ModelSpec, layout: Candidate, work: Workload) -> float:
    """Layer-microbatches whose activations the first stage holds at its peak.

    1F1B keeps min(p, m) microbatches of l/p layers (~l layers' worth); the interleaved
    schedule multiplies this by (1 + (p-1)/(p v)) (Korthikanti 2022 Section 4.2.3), ZB-H1 by 1,
    DualPipeV by 1 + 1/(2p) (mtds.plan.pipeline.activation_factor).
    """
    p, v = layout.pp, layout.virtual_stages
    m = layout.microbatches(work.global_batch)
    return min(p, m) * model.layers / p * activation_factor(layout.pipeline_schedule, p, v)


def predict_memory(model: ModelSpec, layout: Candidate, work: Workload, cluster: Cluster) -> MemoryBreakdown:
    """Memory of the fuller of the first and last stage."""
    best = None
    w = work.bytes_per_value
    t = layout.tp
    attention = cluster.calib.attention_kernel
    for stage in ("first", "last") if layout.pp > 1 else ("first",):
        n = stage_params(model, layout, stage)
        # experts partition over their expert-data-parallel group (d·c / e ranks), the rest over d·c
        ne = stage_expert_params(model, layout)
        params, grads, opt = model_state_bytes(n - ne, layout, work, cluster.calib.main_grad_bytes)
        if ne:
            expert = model_state_bytes(ne, layout, work, cluster.calib.main_grad_bytes,
                                       ranks=max(1, layout.dp_cp // layout.ep))
            params, grads, opt = params + expert[0], grads + expert[1], opt + expert[2]
        if layout.zero2_per_micro_batch and not model.untied_head:
            # the tied word embedding / LM head is summed across stages at the end of the step: kept whole
            grads += w * model.padded_vocab(t) / t * model.hidden * (1 - 1 / layout.dp_cp)
        act = 0.0
        if stage == "first":
            act += in_flight_layers(model, layout, work) * activation_bytes_per_layer(model, layout, work,
                                                                                      attention=attention)
        else:
            act += model.layers / layout.pp * activation_bytes_per_layer(model, layout, work, attention=attention)
        if layout.recompute != "none":
            # the layer being recomputed / back-propagated holds its full activations once
            act += activation_bytes_per_layer(model, layout, work, stored=False, attention=attention)
        act += cp_transient_bytes(model, layout, work)
        if stage == "last" or layout.pp == 1:
            # fp32 logits and their gradient for the vocab-parallel cross entropy: 2 x 4 (s/c) b V / t
            act += 8.0 * layout.local_seq(model.seq) * layout.microbatch * model.padded_vocab(t) / t
        other = cluster.calib.memory_reserve_gib * GIB
        other += cluster.calib.allocator_fragmentation * (params + grads + opt + act)
        if layout.zero_stage >= 3 and layout.pp == 1:
            # gathered weights of the current and the prefetched module (largest: MLP, h x f / t)
            other += 2 * model.hidden * model.ffn / t * w
        if layout.zero_stage >= 1:
            # gradient reduce bucket (DeepSpeed default reduce_bucket_size 5e8 elements)
            other += min(5e8, n) * w
        mb = MemoryBreakdown(params, grads, opt, act, other)
        if best is None or mb.total > best.total:
            best = mb
    return best
