"""A bound on two differently ordered reductions (16-bit training above all), named so that its spread can be
measured: ``within(name, value, bound)`` is ``value < bound``, and with ``MTDS_BOUNDS_LOG=FILE`` it also
appends {name, value, bound, isa} to FILE. ``beyond(name, value, floor)`` is ``value > floor`` (a check that a
difference is there to see: a mutant caught, a run really in 16 bits), and ``same(name, got, want)`` is
``got == want`` for a claim of bit-equality, logged with the largest relative difference (0 when equal).
``python -m lab.bounds_audit`` runs the suite's files that hold such bounds under the native, AVX2 and plain
(``default``) CPU kernels and prints each bound against the values measured; docs/testing.md holds that table,
and each bound is set from it with room, not from one machine."""
from __future__ import annotations

import json
import math
import os


def isa() -> str:
    """The kernels this process's PyTorch runs: what ATEN_CPU_CAPABILITY forces, else the CPU's own."""
    import torch
    return os.environ.get("ATEN_CPU_CAPABILITY") or torch.backends.cpu.get_cpu_capability().lower()


def _log(name: str, kind: str, value: float, bound: float) -> None:
    path = os.environ.get("MTDS_BOUNDS_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"name": name, "kind": kind, "value": float(value), "bound": bound, "isa": isa()}) + "\n")


def within(name: str, value: float, bound: float) -> bool:
    """``value < bound``; recorded under ``name`` when MTDS_BOUNDS_LOG is set."""
    _log(name, "below", value, bound)
    return value < bound


def beyond(name: str, value: float, floor: float) -> bool:
    """``value > floor``; recorded under ``name`` (the audit reports the smallest value) when MTDS_BOUNDS_LOG is set."""
    _log(name, "above", value, floor)
    return value > floor


def _floats(x) -> list[float]:
    if isinstance(x, (list, tuple)):
        return [v for item in x for v in _floats(item)]
    return [float(x)]


def same(name: str, got, want) -> bool:
    """``got == want`` (numbers, or lists and tuples of them); recorded under ``name`` with the largest relative
    difference of their elements (0 when equal, inf when the shapes differ) when MTDS_BOUNDS_LOG is set."""
    equal = got == want
    if os.environ.get("MTDS_BOUNDS_LOG"):
        a, b = _floats(got), _floats(want)
        if len(a) != len(b):
            diff = math.inf
        else:
            diff = max((abs(x - y) / abs(y) if y else abs(x - y) for x, y in zip(a, b) if x != y), default=0.0)
        _log(name, "exact", 0.0 if equal else diff, 0.0)
    return equal
