"""GPU types (from the shipped hardware table) and clusters built from them.

A cluster is n_nodes x gpus_per_node GPUs. Intra-node links are NVLink/NVSwitch (every GPU reaches
every other GPU of its node at the per-direction NVLink bandwidth); inter-node traffic goes
through one InfiniBand HCA per GPU (DGX A100 / Selene, arXiv 2104.04473 Section 5).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path

from mtds.observe.metrics import peak_tflops as _metrics_peak
from mtds.plan.calibration import CALIBRATIONS, LOCAL_CALIBRATION, Calibration
from mtds.plan.tables import load_table

# Short names accepted on the command line -> rows of hardware.csv.
GPU_ALIASES = {
    "A100": "A100-SXM4-80GB", "A100-80GB": "A100-SXM4-80GB", "A100-SXM4-80GB": "A100-SXM4-80GB",
    "H100": "H100-SXM5-80GB", "H100-80GB": "H100-SXM5-80GB", "H100-SXM5-80GB": "H100-SXM5-80GB",
    "V100": "V100-SXM2-32GB", "V100-32GB": "V100-SXM2-32GB", "V100-SXM2-32GB": "V100-SXM2-32GB",
}

DEFAULT_PROFILE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mtds" / "device_profile.json"


@dataclass(frozen=True)
class GPUSpec:
    """Datasheet numbers of one GPU type; bandwidths in GB/s (1e9 bytes/s) per direction."""

    name: str
    peak_tflops: float          # dense tensor-core peak for the training precision
    hbm_gib: float
    hbm_gbps: float
    nvlink_gbps: float          # per GPU, per direction
    internode_gbps: float       # per GPU (one HCA each), per direction
    gpus_per_node: int
    calibration: Calibration = field(default_factory=Calibration)


def gpu_names() -> list[str]:
    return sorted(GPU_ALIASES) + ["local"]


def get_gpu(name: str, precision: str = "bf16", profile: str | os.PathLike | None = None) -> GPUSpec:
    """GPU spec by name ("A100-80GB", "H100", "V100", or "local" for a calibrated profile)."""
    if name == "local":
        return load_profile(profile or DEFAULT_PROFILE)
    full = GPU_ALIASES.get(name) or GPU_ALIASES.get(name.upper())
    if full is None:
        raise ValueError(f"unknown GPU {name!r}; choose one of {', '.join(gpu_names())}")
    row = next(r for r in load_table("hardware.csv") if r["gpu"] == full)
    family = full.split("-")[0]
    peak = row["peak_tflops_bf16"] if precision in ("bf16", "fp16") else _metrics_peak(full, precision)
    if precision == "bf16" and family == "V100":
        raise ValueError("V100 has no bf16 tensor cores; use --precision fp16")
    return GPUSpec(
        name=full, peak_tflops=float(peak), hbm_gib=float(row["hbm_gib"]), hbm_gbps=float(row["hbm_gbps"]),
        nvlink_gbps=float(row["nvlink_gbps_per_dir"]), internode_gbps=float(row["internode_gbps_per_gpu"]),
        gpus_per_node=int(row["gpus_per_node"]), calibration=CALIBRATIONS[family],
    )


def load_profile(path: str | os.PathLike) -> GPUSpec:
    """GPU spec from a `mtds-plan --calibrate` profile: measured rates, unit efficiencies."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no device profile at {path}; run `mtds-plan --calibrate` first")
    prof = json.loads(path.read_text())
    return GPUSpec(
        name=f"local:{prof.get('device', 'cpu')}", peak_tflops=float(prof["matmul_tflops"]),
        hbm_gib=float(prof["memory_gib"]), hbm_gbps=float(prof["memory_gbps"]),
        nvlink_gbps=float(prof["allreduce_busbw_gbps"]), internode_gbps=float(prof["allreduce_busbw_gbps"]),
        gpus_per_node=int(prof.get("devices_per_node", 2)),
        calibration=_profile_calibration(prof),
    )


