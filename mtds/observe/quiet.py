"""Silence by default: third-party output that tells a user of train.py nothing, filtered here and only here.

Each rule names what it silences and why. train.py, mtds-eval and mtds-convert call :func:`install` before
anything imports DeepSpeed; their ``--debug`` shows everything again. mtds's own lines are never filtered:
the rules match a third-party logger, a warning category raised inside torch, DeepSpeed's ``print()``
calls while mtds builds a pipeline module (:func:`quiet_prints`), and datasets' progress bars while it
reads local files (:func:`local_load_bars`).
"""
from __future__ import annotations

import contextlib
import io
import logging
import re
import sys
import warnings

# (logger, message regex, why)
LOG_RULES: tuple[tuple[str, str, str], ...] = (
    ("DeepSpeed", r"Setting accelerator to CPU\b",
     "each rank says it on a machine without a GPU; mtds's header line names the device and backend "
     "(cpu rank(s) [gloo])"),
)

# (category, module regex, message regex, why)
WARNING_RULES: tuple[tuple[type[Warning], str, str, str], ...] = (
    (FutureWarning, r"torch\.distributed\.",
     r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated",
     "DeepSpeed's ZeRO all-gather (deepspeed.comm.torch) still calls torch's old name, once per rank; mtds's own "
     "collectives use the new names (mtds.tp.mappings)"),
)

# (line regex, why): DeepSpeed print()s these on rank 0 while the pipeline module is built
PRINT_RULES: tuple[tuple[str, str], ...] = (
    (r"^SEED_LAYERS=\S+ BASE_SEED=", "PipelineModule's seeding switches; mtds seeds its layers itself (--seed)"),
    (r"^Using topology: ", "PipelineParallelGrid's rank map; mtds's header line gives the layout"),
)

# datasets' progress bars while it reads local files: "Downloading data" (a copy of files already on disk) and
# "Generating train split" take well under a second for a local corpus; mtds's "Tokenizing" bar (the slow
# part) and every bar of a hub download stay.
LOCAL_LOAD_BARS_WHY = "datasets' 'Downloading data' / 'Generating train split' bars for files already on disk"

_debug = False
_installed: list = []       # (undo function), for uninstall()


class _DropRecords(logging.Filter):
    def __init__(self, patterns: list[re.Pattern]):
        super().__init__()
        self.patterns = patterns

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(p.search(message) for p in self.patterns)


def install(debug: bool = False) -> None:
    """Apply the rules in this process (idempotent); ``debug``: apply none, and let DeepSpeed's prints and
    datasets' bars through too."""
    global _debug
    uninstall()
    _debug = debug
    if debug:
        return
    by_logger: dict[str, list[re.Pattern]] = {}
    for name, pattern, _ in LOG_RULES:
        by_logger.setdefault(name, []).append(re.compile(pattern))
    for name, patterns in by_logger.items():
        # the logger object DeepSpeed configures later (LoggerFactory) is this one: the filter stays on it
        logger, flt = logging.getLogger(name), _DropRecords(patterns)
        logger.addFilter(flt)
        _installed.append(lambda logger=logger, flt=flt: logger.removeFilter(flt))
    for category, module, message, _ in WARNING_RULES:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
        entry = warnings.filters[0]
        _installed.append(lambda entry=entry: entry in warnings.filters and warnings.filters.remove(entry))


def uninstall() -> None:
    global _debug
    while _installed:
        _installed.pop()()
    _debug = False


def debug() -> bool:
    return _debug


def local_load_bars() -> bool:
    """Whether datasets may show its progress bars while it reads local files (only under --debug)."""
    return _debug


class _LineFilter(io.TextIOBase):
    """Passes whole lines to ``out`` unless one of ``patterns`` matches them."""

    def __init__(self, out, patterns: list[re.Pattern]):
        self.out, self.patterns, self.pending = out, patterns, ""

    def write(self, text: str) -> int:
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            if not any(p.search(line) for p in self.patterns):
                self.out.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        self.out.flush()

    def close_pending(self) -> None:
        if self.pending:
            self.out.write(self.pending)
            self.pending = ""


@contextlib.contextmanager
def quiet_prints():
    """Drop the lines of :data:`PRINT_RULES` printed to stdout inside the block (everything passes under
    --debug)."""
    if _debug:
        yield
        return
    original = sys.stdout
    filtered = _LineFilter(original, [re.compile(pattern) for pattern, _ in PRINT_RULES])
    sys.stdout = filtered
    try:
        yield
    finally:
        sys.stdout = original
        filtered.close_pending()
        original.flush()
