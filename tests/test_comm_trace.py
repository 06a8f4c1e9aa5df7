"""The collective tracer on real gloo ranks with known tensors: calls, payload bytes, ring bus bytes
and group size per kind and group, exact; also through references cached before it started (as
DeepSpeed caches them), through ``distributed_c10d``, for batched p2p, coalesced and object
collectives; groups of one count nothing.

In the same 4-rank launch, ``mtds.parallel.dp_reduce.reduce_scatter_sum``: each rank ends with exactly the sum of
its partition, in buckets smaller than a partition, and puts the ring minimum on its link -- (d-1)/d of
the buffer, every byte to the next rank of its group (the tracer's placement), half an all-reduce's;
filled window by window, it allocates no tensor larger than its bucket."""
import functools
import io
import pickle

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from mtds.observe.comm_trace import CommTracer, bus_bytes
from mtds.parallel.dp_reduce import reduce_scatter_sum, split_by_spans
from tests.alloc_watch import LargestAllocation
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


def _both_workers():
    return _trace_worker(), _reduce_scatter_worker()


@functools.lru_cache(maxsize=1)
def four_ranks():
    """One 4-rank launch for the tracer's checks and the reduce-scatter's."""
    return spawn(_both_workers, 4, timeout=120)


def test_tracer_counts_kinds_groups_payload_and_bus_bytes():
    obj = 8 + _pickled_size(OBJ)    # one int64 size, then the pickled bytes
    for rank, ((first, total, bus, second, objects_ok), _) in enumerate(four_ranks()):
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


P = 10    # elements per partition; windows of 4: 4 + 4 + 2


def _reduce_scatter_worker():
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]       # two rings of 2 beside the ring of 4
    results = {}
    for name, group in (("world", dist.group.WORLD), ("pair", groups[rank % 2])):
        d, r = dist.get_world_size(group), dist.get_rank(group)
        # integers in float32: every summation order gives the same exact sum
        flat = torch.arange(d * P, dtype=torch.float32) * (rank + 1) + 1000 * rank
        out = torch.full((P,), float("nan"))
        tracer = CommTracer(ranks_per_node=2).install()
        tracer.name_group(group, "dp")
        reduce_scatter_sum(flat, out, group, bucket_elements=4 * (d + 1))
        summary = tracer.summary()      # the whole reduction only
        tracer.uninstall()
        members = dist.get_process_group_ranks(group) if name == "pair" else list(range(world))
        want = sum(torch.arange(d * P, dtype=torch.float32)[r * P:(r + 1) * P] * (m + 1) + 1000 * m for m in members)
        # in two parts, as a pipeline stage reduces: outside a span first (here it crosses partitions
        # 0 and 1 and leaves partition 1 with a range on each side), then inside it
        outside, inside = split_by_spans([(3, 17)], d, P)
        parts = torch.full((P,), float("nan"))
        for ranges in (outside, inside):
            reduce_scatter_sum(flat, parts, group, bucket_elements=4 * (d + 1), ranges=ranges)
        # from a fill (no flat buffer), in buckets of 2 (d + 1) elements: never a larger tensor
        bucketed = torch.full((P,), float("nan"))
        with LargestAllocation() as watch:
            reduce_scatter_sum(lambda c, offset, dest: dest.copy_(flat[c * P + offset:][:dest.numel()]),
                               bucketed, group, bucket_elements=2 * (d + 1))
        exact = torch.equal(out, want) and torch.equal(parts, want) and torch.equal(bucketed, want)
        results[name] = (exact, summary, d, watch.elements)
    return results


def test_split_by_spans():
    outside, inside = split_by_spans([(3, 17), (38, 40)], 4, 10)
    assert inside == [[(3, 7)], [(0, 7)], [], [(8, 2)]]
    assert outside == [[(0, 3)], [(7, 3)], [(0, 10)], [(0, 8)]]
    assert split_by_spans([], 2, 5) == ([[(0, 5)], [(0, 5)]], [[], []])


def test_ring_reduce_scatter_sums_each_partition_at_the_ring_minimum():
    for rank, (_, results) in enumerate(four_ranks()):
        for name, (exact, summary, d, largest) in results.items():
            assert exact, (rank, name)
            assert 0 < largest <= 2 * (d + 1), (rank, name, largest)     # one bucket of scratch at most
            label = "dp" if name == "pair" else "world"
            sent = {k: v for k, v in summary.items() if k.startswith("send/")}
            assert list(sent) == [f"send/{label}"], (rank, name, summary)
            stats = sent[f"send/{label}"]
            # (d-1) steps x 3 buckets, each step one partial window: (d-1)/d of d*P floats in all
            assert stats["calls"] == (d - 1) * 3 and stats["bus_bytes"] == (d - 1) * P * 4, (rank, name, stats)
            assert sum(v["bus_bytes"] for k, v in summary.items() if k.startswith("recv/")) == (d - 1) * P * 4
            # every byte to the ring neighbour: ranks 0,1 on node 0, 2,3 on node 1; ring 0-1-2-3 crosses
            # nodes at 1->2 and 3->0; the pairs {0,2}, {1,3} always cross
            crosses = name == "pair" or rank in (1, 3)
            assert (stats["inter_bytes"], stats["intra_bytes"]) == \
                (((d - 1) * P * 4, 0) if crosses else (0, (d - 1) * P * 4)), (rank, name, stats)
