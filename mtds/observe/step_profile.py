"""One training step under torch.profiler, summarised by kind of work: where a step's time goes.

On CUDA the kernels' own time on the device is summed per category (GEMM, attention, element-wise,
copy/cast, reduction, norm, optimizer, collective) beside the kernel count and the step's wall time, so
``sum / wall`` is how busy the GPU was (kernels on other streams may overlap: an upper bound). On CPU the
operators' self time is summed the same way (mtds's own ``record_function`` ranges left out: they nest
the operators). Seen on an H100 (gpt2-medium, b = 8, 2026-11-24): 3,163 kernels a step, GEMMs 34 % of
the GPU's time, the rest small element-wise, cast and reduction kernels with the GPU idle between launches.
"""
from __future__ import annotations

from collections import defaultdict

# (category, substrings of a lower-cased kernel or operator name); the first match wins, so the specific
# names come before the general ones ("layer_norm" before "norm"-reductions, "gemm" before "reduce").
CATEGORIES = (
    ("gemm", ("nvjet", "gemm", "cutlass", "xmma", "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm",
              "aten::matmul", "aten::linear")),
    ("attention", ("sdpa", "flash", "fmha", "attention")),
    ("optimizer", ("adam", "multi_tensor", "optimizer")),
    ("norm", ("layer_norm", "layernorm", "gammabeta", "rms_norm", "rmsnorm")),
    ("collective", ("nccl", "allreduce", "all_reduce", "allgather", "all_gather", "reduce_scatter", "gloo",
                    "c10d::", "sendrecv")),
    ("copy/cast", ("copy", "cast", "aten::to", "contiguous", "clone")),
    ("reduction", ("reduce", "aten::sum", "aten::max", "aten::norm", "linalg_vector_norm", "aten::mean")),
)


def categorize(name: str) -> str:
    low = name.lower()
    for category, keys in CATEGORIES:
        if any(k in low for k in keys):
            return category
    return "element-wise/other"


def summarize(prof, wall_s: float, device_type: str) -> dict:
    """{"wall_ms", "busy_ms", "launches", "rows": [(category, ms, count)] largest first} of a finished
    ``torch.profiler.profile``: CUDA kernels' device time on ``cuda``, operators' self CPU time on ``cpu``."""
    from torch.autograd import DeviceType
    totals: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for e in prof.key_averages():
        if device_type == "cuda":
            if e.device_type != DeviceType.CUDA:
                continue
            us = getattr(e, "self_device_time_total", None)
            us = e.self_cuda_time_total if us is None else us
        else:
            if e.key.startswith(("mtds.", "ProfilerStep", "Optimizer.step", "Optimizer.zero_grad")):
                continue
            us = e.self_cpu_time_total
        row = totals[categorize(e.key)]
        row[0] += us / 1e3
        row[1] += e.count
    rows = sorted(((c, ms, n) for c, (ms, n) in totals.items()), key=lambda r: -r[1])
    return {"wall_ms": wall_s * 1e3, "busy_ms": sum(r[1] for r in rows), "launches": sum(r[2] for r in rows),
            "device": device_type, "rows": rows}


def _what(summary: dict) -> str:
    return "kernels" if summary["device"] == "cuda" else "operators"


def format_summary(summary: dict, step: int) -> str:
    """Two console lines: the step's totals, then each kind's time, share and count."""
    what = _what(summary)
    head = (f"profile of step {step}: wall {summary['wall_ms']:.1f} ms, {summary['launches']:,} {what}, "
            f"{summary['busy_ms']:.1f} ms busy ({summary['busy_ms'] / max(summary['wall_ms'], 1e-9):.0%})")
    parts = [f"{c} {ms:.1f} ms ({ms / max(summary['busy_ms'], 1e-9):.0%}, {n})" for c, ms, n in summary["rows"]]
    return head + "\n  " + "; ".join(parts)


def markdown_table(summary: dict) -> list[str]:
    """The same as a markdown table (gpucheck's report)."""
    busy = max(summary["busy_ms"], 1e-9)
    lines = [f"| kind of work | ms | share | {_what(summary)} |", "|---|---:|---:|---:|"]
    return lines + [f"| {c} | {ms:.2f} | {ms / busy:.0%} | {n:,} |" for c, ms, n in summary["rows"]]
