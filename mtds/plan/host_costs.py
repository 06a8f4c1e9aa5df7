"""Costs of the host a run shares, measured by a CPU device profile (``mtds-plan --calibrate``), one
named term each. On GPUs (no profile fields) every term is neutral and the roofline terms stand.

contention_factor   k ranks on c cores, each rank single-threaded, share the cores (processor sharing):
                    a rank's compute rate is c / k of a core's when k > c. The profile measured with
                    k_cal processes at once, so a run with k ranks on the host computes
                        slowdown = max(1, k / c) / max(1, k_cal / c)
                    times slower than the profile says (1 when the profile was taken at the run's
                    concurrency, which is what compare and check_local do).
busy_share          a pipeline's ranks are not all computing at once: a non-critical stage idles for the
                    part of the step its work does not fill, and its cores go to the ranks that compute.
                    With utilisation u = mean rank time / critical rank time, k u ranks compete:
                        scale = max(1, u k / c) / max(1, k / c)
                    applied to the pipeline's compute and bubble (1 for u = 1 or k <= c).
optimizer_step_time the trainer's per-step work outside forward/backward: clip the gradients to a global
                    norm, AdamW step, drop the gradients. Calibrated as it runs (torch AdamW, one tensor
                    at a time) on large and on many small tensors:
                        t = a * N_local + b * T_local
                    a = s/parameter, b = s/tensor; T_local the optimizer's tensors: every parameter
                    tensor without ZeRO, DeepSpeed's flat fp32 partition (one per group) with it.
serial_link_gbps    a collective between hosts is paid twice per byte, on the shaped link and in the host's
                    own stack (gloo: TCP through the kernel, copies, the reductions on the cores that
                    compute; the calibrated all-reduce bus bandwidth B_host):
                        1 / B = 1 / B_link + 1 / B_host
                    (a 10 Gbit/s link on 2 shared cores runs at the host's rate, not at 10 Gbit/s).
engine_overhead     what DeepSpeed's engine adds per micro-batch beside FLOPs and bytes (ZeRO-3's pre/post
                    hooks on every module in both passes, the gradient hooks and bucketing of ZeRO-1/2,
                    the engine's own bookkeeping), measured by mtds.plan.calibrate_engine as c0 + c1 M on
                    a stack of M small layers; applied per micro-batch with M = the stage's modules that
                    hold parameters (6 per GPT block, embeddings, final norm):
                        t = m (c0 + c1 M) x contention
                    (ZeRO-2 takes ZeRO-1's measurement).
zero3_traffic       ZeRO-3 per micro-batch (DeepSpeed stage 3): forward and backward all-gather only the
                    partitioned parameters -- tensors of fewer than ``persistence_threshold`` elements
                    stay whole on every rank (stage3_param_persistence_threshold, 1e5) --
                        gathered = 2 (Psi - Psi_p),
                    and reduce-scatter every gradient, which gloo's reduce_scatter runs as an all-reduce
                    (2 (d-1)/d link bytes per byte, not (d-1)/d); one gather call per partitioned
                    tensor per pass and one reduce per bucket, each paying the ring's step latency.
"""
from __future__ import annotations

import math

# contention_factor and serial_link_gbps live beside Cluster (its link_gbps applies them); they are
# this module's terms all the same, and re-exported here.
from mtds.plan.hardware import Cluster, contention_factor, host_sharing, serial_link_gbps
from mtds.plan.model_spec import ModelSpec

PERSISTENCE_THRESHOLD = 100_000      # DeepSpeed's stage3_param_persistence_threshold default
ZERO3_REDUCE_BUCKET = 500_000_000    # DeepSpeed's reduce_bucket_size default (elements)


def busy_share(cluster: Cluster, utilisation: float) -> float:
    """How much of the contention a pipeline's critical rank really sees (module doc: busy_share)."""
    sharing = host_sharing(cluster)
    if sharing is None:
        return 1.0
    k_run, cores, _ = sharing
    return max(1.0, utilisation * k_run / cores) / max(1.0, k_run / cores)


def optimizer_step_time(n_params: float, n_tensors: float, cluster: Cluster) -> float | None:
    """Seconds of the calibrated optimizer step (clip + AdamW + zero_grad) for this rank's parameters;
    None when the profile has no such measurement (GPUs: the roofline in compute.optimizer_time)."""
    c = cluster.calib
    if c.optimizer_s_per_param is None:
        return None
    return (n_params * c.optimizer_s_per_param + n_tensors * (c.optimizer_s_per_tensor or 0.0)) \
        * contention_factor(cluster)


def modules_with_parameters(model: ModelSpec, pp: int = 1) -> float:
    """Modules holding parameters on one pipeline stage: per block two norms, QKV, projection and the
    MLP's two (a gated MLP's gate and up are one module); word and position embeddings, final norm and an
    untied head once, spread over the stages."""
    ends = 2 + (0 if model.rotary else 1) + (1 if model.untied_head else 0)
    return (6 * model.layers + ends) / pp


def engine_overhead(model: ModelSpec, zero_stage: int, microbatches: int, cluster: Cluster, pp: int = 1) -> float:
    """Seconds per step of the calibrated engine overhead (module doc); 0 without a measurement."""
    measured = {stage: (c0, c1) for stage, c0, c1 in cluster.calib.engine_overhead}
    stage = 1 if zero_stage == 2 else zero_stage
    if stage not in measured:
        return 0.0
    c0, c1 = measured[stage]
    return microbatches * (c0 + c1 * modules_with_parameters(model, pp)) * contention_factor(cluster)