def _profile_calibration(prof: dict) -> Calibration:
    """Unit efficiencies, except what the profile measured beyond a single peak: the GEMM size
    curve (n_half) and element-wise kernels, which run below copy bandwidth on a CPU."""
    memory = float(prof["memory_gbps"])
    elementwise = float(prof.get("elementwise_gbps", memory))
    optional = {k: prof.get(k) for k in ("optimizer_s_per_param", "optimizer_s_per_tensor")}
    return LOCAL_CALIBRATION.with_overrides(
        calibrated_concurrency=prof.get("concurrency"), host_cores=prof.get("host_cores"),
        host_transport_gbps=float(prof["allreduce_busbw_gbps"]) if "concurrency" in prof else None,
        collective_backend=prof.get("backend", "gloo"),
        engine_overhead=tuple((int(k), float(c0), float(c1)) for k, (c0, c1) in prof.get("engine_overhead", {}).items()),
        **optional,
        hop_latency_s=float(prof.get("allreduce_latency_s", 50e-6)),
        gemm_half_dim=float(prof.get("gemm_half_dim", LOCAL_CALIBRATION.gemm_half_dim)),
        hbm_efficiency=min(1.0, elementwise / memory) if memory > 0 else 1.0,
    )


@dataclass(frozen=True)
class Cluster:
    """`nodes` x `gpus_per_node` GPUs of one type; bandwidth overrides in GB/s. ``ranks_per_host``: how
    many ranks share one host's cores (a CPU profile's contention term; None: one device per rank)."""

    gpu: GPUSpec
    gpus: int
    gpus_per_node: int | None = None
    intra_gbps: float | None = None
    inter_gbps: float | None = None
    ranks_per_host: int | None = None

    @property
    def per_node(self) -> int:
        return min(self.gpus_per_node or self.gpu.gpus_per_node, self.gpus)

    @property
    def nodes(self) -> int:
        return -(-self.gpus // self.per_node)

    @property
    def calib(self) -> Calibration:
        return self.gpu.calibration

    def link_gbps(self, group_span: int) -> float:
        """Effective per-GPU bandwidth (GB/s) of a collective whose ranks span `group_span`
        consecutive GPUs: NVLink if they fit in one node, else the per-GPU InfiniBand HCA
        (the slowest link of the ring bounds it)."""
        if group_span <= self.per_node:
            intra = (self.intra_gbps or self.gpu.nvlink_gbps) * self.calib.nvlink_efficiency
            if self.calib.host_transport_gbps:   # measured on the host's cores: shared as compute is
                intra /= contention_factor(self)
            return intra
        link = (self.inter_gbps or self.gpu.internode_gbps) * self.calib.ib_efficiency
        if self.inter_gbps:      # a shaped link: its bytes also cross the host's stack (serial_link_gbps)
            return serial_link_gbps(link, self)
        return link

    def with_gpu(self, **kw) -> "Cluster":
        return replace(self, **kw)


# Two of mtds.plan.host_costs's terms (described there), here because Cluster.link_gbps applies them.
def host_sharing(cluster: Cluster) -> tuple[int, int, int] | None:
    """(ranks of the run on the host, host cores, ranks the profile ran at once), or None where the
    profile or the cluster does not say (GPUs): then the sharing terms are neutral."""
    c = cluster.calib
    k_run = cluster.ranks_per_host
    if not (c.calibrated_concurrency and c.host_cores and k_run):
        return None
    return k_run, c.host_cores, c.calibrated_concurrency


def contention_factor(cluster: Cluster) -> float:
    """How much slower a rank computes than the profile measured, from the ranks sharing the host."""
    sharing = host_sharing(cluster)
    if sharing is None:
        return 1.0
    k_run, cores, k_cal = sharing
    return max(1.0, k_run / cores) / max(1.0, k_cal / cores)


def serial_link_gbps(link_gbps: float, cluster: Cluster) -> float:
    """Effective GB/s of a link whose bytes also pass through the host's stack (mtds.plan.host_costs)."""
    host = cluster.calib.host_transport_gbps
    if not host:
        return link_gbps
    return 1.0 / (1.0 / link_gbps + contention_factor(cluster) / host)
