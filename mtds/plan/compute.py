"""Compute time of one transformer layer (and the output layer) for one microbatch on one GPU.

Two kinds of kernels:
  * GEMMs, timed by a roofline: max(FLOPs / (peak * eff(n)), bytes / HBM), with the matmul
    efficiency eff(n) = gemm_max_fraction * n / (n + gemm_half_dim) where n is the GEMM's
    smallest dimension (small dimensions under-fill tensor-core tiles);
  * memory-bound element-wise kernels (layer norm, bias+GeLU, softmax, dropout, residual),
    timed as bytes moved / achievable HBM bandwidth.
Backward = 2x forward for both (data and weight gradients), the standard 1:2 ratio behind the
72 = 3 x 24 coefficient of PTD-P (arXiv 2104.04473) eq. 3.

Context parallelism (c > 1): a rank's GEMMs and element-wise kernels are those of its s/c tokens; its
attention scores and context are 1/c of the whole sequence's ((s/c) queries against all s keys), the same
on every rank (the 2c-chunk load balancing of mtds.cp.chunks).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from mtds.plan.candidate import Candidate, Workload
from mtds.plan.hardware import Cluster
from mtds.plan.host_costs import contention_factor, optimizer_step_time
from mtds.plan.model_spec import ModelSpec


@dataclass(frozen=True)
class PassTimes:
    """Seconds for the forward of the whole layer, of its attention core alone, and of its weight
    GEMMs (QKV, projection, FC1, FC2: the weight-gradient pass W does the same FLOPs)."""

    forward: float
    attention_core: float
    linear: float = 0.0


def gemm_time(m: float, n: float, k: float, cluster: Cluster, batch: float = 1.0, elem_bytes: int = 2) -> float:
    """Roofline time of `batch` GEMMs [m x k] @ [k x n]: 2 m n k FLOPs, operands read once."""
    c = cluster.calib
    peak = cluster.gpu.peak_tflops * 1e12
    smallest = min(m, n, k)
    eff = c.gemm_max_fraction * smallest / (smallest + c.gemm_half_dim)
    flops = 2.0 * m * n * k * batch
    bytes_moved = elem_bytes * (m * k + k * n + m * n) * batch
    return max(flops / (peak * eff), bytes_moved / (cluster.gpu.hbm_gbps * 1e9 * c.hbm_efficiency)) \
        * contention_factor(cluster)


def elementwise_time(bytes_moved: float, cluster: Cluster) -> float:
    """Memory-bound kernel; on a shared host slowed by the ranks beside it (host_costs.contention_factor)."""
    return bytes_moved / (cluster.gpu.hbm_gbps * 1e9 * cluster.calib.hbm_efficiency) * contention_factor(cluster)


def layer_forward(model: ModelSpec, layout: Candidate, work: Workload, cluster: Cluster) -> PassTimes:
    """Forward time of one layer (cached: it depends only on t, c, b and sequence parallelism)."""
    return _layer_forward(model, layout.tp, layout.microbatch, layout.sequence_parallel, work, cluster, layout.cp,
                          layout.ep)


@lru_cache(maxsize=4096)
def _layer_forward(model: ModelSpec, t: int, b: int, sequence_parallel: bool, work: Workload,
                   cluster: Cluster, c: int = 1, ep: int = 1) -> PassTimes:
    """Forward time of one layer for one microbatch on one of the t tensor-parallel GPUs.

    GEMMs per layer (Megatron TP split, arXiv 1909.08053 Fig. 3): QKV [bs x h]@[h x (h + 2h_kv)/t]
    (h_kv = h for multi-head attention, smaller for GQA; with an explicit head_dim d, h stands for a d in
    the attention's widths and in the projection's input), scores (b a/t) x [s x h/a]@[h/a x s],
    context (b a/t) x [s x s]@[s x h/a], projection [bs x h/t]@[h/t x h], FC1 [bs x h]@[h x f/t]
    (2f/t for SwiGLU: gate and up in one GEMM), FC2 [bs x f/t]@[f/t x h].
    Element-wise bytes (16-bit values, reads + writes, fused kernels as in Megatron):
      hidden-size ops: 2 layer norms (4 B/elem each) + 2 dropout-add-residual (7 B/elem each)
        = 22 bytes x s b h, divided by t with sequence parallelism (else replicated);
      bias + GeLU on the f/t intermediate: 4 bytes x s b f / t (SwiGLU reads gate and up: 6 bytes);
      QKV split/transposes and context transpose: 4 bytes x s b (2h + 2h_kv) / t;
      scale-mask-softmax (4 B) + dropout (5 B) on the b a/t s^2 scores: 9 bytes each.
    Context parallelism (c ranks): every token count above is the rank's s/c; the scores and context are
    (b a/t) x [s/c x e]@[e x s] and [s/c x s]@[s x e] (1/c of the whole sequence's work, as c blocks of
    s/c keys each), and the softmax bytes 9 b a/t s^2 / c.
    MoE blocks (a share moe_fraction of the l blocks; the result is the average block): the MLP becomes the
    router [bs x h]@[h x E] and the experts. With balanced load a rank's E/e experts get b s k rows in all
    (b s k e / E each): per expert [rows x h]@[h x 2F/t] and [rows x F/t]@[F/t x h], batched over the E/e
    local experts (one grouped GEMM per projection); SwiGLU's 6 bytes x rows F / t element-wise. The
    all-to-all's permutations are not counted. A shared expert (width S) adds [bs x h]@[h x 2S/t] and
    [bs x S/t]@[S/t x h] in each MoE block.
    Latent attention (ModelSpec.latent): its projections' GEMMs (:func:`latent_linear_time`) replace QKV and the
    output projection; the scores run over the qk + RoPE dims, x V over the value dims.
    """
    s, h, a, f = model.seq, model.hidden, model.heads, model.ffn
    w = work.bytes_per_value
    sl = s / c                 # this rank's queries
    tokens = sl * b
    q = model.q_width          # h, or a * head_dim (Qwen3)
    hd = q / a
    heads_local = b * a / t
    kv = model.kv_width
    fc1_width = f * (model.mlp_matrices - 1)
    moe = model.moe_fraction
    dense_mlp = (gemm_time(tokens, fc1_width / t, h, cluster, elem_bytes=w)
                 + gemm_time(tokens, h, f / t, cluster, elem_bytes=w))
    ffn_ops = (6.0 if model.gated_mlp else 4.0) * tokens * f / t
    if moe:
        big_e, fe = model.num_experts, model.moe_ffn
        rows = tokens * model.moe_top_k * ep / big_e      # per local expert
        experts = big_e / ep
        moe_mlp = (gemm_time(tokens, big_e, h, cluster, elem_bytes=w)
                   + gemm_time(rows, 2 * fe / t, h, cluster, batch=experts, elem_bytes=w)
                   + gemm_time(rows, h, fe / t, cluster, batch=experts, elem_bytes=w))
        if model.moe_shared_ffn:
            fs = model.moe_shared_ffn
            moe_mlp += (gemm_time(tokens, 2 * fs / t, h, cluster, elem_bytes=w)
                        + gemm_time(tokens, h, fs / t, cluster, elem_bytes=w))
            ffn_ops_shared = 6.0 * tokens * fs / t
        else:
            ffn_ops_shared = 0.0
        dense_mlp = (1.0 - moe) * dense_mlp + moe * moe_mlp
        ffn_ops = (1.0 - moe) * ffn_ops + moe * (6.0 * tokens * model.moe_top_k * fe / t + ffn_ops_shared)
    if model.latent:
        attention_linear = latent_linear_time(model, tokens, t, cluster, w)
    else:
        attention_linear = (gemm_time(tokens, (q + 2 * kv) / t, h, cluster, elem_bytes=w)
                            + gemm_time(tokens, h, q / t, cluster, elem_bytes=w))
    linear = attention_linear + dense_mlp
    hv = model.v_width / a          # the value head dim (= hd but for latent attention)
    attn_gemm = (gemm_time(sl, s, hd, cluster, batch=heads_local, elem_bytes=w)
                 + gemm_time(sl, hv, s, cluster, batch=heads_local, elem_bytes=w))
    scale = w / 2.0
    hidden_ops = 22.0 * tokens * h / (t if sequence_parallel else 1)
    transposes = 4.0 * tokens * (2 * q + 2 * kv) / t
    softmax_ops = 9.0 * heads_local * sl * s
    elem = elementwise_time(scale * (hidden_ops + ffn_ops + transposes), cluster)
    attn_elem = elementwise_time(scale * softmax_ops, cluster)
    core = attn_gemm + attn_elem
    return PassTimes(forward=linear + elem + core, attention_core=core, linear=linear)


def layer_compute_time(model: ModelSpec, layout: Candidate, work: Workload, cluster: Cluster) -> float:
    """Forward + backward (+ recomputation) compute of one layer for one microbatch.

    none: F + 2F; full: F + F (recomputed forward) + 2F; selective: F + 2F + attention core.
    """
    p = layer_forward(model, layout, work, cluster)
    extra = {"none": 0.0, "selective": p.attention_core, "full": p.forward}[layout.recompute]
    return 3.0 * p.forward + extra


def output_layer_time(model: ModelSpec, layout: Candidate, work: Workload, cluster: Cluster) -> float:
    """Logits GEMM [bs x h]@[h x V/t] forward + backward, and the fp32 vocab-parallel cross
    entropy over the b s V/t logits (mtds.tp.cross_entropy, as Megatron's): row max (read),
    shift, exp, softmax division (read + write each), sum (read), gradient scale (read + write):
    10 passes of 4 bytes; 16-bit logits add the upcast and the gradient's downcast (12 bytes).
    s is the rank's s/c tokens under context parallelism."""
    s, b, h, t = layout.local_seq(model.seq), layout.microbatch, model.hidden, layout.tp
    v = model.padded_vocab(t) / t
    gemm = gemm_time(s * b, v, h, cluster, elem_bytes=work.bytes_per_value)
    loss_bytes = 40.0 + (12.0 if work.bytes_per_value == 2 else 0.0)
    return 3.0 * gemm + elementwise_time(loss_bytes * s * b * v, cluster)


def embedding_time(model: ModelSpec, layout: Candidate, work: Workload, cluster: Cluster) -> float:
    """Vocab-parallel embedding, forward + backward, memory bound: the row lookup (read + write) and the
    position add (read 2, write 1) move 5 values per output element in forward; the backward's
    scatter-add into the table and the position gradient twice that (the 1:2 ratio above). Every TP
    rank produces the whole [s, b, h] output (masked lookup, then all-reduce), so t does not divide it
    (c does: each rank of a context-parallel group embeds its s/c tokens)."""
    values = 5.0 * 3.0 * layout.local_seq(model.seq) * layout.microbatch * model.hidden
    return elementwise_time(values * work.bytes_per_value, cluster)


def final_norm_time(model: ModelSpec, layout: Candidate, work: Workload, cluster: Cluster) -> float:
    """The final layer norm, forward + backward: 4 bytes per element per pass at 16 bits, as each of
    a layer's two norms in :func:`_layer_forward` (1/t of the sequence with sequence parallelism)."""
    t = layout.tp if layout.sequence_parallel else 1
    forward = 4.0 * work.bytes_per_value / 2.0 * layout.local_seq(model.seq) * layout.microbatch * model.hidden / t
    return 3.0 * elementwise_time(forward, cluster)


def grad_accumulation_time(n_params_local: float, grad_bytes: float, acc_bytes: float, cluster: Cluster) -> float:
    """Adding one microbatch's weight gradients into the accumulation buffer (unfused): read the
    new gradient (grad_bytes) and read + write the accumulator (2 x acc_bytes) per parameter."""
    if cluster.calib.fused_grad_accumulation:
        return 0.0
    return elementwise_time((grad_bytes + 2.0 * acc_bytes) * n_params_local, cluster)


def optimizer_time(n_params_local: float, cluster: Cluster, n_tensors: float = 0.0) -> float:
    """Adam step. With a calibrated optimizer (CPU profile): host_costs.optimizer_step_time, the
    trainer's clip + AdamW + zero_grad as measured per parameter and per tensor. Else memory bound:
    ~28 bytes per local parameter (read fp32 master, m, v and the grad, write master, m, v and the
    16-bit copy)."""
    measured = optimizer_step_time(n_params_local, n_tensors, cluster)
    if measured is not None:
        return measured
    return elementwise_time(28.0 * n_params_local, cluster)


def latent_linear_time(model: ModelSpec, tokens: float, t: int, cluster: Cluster, w: float) -> float:
    """Latent attention's projections for ``tokens`` rows: Q (or its down- and up-projection), the K/V
    down-projection (r_kv + RoPE wide, replicated), the K/V up-projection and the output projection (split t
    ways with the heads)."""
    h, a = model.hidden, model.heads
    qk = model.qk_head_dim + model.qk_pos_emb_head_dim
    r_q, r_kv = model.q_lora_rank, model.kv_lora_rank
    q = gemm_time(tokens, a * qk / t, h, cluster, elem_bytes=w) if r_q is None else \
        gemm_time(tokens, r_q, h, cluster, elem_bytes=w) + gemm_time(tokens, a * qk / t, r_q, cluster, elem_bytes=w)
    return (q + gemm_time(tokens, r_kv + model.qk_pos_emb_head_dim, h, cluster, elem_bytes=w)
            + gemm_time(tokens, a * (model.qk_head_dim + model.v_head_dim) / t, r_kv, cluster, elem_bytes=w)
            + gemm_time(tokens, h, model.context_width / t, cluster, elem_bytes=w))
