"""Count collective calls, payload bytes and ring bus bytes, per collective kind and per process group.

``CommTracer`` wraps the collectives in place, in both namespaces callers reach them through:
``torch.distributed`` and ``torch.distributed.distributed_c10d`` (DeepSpeed 0.19's comm backend calls
``distributed_c10d._all_gather_base`` and ``distributed_c10d.all_gather_into_tensor`` directly). It
must be installed before DeepSpeed sets up communication (DeepSpeed keeps its own references to the
functions it found).

Cost per call: each function gets its own wrapper, made once with its kind and argument positions fixed.
A call adds its payload's bytes (``Tensor.nbytes``: numel x element size) to one counter per active tracer, keyed by
(kind, group, peer); nothing else happens on that path. Group sizes, names, bus bytes and the
intra/inter-node split are worked out from the counters by ``summary()``. Measured:
benchmarks/bench_comm_trace.py (docs/benchmarks.md).

Payload bytes are the bytes of the tensor a rank contributes (all-reduce: the tensor; all-gather:
the input shard; reduce-scatter: the full input; send/recv/broadcast: the tensor). Bus bytes are
what a ring algorithm puts on each rank's link, ``mtds.parallel.ring.payload_link_bytes`` (Thakur et al. 2005;
NCCL's "busbw" convention), of the summed payload of a (kind, group), rounded to whole bytes:
  all-reduce 2(n-1)/n x payload; all-gather (n-1) x shard = (n-1)/n x the full tensor;
  reduce-scatter and all-to-all (n-1)/n x payload; broadcast, reduce, gather, scatter, p2p: payload.
A collective over a group of one rank moves nothing and is not counted at all. Group names are read
when the summary is made, so a group named after its first call is reported under its name.

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
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from mtds.parallel import ring

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
    "batch_isend_irecv": ("p2p_batch", 0, None),      # one count per P2POp
}
# kind -> position of the peer (send/recv) or root (broadcast, gather, scatter) argument
_PEER_POSITION = {"send": 1, "recv": 1, "broadcast": 1, "broadcast_object_list": 1, "gather": 2, "gather_object": 2,
                  "scatter": 2, "scatter_object_list": 2}
_KWARG_NAMES = ("tensor", "tensors", "input_tensor", "input_tensor_list", "input_list", "input")
# kinds whose bus bytes are those of the calls they run inside, summed as they happen
_BUS_FROM_INNER = {kind for kind, _, payload in _TRACED.values() if payload is None}


def bus_bytes(kind: str, payload: int, n: int) -> int:
    """Bytes a ring algorithm moves over each rank's link for one call, whole bytes (mtds.parallel.ring)."""
    return round(ring.payload_link_bytes(kind, payload, n))


def _nbytes(obj) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.nbytes           # numel x element size (of a view: its own elements, not the storage's)
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


