"""Named calibration constants of the performance model, one set per GPU type.

These are the only free numbers of the planner. Each is a physical efficiency (fraction of a
datasheet peak) or a latency, set once per GPU type and never per workload or per table row.

A100 values: matmul and HBM fractions are typical cuBLAS / STREAM-like figures for A100-SXM4;
NVLink 0.77 is the nccl-tests all-reduce bus bandwidth on an 8x A100 NVSwitch node (~230 of 300 GB/s);
InfiniBand 0.9 is the link efficiency of the Calculon model (Isaev et al., SC'23, "Calculon: a
methodology and tool for high-level co-design of systems and LLMs").
H100 and V100 reuse the A100 fractions; they are not validated against published runs (no table
ships for them).
"""
from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Calibration:
    """Efficiency constants of one GPU type (all fractions of datasheet peaks)."""

    # Largest fraction of peak tensor-core FLOP/s a large GEMM sustains (cuBLAS, big tiles;
    # 0.75 x 312 = 234 TFLOP/s bf16 on A100).
    gemm_max_fraction: float = 0.75
    # GEMM efficiency falls as its smallest dimension n shrinks: eff = max * n / (n + n_half)
    # (small dims leave tiles / SMs partly idle). n_half is the dimension at half efficiency.
    gemm_half_dim: float = 24.0
    # Fraction of datasheet HBM bandwidth reached by memory-bound kernels
    # (layer norm, softmax, dropout, GeLU, optimizer step).
    hbm_efficiency: float = 0.80
    # Fraction of per-direction NVLink bandwidth a ring all-reduce reaches on large (>= 16 MB)
    # messages. nccl-tests all_reduce_perf on an 8x A100 NVSwitch node reports ~230 GB/s bus
    # bandwidth of the 300 GB/s per direction: 0.77. (The colleague's first value, 0.6 from
    # Calculon, over-charged every t=8 layout by ~25% of its TP time.)
    nvlink_efficiency: float = 0.77
    # Fraction of per-GPU InfiniBand bandwidth a ring collective or p2p reaches (Calculon: 0.9).
    ib_efficiency: float = 0.90
    # Per-step latency of a ring collective hop / of a p2p message, seconds.
    hop_latency_s: float = 5e-6
    # Fraction of data-parallel gradient reduction hidden behind backward compute. 0 for
    # Megatron-style "reduce after the last microbatch" (what the PTD-P paper measured).
    dp_overlap: float = 0.0
    # Extra slowdown of ZeRO-3 parameter gathers / gradient reduce-scatters relative to an
    # ideal bucketed ring (per-module launches, host-side bookkeeping, fragmentation).
    zero3_comm_efficiency: float = 0.75
    # How well ZeRO-3 prefetching overlaps communication Z with compute C: step part is
    # (C^k + Z^k)^(1/k); k=1 no overlap, large k perfect overlap; finite k models the SM and
    # HBM contention between NCCL kernels and GEMMs when both run at once.
    zero3_overlap_exponent: float = 2.5
    # Memory not available to the model: CUDA context, allocator fragmentation, comm buffers.
    memory_reserve_gib: float = 3.0
    # Fraction of the allocated bytes (model states + activations) the PyTorch caching allocator
    # additionally loses to fragmentation (block rounding, split blocks that cannot be reused for
    # differently sized tensors); 5-10% is typical of long training runs. Keeps the planner from
    # recommending layouts that fit only to the last few hundred MB.
    allocator_fragmentation: float = 0.05
    # Bytes per parameter of the gradient-accumulation buffer that 16-bit training keeps
    # without ZeRO-2/3: Megatron's DDP `main_grad` and DeepSpeed's bf16 optimizer accumulate
    # gradients in fp32 (4 bytes), which is also the fp32 gradient the Adam step consumes. This
    # replaces the 2-byte gradient of the ZeRO paper's 2+2+12 accounting (-> 2+4+12 = 18).
    main_grad_bytes: float = 4.0
    # Whether adding each microbatch's weight gradient into the accumulation buffer is fused
    # into the weight-gradient GEMM. False (the PTD-P-era Megatron hook `main_grad.add_(grad)`,
    # and PyTorch autograd's `.grad +=`): a separate memory-bound pass per microbatch over every
    # local parameter, reading the new gradient and reading + writing the accumulator
    # (2 + 4 + 4 = 10 bytes/param in bf16). It is what makes many small microbatches (b=1,
    # m in the hundreds) cost more than the bubble formula alone says.
    fused_grad_accumulation: bool = False
    # Which attention kernel the run gets. "flash": torch SDPA's flash / memory-efficient kernels (any
    # CUDA GPU mtds runs on; causal, no explicit mask) keep no s x s scores, softmax or dropout mask for
    # backward -- they recompute them -- only a per-row logsumexp. "math": the explicit kernel of
    # Megatron 2021-22 (what Korthikanti et al.'s 5 a s^2 b term counts), and torch's CPU path with dropout.
    attention_kernel: str = "flash"
    # Host-side costs a calibrated CPU profile measures (mtds.plan.host_costs); None on GPUs, where the
    # roofline terms above stand for them.
    # Processes that ran the profile's measurements at once on the machine's `host_cores` cores: its
    # rates are per-rank rates at that concurrency (host_costs.contention_factor rescales to another).
    calibrated_concurrency: int | None = None
    host_cores: int | None = None
    # The trainer's optimizer step as it runs (torch AdamW, single-tensor loop, plus the global-norm
    # gradient clipping and zeroing of the gradients): seconds per parameter and per parameter tensor.
    optimizer_s_per_param: float | None = None
    optimizer_s_per_tensor: float | None = None
    # Bytes/s one rank's collective moves through the host's own stack (gloo: TCP, copies and the
    # reductions, on the cores that compute) -- the calibrated all-reduce bus bandwidth. A shaped
    # inter-node link and this host cost are paid one after the other (host_costs.serial_link_gbps).
    host_transport_gbps: float | None = None
    # What DeepSpeed's engine adds per micro-batch beside FLOPs and bytes (hooks, bucketing, bookkeeping),
    # measured by mtds.plan.calibrate_engine: ((zero_stage, s per micro-batch, s per module per micro-batch), ...)
    engine_overhead: tuple = ()
    # The collectives' library: gloo runs reduce_scatter as an all-reduce (host_costs.zero3_traffic).
    collective_backend: str = "nccl"

    def with_overrides(self, **kw) -> "Calibration":
        return replace(self, **kw)


CALIBRATIONS: dict[str, Calibration] = {
    "A100": Calibration(),
    "H100": Calibration(),
    "V100": Calibration(),
}

# A measured local device profile already reports achieved rates, so its efficiencies are 1.
LOCAL_CALIBRATION = Calibration(
    gemm_max_fraction=1.0, gemm_half_dim=1.0, hbm_efficiency=1.0, nvlink_efficiency=1.0,
    ib_efficiency=1.0, hop_latency_s=50e-6, dp_overlap=0.0, zero3_comm_efficiency=1.0,
    zero3_overlap_exponent=1.0, memory_reserve_gib=1.0, allocator_fragmentation=0.0, attention_kernel="math",
)
