"""Count collective calls, payload bytes and ring bus bytes, per collective kind and per process group.

``CommTracer`` wraps the collectives in place, in both namespaces callers reach them through:
``torch.distributed`` and ``torch.distributed.distributed_c10d`` (DeepSpeed 0.19's comm backend calls
``distributed_c10d._all_gather_base`` and ``distributed_c10d.all_gather_into_tensor`` directly). It
must be installed before DeepSpeed sets up communication (DeepSpeed keeps its own references to the
functions it found). The cost per call is a few dict updates, so it can stay on during benchmarks.

Payload bytes are the bytes of the tensor a rank contributes (all-reduce: the tensor; all-gather:
the input shard; reduce-scatter: the full input; send/recv/broadcast: the tensor). Bus bytes are
what a ring algorithm puts on each rank's link (Thakur et al. 2005; NCCL's "busbw" convention),
rounded to whole bytes per call, for a group of n ranks:
  all-reduce 2(n-1)/n x payload; all-gather (n-1) x shard = (n-1)/n x the full tensor;
  reduce-scatter and all-to-all (n-1)/n x payload; broadcast, reduce, gather, scatter, p2p: payload.
A collective over a group of one rank moves nothing and is not counted at all.

Also counted: ``batch_isend_irecv`` (each P2POp as a send or recv in its group), the coalesced
collectives (one call, the summed tensors) and the object collectives (``all_gather_object``,
``broadcast_object_list``, ...; their bytes are those of the tensor collectives torch runs for them).
A traced call made from inside another traced call (torch's object collectives, ``_all_gather_base``
forwarding to ``all_gather_into_tensor``, ``batch_isend_irecv`` calling ``isend``) is not counted
again: its bytes belong to the outer call.

Placement (``CommTracer(ranks_per_node=R)``, global ranks numbered node by node): each entry also gets
``intra_bytes`` / ``inter_bytes``, what this rank *sends* to a peer on its own / another node. Ring
collectives send their per-rank ring bytes to the next rank of the group (gloo: reduce-scatter runs as
an all-reduce, so all-reduce bytes); sends go to their destination; a broadcast is sent by its source
to every other member (gloo's one-to-all), likewise a scatter; a gather's
members send to its root; all-to-all sends payload/n to each member; receives send
nothing. Summed over a node's ranks, ``inter_bytes`` is what the node's link must carry.
"""
from __future__ import annotations

import functools
import threading
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from mtds import ring

_NAMESPACES = (dist, c10d)

# function name -> (kind, position of the group argument, position of the payload tensor)
# payload position None: the bytes are those of the tensor collectives the call runs inside.
_TRACED: dict[str, tuple[str, int, int | None]] = {
    "all_reduce": ("all_reduce", 2, 0),
    "all_reduce_coalesced": ("all_reduce", 2, 0),     # payload: the list of tensors
    "all_gather": ("all_gather", 2, 1),               # payload: this rank's input shard
    "all_gather_into_tensor": ("all_gather", 2, 1),
    "_all_gather_base": ("all_gather", 2, 1),
    "_all_gather_base_coalesced": ("all_gather", 2, 1),
    "all_gather_coalesced": ("all_gather", 2, 1),
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
    "gather": ("gather", 3, 0),
    "scatter": ("scatter", 3, 0),
    "barrier": ("barrier", 0, None),
    "all_gather_object": ("all_gather_object", 2, None),
    "broadcast_object_list": ("broadcast_object_list", 2, None),
    "gather_object": ("gather_object", 3, None),
    "scatter_object_list": ("scatter_object_list", 3, None),
    "batch_isend_irecv": ("p2p_batch", 0, None),      # special-cased: one record per P2POp
}
# kind -> position of the peer (send/recv) or root (broadcast, gather, scatter) argument
_PEER_POSITION = {"send": 1, "recv": 1, "broadcast": 1, "broadcast_object_list": 1, "gather": 2, "gather_object": 2,
                  "scatter": 2, "scatter_object_list": 2}
_KWARG_NAMES = ("tensor", "tensors", "input_tensor", "input_tensor_list", "input_list", "input")


def bus_bytes(kind: str, payload: int, n: int) -> int:
    """Bytes a ring algorithm moves over each rank's link for one call, whole bytes (mtds.ring)."""
    return round(ring.payload_link_bytes(kind, payload, n))


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


def _group_size(group) -> int:
    return dist.get_world_size(group) if group is not None else dist.get_world_size()


