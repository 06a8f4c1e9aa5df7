"""Named ranges for torch's profiler that cost nothing when no profiler runs.

``torch.autograd.profiler.record_function`` enters and leaves a RecordFunction (two dispatcher calls and a
Python object) on every use, profiler or not: the step's ranges (one per layer per micro-batch, one per hook
and phase) were ~20 such pairs a step of a tiny 8-layer model on CPU, host time HF's loop does not spend
(benchmarks/bench_host.py). :func:`profiler_range` opens the range only while a torch profiler is on
(``torch.profiler.profile`` sets torch's flag on entry): benchmarks/profile_step.py and ``--profile-step``
see the same ranges as before.
"""
from __future__ import annotations

import contextlib

import torch.autograd.profiler as _profiler

_NONE = contextlib.nullcontext()


def profiler_range(name: str):
    """``record_function(name)`` while a torch profiler records, else a no-op context."""
    return _profiler.record_function(name) if _profiler._is_profiler_enabled else _NONE
