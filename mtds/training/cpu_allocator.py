"""glibc's allocator set up for training on CPU: large temporaries come back from the heap, not from mmap.

By default glibc serves every allocation above a (dynamic) threshold with a fresh ``mmap`` and returns
it with ``munmap`` when freed, and trims the heap's top back to the OS past 128 kB. A training step
allocates the same large temporaries every micro-batch (logits, attention and MLP activations, AdamW's
``sqrt``/``div`` buffers of the flat fp32 partition), so each one is mapped, page-faulted in page by page
(the first touch of every 4 kB page traps into the kernel) and unmapped again, every step. On the
benchmark work (docs/benchmarks.md: GPT-2 and Llama, 5.3-7.6 M parameters, one core per rank) that costs
~5 % of a step. Raising the mmap threshold and the trim threshold keeps freed blocks in the heap for the
next step: the same pages, already faulted in. jemalloc or tcmalloc (``LD_PRELOAD``) do the same and
more, but are not always installed; this needs nothing.

The price is memory the process keeps after a peak instead of returning it: resident memory stays near
the step's peak between steps (the peak itself does not grow: the same blocks are reused). GPU runs are
unaffected (their large buffers live in CUDA's caching allocator) and are not tuned.

Left alone where the user tuned glibc already (``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_``
in the environment), with ``MTDS_CPU_MALLOC=0``, and where the C library is not glibc.
"""
from __future__ import annotations

import ctypes
import os

M_TRIM_THRESHOLD = -1      # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 256 * 2 ** 20
"""Blocks up to this size come from the heap (the default ceiling of glibc's dynamic threshold is 32 MiB,
below e.g. one micro-batch's logits at b = 4, s = 256, V = 8192: exactly 32 MiB)."""
TRIM_THRESHOLD = 2 ** 30
"""Free space at the heap's top kept before glibc gives it back to the OS."""

USER_KNOBS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


def tune_cpu_allocator(environ=os.environ) -> str | None:
    """Set glibc's mmap and trim thresholds for this process; a one-line description of what was done,
    or None where nothing was (see the module docstring for when)."""
    if environ.get("MTDS_CPU_MALLOC", "1") == "0" or any(k in environ for k in USER_KNOBS):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version          # glibc only: musl and macOS have no (or another) mallopt
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return None
    if not (mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return None
    return (f"glibc malloc: blocks up to {MMAP_THRESHOLD >> 20} MiB from the heap, trimmed past "
            f"{TRIM_THRESHOLD >> 20} MiB (MTDS_CPU_MALLOC=0 keeps glibc's defaults)")