@dataclass
class CollectiveStats:
    calls: int = 0
    bytes: int = 0           # payload bytes (see module docstring)
    bus_bytes: int = 0       # ring bytes on each rank's link
    group_size: int = 0
    intra_bytes: int = 0     # sent to peers on this rank's node (only with ranks_per_node)
    inter_bytes: int = 0     # sent to peers on other nodes


@dataclass
class CommTracer:
    """Install with ``with CommTracer() as tracer:`` or ``tracer.install()``; read ``tracer.summary()``."""

    group_names: dict = field(default_factory=dict)
    stats: dict = field(default_factory=lambda: defaultdict(CollectiveStats))
    ranks_per_node: int | None = None      # set: split sent bytes into intra-/inter-node (module docstring)
    _placement: dict = field(default_factory=dict, repr=False)   # group -> (global ranks, backend)

    def name_group(self, group, name: str) -> None:
        """Label a process group (e.g. "tp", "dp", "pp") so stats are reported per role."""
        if group is not None:
            self.group_names[group] = name

    def _group_label(self, group) -> str:
        if group is None or group is dist.GroupMember.WORLD:
            return "world"
        return self.group_names.get(group, "other")

    def install(self) -> "CommTracer":
        """Start counting. The first install in a process puts wrappers on ``torch.distributed`` and
        ``distributed_c10d``; they stay (DeepSpeed may have cached them) and report to whichever
        tracers are active."""
        for name, spec in _TRACED.items():
            wrapper = _installed_wrapper(name, spec)
            if wrapper is not None and self not in wrapper._mtds_tracers:
                wrapper._mtds_tracers.append(self)
        return self

    def uninstall(self) -> None:
        for name in _TRACED:
            current = getattr(dist, name, None) or getattr(c10d, name, None)
            if current is not None and self in getattr(current, "_mtds_tracers", ()):
                current._mtds_tracers.remove(self)

    def __enter__(self) -> "CommTracer":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def record(self, kind: str, group, nbytes: int, bus: int | None = None, group_size: int | None = None,
               peer: int | None = None) -> None:
        n = _group_size(group) if group_size is None else group_size
        if n <= 1:
            return   # a group of one moves nothing
        label = self._group_label(group)
        entry = self.stats[(kind, label)]
        if entry.calls and entry.group_size != n:   # an unnamed label mixing group sizes: keep them apart
            entry = self.stats[(kind, f"{label}{n}")]
        entry.calls += 1
        entry.bytes += nbytes
        entry.bus_bytes += bus_bytes(kind, nbytes, n) if bus is None else bus
        entry.group_size = n
        if self.ranks_per_node:
            intra, inter = self._split(kind, group, nbytes, bus, peer)
            entry.intra_bytes += intra
            entry.inter_bytes += inter

    def _split(self, kind: str, group, nbytes: int, bus: int | None, peer: int | None) -> tuple[int, int]:
        """(intra-node, inter-node) bytes this rank sends for one call (see the module docstring)."""
        if group not in self._placement:
            g = None if group is dist.GroupMember.WORLD else group
            self._placement[group] = (dist.get_process_group_ranks(g) if g is not None
                                      else list(range(dist.get_world_size())), dist.get_backend(g))
        ranks, backend = self._placement[group]
        me, n, rpn = dist.get_rank(), len(ranks), self.ranks_per_node

        def to(peer_rank: int, sent: float) -> tuple[int, int]:
            return (0, round(sent)) if peer_rank // rpn != me // rpn else (round(sent), 0)

        if kind in ("recv", "barrier"):
            return 0, 0
        if kind == "send":
            return to(peer, nbytes) if peer is not None else (0, 0)
        if kind in ("gather", "gather_object"):
            return to(peer, nbytes if bus is None else bus) if peer is not None and peer != me else (0, 0)
        if kind in ("broadcast", "broadcast_object_list", "scatter", "scatter_object_list"):
            if peer != me:
                return 0, 0
            pairs = [to(r, nbytes if bus is None else bus) for r in ranks if r != me]
        elif kind == "all_to_all":
            pairs = [to(r, nbytes / n) for r in ranks if r != me]
        else:
            pairs = [to(ranks[(ranks.index(me) + 1) % n],
                        bus_bytes(ring.as_run(kind, backend), nbytes, n) if bus is None else bus)]
        return sum(p[0] for p in pairs), sum(p[1] for p in pairs)

    def reset(self) -> None:
        self.stats.clear()

    def summary(self) -> dict[str, dict[str, int]]:
        """``{"all_reduce/tp": {"calls": n, "bytes": payload, "bus_bytes": b, "group_size": g}, ...}``
        sorted by key."""
        placed = ("intra_bytes", "inter_bytes") if self.ranks_per_node else ()
        return {f"{kind}/{group}": {"calls": s.calls, "bytes": s.bytes, "bus_bytes": s.bus_bytes,
                                    "group_size": s.group_size, **{k: getattr(s, k) for k in placed}}
                for (kind, group), s in sorted(self.stats.items())}

    def total_bytes(self, group: str | None = None) -> int:
        """Payload bytes of every call (in ``group`` if given)."""
        return sum(s.bytes for (kind, g), s in self.stats.items() if group in (None, g) and kind != "barrier")

    def total_bus_bytes(self, group: str | None = None) -> int:
        """Ring bus bytes of every call (in ``group`` if given): what this rank's links carry."""
        return sum(s.bus_bytes for (kind, g), s in self.stats.items() if group in (None, g))