@dataclass(eq=False)        # tracers are told apart by identity (install / uninstall)
class CommTracer:
    """Install with ``with CommTracer() as tracer:`` or ``tracer.install()``; read ``tracer.summary()``."""

    group_names: dict = field(default_factory=dict)
    ranks_per_node: int | None = None      # set: split sent bytes into intra-/inter-node (module docstring)
    # (kind, group, peer) -> [calls, payload bytes, bus bytes of _BUS_FROM_INNER kinds]; what the wrappers add to
    counts: dict = field(default_factory=dict, repr=False)
    _placement: dict = field(default_factory=dict, repr=False)   # group -> (global ranks, backend)
    _ranks_in: dict = field(default_factory=dict, repr=False)    # group -> number of ranks

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
        ``distributed_c10d``; they stay (DeepSpeed may have cached them) and count for whichever
        tracers are active."""
        for name, spec in _TRACED.items():
            wrapper = _installed_wrapper(name, spec)
            if wrapper is not None and not any(sink is self.counts for sink in wrapper._mtds_tracers):
                wrapper._mtds_tracers.append(self.counts)
        return self

    def uninstall(self) -> None:
        for name in _TRACED:
            current = getattr(dist, name, None) or getattr(c10d, name, None)
            sinks = getattr(current, "_mtds_tracers", ())
            for i, sink in enumerate(sinks):
                if sink is self.counts:
                    del sinks[i]
                    break

    def __enter__(self) -> "CommTracer":
        return self.install()

    def __exit__(self, *exc) -> None:
        self.uninstall()

    def reset(self) -> None:
        self.counts.clear()          # the same dict: the wrappers hold it

    def _size(self, group) -> int:
        if group not in self._ranks_in:
            self._ranks_in[group] = _group_size(group)
        return self._ranks_in[group]

    def _peer(self, group, peer):
        """A peer counted as ``(group rank,)`` (``group_dst=`` / ``group_src=``) as a global rank."""
        if isinstance(peer, tuple):
            return dist.get_global_rank(group, peer[0]) if group is not None else peer[0]
        return peer

    def stats(self) -> dict[tuple[str, str], CollectiveStats]:
        """{(kind, group label): totals}, from the counters (see the module docstring)."""
        out: dict[tuple[str, str], CollectiveStats] = {}
        first_size: dict[tuple[str, str], int] = {}
        for (kind, group, peer), (calls, nbytes, inner_bus) in list(self.counts.items()):
            n = self._size(group)
            if n <= 1:
                continue   # a group of one moves nothing
            label = self._group_label(group)
            if first_size.setdefault((kind, label), n) != n:   # an unnamed label mixing group sizes: keep apart
                label = f"{label}{n}"
            entry = out.setdefault((kind, label), CollectiveStats())
            explicit = inner_bus if kind in _BUS_FROM_INNER else None
            entry.calls += calls
            entry.bytes += nbytes
            entry.bus_bytes += bus_bytes(kind, nbytes, n) if explicit is None else explicit
            entry.group_size = n
            if self.ranks_per_node:
                intra, inter = self._split(kind, group, nbytes, explicit, self._peer(group, peer))
                entry.intra_bytes += intra
                entry.inter_bytes += inter
        return out

    def _split(self, kind: str, group, nbytes: int, bus: int | None, peer: int | None) -> tuple[int, int]:
        """(intra-node, inter-node) bytes this rank sends for these calls (see the module docstring)."""
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

    def summary(self) -> dict[str, dict[str, int]]:
        """``{"all_reduce/tp": {"calls": n, "bytes": payload, "bus_bytes": b, "group_size": g}, ...}``
        sorted by key."""
        placed = ("intra_bytes", "inter_bytes") if self.ranks_per_node else ()
        return {f"{kind}/{group}": {"calls": s.calls, "bytes": s.bytes, "bus_bytes": s.bus_bytes,
                                    "group_size": s.group_size, **{k: getattr(s, k) for k in placed}}
                for (kind, group), s in sorted(self.stats().items())}

    def total_bytes(self, group: str | None = None) -> int:
        """Payload bytes of every call (in ``group`` if given)."""
        return sum(s.bytes for (kind, g), s in self.stats().items() if group in (None, g) and kind != "barrier")

    def total_bus_bytes(self, group: str | None = None) -> int:
        """Ring bus bytes of every call (in ``group`` if given): what this rank's links carry."""
        return sum(s.bus_bytes for (kind, g), s in self.stats().items() if group in (None, g))


def label_deepspeed_groups(tracer: CommTracer, engine) -> None:
    """Name the process groups DeepSpeed made itself, by axis: a pipeline engine's grid (its own
    data, pipe, tensor-slice and model groups), its p2p groups and the tied-weight groups."""
    from mtds.deepspeed_compat.pipeline import engine_groups
    for group, axis in engine_groups(engine):
        tracer.name_group(group, axis)


# What this thread is inside: absent/None at top level; _NESTED inside a call that counts its own
# payload (calls it makes are not counted); a [bytes, bus] list inside an object collective or a barrier
# (calls it makes add to it).
_local = threading.local()
_NESTED = object()


class CollectiveClock:
    """Seconds the traced collectives took on this process (outermost calls, while a tracer is active): the
    time a rank spent in communication and waiting for its peers, where the call blocks (gloo; NCCL and
    non-blocking p2p return at launch, so there it is launch time). The straggler report (mtds.observe.stragglers)
    subtracts it from the step time to get the rank's own work."""
    seconds = 0.0


clock = CollectiveClock()
_now = time.perf_counter


def _count(sinks: list, key: tuple, nbytes: int, bus: int = 0) -> None:
    for counts in sinks:
        entry = counts.get(key)
        if entry is None:
            counts[key] = entry = [0, 0, 0]
        entry[0] += 1
        entry[1] += nbytes
        entry[2] += bus


def _add_to_outer(outer, kind: str, group_pos: int, payload_pos: int | None, args, kwargs) -> None:
    """A traced call made inside an object collective: its bytes go to the outer call (rare path)."""
    if isinstance(outer, list) and payload_pos is not None:
        group = _argument(args, kwargs, group_pos, ("group",))
        nbytes = _nbytes(_argument(args, kwargs, payload_pos, _KWARG_NAMES))
        outer[0] += nbytes
        outer[1] += bus_bytes(kind, nbytes, _group_size(group))


