"""A bound on two differently ordered reductions (16-bit training above all), named so that its spread can be
measured: ``within(name, value, bound)`` is ``value < bound``, and with ``MTDS_BOUNDS_LOG=FILE`` it also
appends {name, value, bound, isa} to FILE. ``python -m lab.bounds_audit`` runs the suite's files that hold such
bounds under the native, AVX2 and plain (``default``) CPU kernels and prints each bound against the largest value
measured; docs/testing.md holds that table, and each bound is set from it with room, not from one machine."""
from __future__ import annotations

import json
import os


def isa() -> str:
    """The kernels this process's PyTorch runs: what ATEN_CPU_CAPABILITY forces, else the CPU's own."""
    import torch
    return os.environ.get("ATEN_CPU_CAPABILITY") or torch.backends.cpu.get_cpu_capability().lower()


def within(name: str, value: float, bound: float) -> bool:
    """``value < bound``; recorded under ``name`` when MTDS_BOUNDS_LOG is set."""
    path = os.environ.get("MTDS_BOUNDS_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"name": name, "value": float(value), "bound": bound, "isa": isa()}) + "\n")
    return value < bound
