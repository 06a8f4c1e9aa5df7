"""Count collective calls and payload bytes, per collective kind and per process group.

``CommTracer`` wraps the ``torch.distributed`` collectives in place. It must be installed before
DeepSpeed sets up communication (DeepSpeed keeps its own references to the functions it found).
The cost per call is one dict update, so it can stay on during benchmarks.

Payload bytes are the bytes of the tensor a rank contributes (all-reduce: the tensor; all-gather:
the input shard; reduce-scatter: the full input; send/recv/broadcast: the tensor). Bus bytes of a
ring algorithm follow from them: all-reduce moves 2(n-1)/n x payload per rank, all-gather and
reduce-scatter (n-1)/n x the full tensor (Thakur et al. 2005; NCCL's "busbw" convention).
"""
from __future__ import annotations

import functools
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# function name -> (kind, position of the group argument, position of the payload tensor)
_TRACED: dict[str, tuple[str, int, int | None]] = {
    "all_reduce": ("all_reduce", 2, 0),
    "all_gather": ("all_gather", 2, 1),               # payload: this rank's input shard
    "all_gather_into_tensor": ("all_gather", 2, 1),
    "_all_gather_base": ("all_gather", 2, 1),
    "all_gather_single": ("all_gather", 2, 1),
    "reduce_scatter": ("reduce_scatter", 3, 1),       # payload: the full input
    "reduce_scatter_tensor": ("reduce_scatter", 3, 1),
    "_reduce_scatter_base": ("reduce_scatter", 3, 1),
    "reduce_scatter_single": ("reduce_scatter", 3, 1),
    "broadcast": ("broadcast", 2, 0),
    "send": ("send", 2, 0),
    "isend": ("send", 2, 0),
    "recv": ("recv", 2, 0),
    "irecv": ("recv", 2, 0),
    "all_to_all": ("all_to_all", 2, 1),
    "all_to_all_single": ("all_to_all", 4, 1),
    "reduce": ("reduce", 3, 0),
    "barrier": ("barrier", 0, None),
}
_KWARG_NAMES = ("tensor", "input_tensor", "input_tensor_list", "input_list", "input")


def _nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(o) for o in obj)
    return 0


def _argument(args, kwargs, position: int | None, names: tuple[str, ...]):
    if position is not None and len(args) > position:
        return args[position]
    for name in names:
        if name in kwargs:
            return kwargs[name]
    return None


@dataclass
class CollectiveStats:
    calls: int = 0
    bytes: int = 0


@dataclass
class CommTracer:
    """Install with ``with CommTracer() as tracer:`` or ``tracer.install()``; read ``tracer.summary()``."""

    group_names: dict = field(default_factory=dict)
    stats: dict = field(default_factory=lambda: defaultdict(CollectiveStats))

    def name_group(self, group, name: str) -> None:
        """Label a process group (e.g. "tp", "dp", "pp") so stats are reported per role."""
        if group is not None:
            self.group_names[group] = name

    def _group_label(self, group) -> str:
        if group is None or group is dist.GroupMember.WORLD:
            return "world"
        return self.group_names.get(group, "other")

    def install(self) -> "CommTracer":
        """Start counting. The first install in a process puts wrappers on ``torch.distributed``;
        they stay (DeepSpeed may have cached them) and report to whichever tracers are active."""
        for name, (kind, group_pos, payload_pos) in _TRACED.items():
            current = getattr(dist, name, None)
            if current is None:
                continue
            if not hasattr(current, "_mtds_tracers"):
                current = _wrap(kind, group_pos, payload_pos, current)
                setattr(dist, name, current)
            if self not in current._mtds_tracers:
                current._mtds_tracers.append(self)
        return self

    def uninstall(self) -> None:
        for name in _TRACED:
            current = getattr(dist, name, None)
            if current is not None and self in getattr(current, "_mtds_tracers", ()):
                current._mtds_tracers.remove(self)

    def __enter__(self) -> "CommTracer":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def record(self, kind: str, group, nbytes: int) -> None:
        entry = self.stats[(kind, self._group_label(group))]
        entry.calls += 1
        entry.bytes += nbytes

    def reset(self) -> None:
        self.stats.clear()

    def summary(self) -> dict[str, dict[str, int]]:
        """``{"all_reduce/tp": {"calls": n, "bytes": b}, ...}`` sorted by key."""
        return {f"{kind}/{group}": {"calls": s.calls, "bytes": s.bytes}
                for (kind, group), s in sorted(self.stats.items())}

    def total_bytes(self, group: str | None = None) -> int:
        return sum(s.bytes for (kind, g), s in self.stats.items() if group in (None, g) and kind != "barrier")


def _wrap(kind: str, group_pos: int, payload_pos: int | None, original):
    tracers: list[CommTracer] = []

    @functools.wraps(original)
    def traced(*args, **kwargs):
        if tracers:
            group = _argument(args, kwargs, group_pos, ("group",))
            nbytes = _nbytes(_argument(args, kwargs, payload_pos, _KWARG_NAMES)) if payload_pos is not None else 0
            for tracer in tracers:
                tracer.record(kind, group, nbytes)
        return original(*args, **kwargs)

    traced._mtds_tracers = tracers
    return traced