def _installed_wrapper(name: str, spec):
    """The wrapper of ``name`` in both namespaces, put there on first use (same object in both)."""
    functions = [getattr(ns, name, None) for ns in _NAMESPACES]
    wrapper = next((f for f in functions if hasattr(f, "_mtds_tracers")), None)
    if wrapper is None:
        original = next((f for f in functions if f is not None), None)
        if original is None:
            return None
        kind, group_pos, payload_pos = spec
        make = _wrap_batch if kind == "p2p_batch" else _wrap_inner if payload_pos is None else _wrap_tensor
        wrapper = make(kind, group_pos, payload_pos, original)
    for ns, current in zip(_NAMESPACES, functions):
        if current is not None and current is not wrapper and not hasattr(current, "_mtds_tracers"):
            setattr(ns, name, wrapper)
    return wrapper


def _peer_reader(kind: str):
    """args, kwargs -> the global rank of the peer / root, or ``(group rank,)``; None for other kinds."""
    position = _PEER_POSITION.get(kind)
    if position is None:
        return None

    def peer(args, kwargs):
        if len(args) > position and args[position] is not None:
            return args[position]
        if not kwargs:
            return None
        value = kwargs.get("dst", kwargs.get("src"))
        if value is not None:
            return value
        value = kwargs.get("group_dst", kwargs.get("group_src"))
        return None if value is None else (value,)
    return peer


def _wrap_tensor(kind: str, group_pos: int, payload_pos: int, original):
    """A collective whose payload is one of its arguments: the hot path."""
    sinks: list[dict] = []
    read_peer = _peer_reader(kind)
    Tensor = torch.Tensor

    @functools.wraps(original)
    def traced(*args, **kwargs):
        if not sinks:
            return original(*args, **kwargs)
        outer = getattr(_local, "inner", None)
        if outer is not None:
            result = original(*args, **kwargs)
            _add_to_outer(outer, kind, group_pos, payload_pos, args, kwargs)
            return result
        _local.inner = _NESTED
        start = _now()
        try:
            result = original(*args, **kwargs)
        finally:
            _local.inner = None
            clock.seconds += _now() - start
        payload = args[payload_pos] if len(args) > payload_pos else _argument(args, kwargs, None, _KWARG_NAMES)
        nbytes = payload.nbytes if isinstance(payload, Tensor) else _nbytes(payload)   # numel x element size
        group = args[group_pos] if len(args) > group_pos else kwargs.get("group")
        key = (kind, group, read_peer(args, kwargs) if read_peer else None)
        for counts in sinks:          # _count, inlined: this is the path every collective takes
            entry = counts.get(key)
            if entry is None:
                counts[key] = entry = [0, 0, 0]
            entry[0] += 1
            entry[1] += nbytes
        return result

    traced._mtds_tracers = sinks
    return traced


def _wrap_inner(kind: str, group_pos: int, payload_pos: None, original):
    """Object collectives and barrier: bytes and bus bytes are those of the calls they make."""
    sinks: list[dict] = []
    read_peer = _peer_reader(kind)

    @functools.wraps(original)
    def traced(*args, **kwargs):
        if not sinks:
            return original(*args, **kwargs)
        if getattr(_local, "inner", None) is not None:
            return original(*args, **kwargs)
        _local.inner = inner = [0, 0]
        start = _now()
        try:
            result = original(*args, **kwargs)
        finally:
            _local.inner = None
            clock.seconds += _now() - start
        group = _argument(args, kwargs, group_pos, ("group",))
        _count(sinks, (kind, group, read_peer(args, kwargs) if read_peer else None), inner[0], inner[1])
        return result

    traced._mtds_tracers = sinks
    return traced


def _wrap_batch(kind: str, group_pos: int, payload_pos: None, original):
    """``batch_isend_irecv``: one count per P2POp, as a send or a recv in its group."""
    sinks: list[dict] = []

    @functools.wraps(original)
    def traced(*args, **kwargs):
        if not sinks or getattr(_local, "inner", None) is not None:
            return original(*args, **kwargs)
        _local.inner = _NESTED
        try:
            result = original(*args, **kwargs)
        finally:
            _local.inner = None
        for op in _argument(args, kwargs, 0, ("p2p_op_list",)) or ():
            op_kind = "send" if getattr(op.op, "__name__", "") == "isend" else "recv"
            group_peer = getattr(op, "group_peer", None)
            peer = op.peer if op.peer is not None or group_peer is None else (group_peer,)
            _count(sinks, (op_kind, op.group, peer), _nbytes(op.tensor))
        return result

    traced._mtds_tracers = sinks
    return traced