def label_deepspeed_groups(tracer: CommTracer, engine) -> None:
    """Name the process groups DeepSpeed made itself, by axis: a pipeline engine's grid (its own
    data, pipe, tensor-slice and model groups), its p2p groups and the tied-weight groups."""
    from mtds.deepspeed_compat.pipeline import engine_groups
    for group, axis in engine_groups(engine):
        tracer.name_group(group, axis)


_local = threading.local()   # depth of traced calls on this thread, and the outer call's inner bytes


def _peer(group, peer, group_peer):
    """The global rank of a p2p peer or broadcast source given as a global or a group rank."""
    if peer is None and group_peer is not None:
        return dist.get_global_rank(group, group_peer) if group is not None else group_peer
    return peer


def _installed_wrapper(name: str, spec):
    """The wrapper of ``name`` in both namespaces, put there on first use (same object in both)."""
    functions = [getattr(ns, name, None) for ns in _NAMESPACES]
    wrapper = next((f for f in functions if hasattr(f, "_mtds_tracers")), None)
    if wrapper is None:
        original = next((f for f in functions if f is not None), None)
        if original is None:
            return None
        wrapper = _wrap(*spec, original)
    for ns, current in zip(_NAMESPACES, functions):
        if current is not None and current is not wrapper and not hasattr(current, "_mtds_tracers"):
            setattr(ns, name, wrapper)
    return wrapper


def _wrap(kind: str, group_pos: int, payload_pos: int | None, original):
    tracers: list[CommTracer] = []

    @functools.wraps(original)
    def traced(*args, **kwargs):
        if not tracers:
            return original(*args, **kwargs)
        outer = getattr(_local, "inner", None)
        if outer is not None:
            # Called from inside a traced call: let the outer call account for these bytes.
            result = original(*args, **kwargs)
            if payload_pos is not None:
                group = _argument(args, kwargs, group_pos, ("group",))
                n = _group_size(group)
                nbytes = _nbytes(_argument(args, kwargs, payload_pos, _KWARG_NAMES))
                outer[0] += nbytes
                outer[1] += bus_bytes(kind, nbytes, n)
            return result
        _local.inner = inner = [0, 0]
        try:
            result = original(*args, **kwargs)
        finally:
            _local.inner = None
        if kind == "p2p_batch":
            ops = _argument(args, kwargs, 0, ("p2p_op_list",)) or ()
            for op in ops:
                op_kind = "send" if getattr(op.op, "__name__", "") == "isend" else "recv"
                for tracer in tracers:
                    tracer.record(op_kind, op.group, _nbytes(op.tensor), peer=_peer(op.group, op.peer, getattr(op, "group_peer", None)))
            return result
        group = _argument(args, kwargs, group_pos, ("group",))
        if payload_pos is None:
            nbytes, bus = inner            # object collectives (and barrier: nothing inside)
        else:
            nbytes, bus = _nbytes(_argument(args, kwargs, payload_pos, _KWARG_NAMES)), None
        peer = None
        if kind in _PEER_POSITION:     # dst / src: a global rank (or group_dst / group_src)
            peer = _peer(group, _argument(args, kwargs, _PEER_POSITION[kind], ("dst", "src")),
                         kwargs.get("group_dst", kwargs.get("group_src")))
        for tracer in tracers:
            tracer.record(kind, group, nbytes, bus, peer=peer)
        return result

    traced._mtds_tracers = tracers
    return traced
