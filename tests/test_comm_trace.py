"""The collective tracer on real gloo ranks with known tensors: calls, payload bytes, ring bus bytes
and group size per kind and group, exact; also through references cached before it started (as
DeepSpeed caches them), through ``distributed_c10d``, for batched p2p, coalesced and object
collectives; groups of one count nothing."""
import io
import pickle

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from mtds.comm_trace import CommTracer, bus_bytes
from tests.dist import spawn

OBJ = {"step": 7, "name": "mtds"}


def _pickled_size(obj) -> int:
    buffer = io.BytesIO()
    pickle.Pickler(buffer).dump(obj)     # what torch's object collectives send
    return len(buffer.getvalue())


def _trace_worker():
    rank = dist.get_rank()
    first = CommTracer().install()
    cached_all_reduce = dist.all_reduce          # what a library would keep a reference to
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    singles = [dist.new_group([r]) for r in range(4)]
    pair, single = pairs[rank // 2], singles[rank]
    first.name_group(pair, "pair")
    first.name_group(single, "single")
    x = torch.ones(10)                                             # 40 bytes
    dist.all_reduce(x, group=pair)
    dist.all_reduce(x, group=single)                               # a group of one: not counted
    dist.broadcast(x, src=0)
    out = torch.empty(40)
    dist.all_gather_into_tensor(out, x)
    c10d._all_gather_base(out, x)                                  # DeepSpeed's path; forwards internally
    dist.reduce_scatter_tensor(torch.empty(10), out)               # payload: the full 160-byte input
    if rank == 0:
        dist.send(torch.ones(3), dst=1)
    elif rank == 1:
        dist.recv(torch.empty(3), src=0)
    peer = rank ^ 1
    ops = [dist.P2POp(dist.isend, torch.ones(5), peer, group=pair),
           dist.P2POp(dist.irecv, torch.empty(5), peer, group=pair)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    dist.all_reduce_coalesced([torch.ones(5), torch.ones(3)], group=pair)
    gathered = [None] * 4
    dist.all_gather_object(gathered, OBJ)
    objects = [OBJ if rank == 0 else None]
    dist.broadcast_object_list(objects, src=0)
    first_summary, total, bus = first.summary(), first.total_bytes(), first.total_bus_bytes()
    first.uninstall()
    second = CommTracer().install()
    cached_all_reduce(torch.ones(4, dtype=torch.float64))
    second_summary = second.summary()
    second.uninstall()
    return first_summary, total, bus, second_summary, gathered == [OBJ] * 4 and objects == [OBJ]


def test_tracer_counts_kinds_groups_payload_and_bus_bytes():
    obj = 8 + _pickled_size(OBJ)    # one int64 size, then the pickled bytes
    for rank, (first, total, bus, second, objects_ok) in enumerate(spawn(_trace_worker, 4, timeout=120)):
        assert objects_ok
        p2p = {}
        if rank == 0:
            p2p = {"send/world": {"calls": 1, "bytes": 12, "bus_bytes": 12, "group_size": 4}}
        if rank == 1:
            p2p = {"recv/world": {"calls": 1, "bytes": 12, "bus_bytes": 12, "group_size": 4}}
        expected = {
            # pair: 40-byte all-reduce (2(n-1)/n = 1x at n = 2) + coalesced 5 + 3 floats
            "all_reduce/pair": {"calls": 2, "bytes": 72, "bus_bytes": 72, "group_size": 2},
            "broadcast/world": {"calls": 1, "bytes": 40, "bus_bytes": 40, "group_size": 4},
            # two all-gathers of a 40-byte shard into 160 bytes: (n-1)/n x 160 = 120 each
            "all_gather/world": {"calls": 2, "bytes": 80, "bus_bytes": 240, "group_size": 4},
            "reduce_scatter/world": {"calls": 1, "bytes": 160, "bus_bytes": 120, "group_size": 4},
            "send/pair": {"calls": 1, "bytes": 20, "bus_bytes": 20, "group_size": 2},
            "recv/pair": {"calls": 1, "bytes": 20, "bus_bytes": 20, "group_size": 2},
            "all_gather_object/world": {"calls": 1, "bytes": obj, "bus_bytes": 3 * obj, "group_size": 4},
            "broadcast_object_list/world": {"calls": 1, "bytes": obj, "bus_bytes": obj, "group_size": 4},
            **p2p,
        }
        assert first == expected, (rank, first)
        assert total == sum(v["bytes"] for v in expected.values())
        assert bus == sum(v["bus_bytes"] for v in expected.values())
        assert second == {"all_reduce/world": {"calls": 1, "bytes": 32, "bus_bytes": 48, "group_size": 4}}, second


def test_ring_bus_bytes_follow_the_ring_algorithms():
    # n = 8, a 1 MiB tensor: a ring all-reduce is a reduce-scatter then an all-gather, 7/8 each
    payload = 2 ** 20
    assert bus_bytes("all_reduce", payload, 8) == 2 * bus_bytes("reduce_scatter", payload, 8) == 7 * 2 ** 18
    assert bus_bytes("all_gather", payload // 8, 8) == bus_bytes("reduce_scatter", payload, 8)
    assert bus_bytes("send", 12, 2) == 12 and bus_bytes("all_reduce", payload, 1) == 0
