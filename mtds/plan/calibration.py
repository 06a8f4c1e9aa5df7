"""Named calibration constants of the performance model, one set per GPU type.

These are the only free numbers of the planner. Each is a physical efficiency (fraction of a
datasheet peak) or a latency, set once per GPU type and never per workload or per table row.

A100 values: matmul and HBM fractions are typical cuBLAS / STREAM-like figures for A100-SXM4;
NVLink 0.6 and InfiniBand 0.9 are the link efficiencies of the Calculon model (Isaev et al.,
SC'23, "Calculon: a methodology and tool for high-level co-design of systems and LLMs").
H100 and V100 reuse the A100 fractions with the Calculon NVLink factor for H100; they are
not validated against published runs (no table ships for them).
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
    # Fraction of per-direction NVLink bandwidth a ring collective reaches (Calculon: 0.6 A100).
    nvlink_efficiency: float = 0.60
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

    def with_overrides(self, **kw) -> "Calibration":
        return replace(self, **kw)


CALIBRATIONS: dict[str, Calibration] = {
    "A100": Calibration(),
    "H100": Calibration(nvlink_efficiency=0.65),
    "V100": Calibration(),
}

# A measured local device profile already reports achieved rates, so its efficiencies are 1.
LOCAL_CALIBRATION = Calibration(
    gemm_max_fraction=1.0, gemm_half_dim=1.0, hbm_efficiency=1.0, nvlink_efficiency=1.0,
    ib_efficiency=1.0, hop_latency_s=50e-6, dp_overlap=0.0, zero3_comm_efficiency=1.0,
    zero3_overlap_exponent=1.0, memory_reserve_gib=1.0,
)