def param_tensor_sizes(model: ModelSpec, tp: int = 1) -> list[float]:
    """Elements of every parameter tensor of one rank's whole model (p = 1, e = 1): the blocks' tensors as mtds
    builds them (an MoE block's experts as two grouped tensors), the embeddings, the final norm."""
    h, t = model.hidden, tp
    norm = [h] if model.rmsnorm else [h, h]
    moe = set(model.facts().moe_blocks)
    out = []
    for i in range(model.layers):
        out += [*norm, *_attention_tensors(model, t), *norm]
        out += _moe_tensors(model, t) if i in moe else _mlp_tensors(model, model.ffn, t, model.linear_bias)
    out += [model.padded_vocab(t) * h / t] + list(norm)
    if not model.rotary:
        out.append(model.seq * h)
    if model.untied_head:
        out.append(model.padded_vocab(t) * h / t)
    return out


def _attention_tensors(model: ModelSpec, t: int) -> list[float]:
    h = model.hidden
    if model.latent:       # ModelSpec.latent_params: the up- and output projections split, the rest whole
        a, qk = model.heads, model.qk_head_dim + model.qk_pos_emb_head_dim
        norm = 1 if model.rmsnorm else 2
        r_q, r_kv = model.q_lora_rank, model.kv_lora_rank
        q = [a * qk / t * h] if r_q is None else [r_q * h, *[r_q] * norm, a * qk / t * r_q]
        return [*q, (r_kv + model.qk_pos_emb_head_dim) * h, *[r_kv] * norm,
                a * (model.qk_head_dim + model.v_head_dim) / t * r_kv, h * a * model.v_head_dim / t]
    qkv = (model.q_width + 2 * model.kv_width) / t
    out = [h * qkv, model.q_width / t * h] + ([model.heads / t] if model.attention_sinks else [])
    if model.qkv_bias:
        out.append(qkv)
    if model.has_out_proj_bias:
        out.append(h)
    if model.qk_norm:   # q and k norms, head_dim wide
        out += [model.q_width / model.heads] * (2 if model.rmsnorm else 4)
    return out


def _mlp_tensors(model: ModelSpec, f: float, t: int, bias: bool) -> list[float]:
    h = model.hidden
    fc1 = f * (model.mlp_matrices - 1) / t
    return [h * fc1, f / t * h] + ([fc1, h] if bias else [])


def _moe_tensors(model: ModelSpec, t: int) -> list[float]:
    """Router, the experts' gate/up and down (one grouped tensor each), the shared expert and its gate."""
    h, e, f = model.hidden, model.num_experts, model.moe_ffn
    out = [e * h, e * 2 * f / t * h, e * h * f / t]
    if model.expert_biases:
        out += [e, e * 2 * f / t, e * h]
    if model.moe_shared_ffn:
        out += ([h] if model.moe_shared_gate else []) + [2 * model.moe_shared_ffn / t * h, h * model.moe_shared_ffn / t]
    return out


def optimizer_tensors(model: ModelSpec, zero_stage: int, tp: int = 1, pp: int = 1) -> float:
    """Tensors the optimizer steps over: one rank's parameter tensors without ZeRO; DeepSpeed's ZeRO
    flattens each parameter group (decay, no decay) into one fp32 partition."""
    if zero_stage >= 1:
        return 2.0
    return len(param_tensor_sizes(model, tp)) / pp


def persistent_params(model: ModelSpec, threshold: float = PERSISTENCE_THRESHOLD) -> tuple[float, int]:
    """(Psi_p, partitioned tensor count): elements of the tensors ZeRO-3 keeps whole, and how many
    tensors it partitions (and gathers)."""
    sizes = param_tensor_sizes(model)
    return sum(n for n in sizes if n < threshold), sum(1 for n in sizes if n >= threshold)


def zero3_traffic(model: ModelSpec, d: int, stride: int, bytes_per_value: float, cluster: Cluster,
                  backend: str = "gloo") -> float:
    """Seconds of one micro-batch's ZeRO-3 collectives (see the module doc), before overlap."""
    from mtds.plan import comm
    if d <= 1:
        return 0.0
    psi = sum(param_tensor_sizes(model))
    psi_p, gathered_tensors = persistent_params(model)
    gather_bytes = (psi - psi_p) * bytes_per_value
    grad_bytes = psi * bytes_per_value
    buckets = max(1, math.ceil(psi / ZERO3_REDUCE_BUCKET))
    hop = cluster.calib.hop_latency_s
    # bandwidth part: the volume in one call; latency part: each extra call pays the ring's steps again
    gather = 2 * comm.all_gather(gather_bytes, d, stride, cluster) \
        + 2 * max(0, gathered_tensors - 1) * (d - 1) * hop
    kind = comm.all_reduce if backend == "gloo" else comm.reduce_scatter
    steps = 2 * (d - 1) if backend == "gloo" else d - 1
    reduce = kind(grad_bytes, d, stride, cluster) + (buckets - 1) * steps * hop
    return gather + reduce


__all__ = ["PERSISTENCE_THRESHOLD", "busy_share", "contention_factor", "engine_overhead", "modules_with_parameters", "optimizer_step_time", "optimizer_tensors", "param_tensor_sizes", "persistent_params", "serial_link_gbps", "zero3_traffic"]
