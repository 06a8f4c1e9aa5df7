"""``mtds.dp_reduce.reduce_scatter_sum`` on real gloo ranks: each rank ends with exactly the sum of its
partition, in buckets smaller than a partition, and puts the ring minimum on its link -- (d-1)/d of the
buffer, every byte to the next rank of its group (the tracer's placement), half an all-reduce's bytes."""
import torch
import torch.distributed as dist

from mtds.comm_trace import CommTracer
from mtds.dp_reduce import reduce_scatter_sum, split_by_spans
from tests.dist import spawn

P = 10    # elements per partition; buckets of 4: windows 4 + 4 + 2


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
        reduce_scatter_sum(flat.clone(), out, group, bucket_elements=4)
        summary = tracer.summary()      # the whole reduction only
        tracer.uninstall()
        members = dist.get_process_group_ranks(group) if name == "pair" else list(range(world))
        want = sum(torch.arange(d * P, dtype=torch.float32)[r * P:(r + 1) * P] * (m + 1) + 1000 * m for m in members)
        # in two parts, as a pipeline stage reduces: outside a span first (here it crosses partitions
        # 0 and 1 and leaves partition 1 with a range on each side), then inside it
        outside, inside = split_by_spans([(3, 17)], d, P)
        parts = torch.full((P,), float("nan"))
        for ranges in (outside, inside):
            reduce_scatter_sum(flat.clone(), parts, group, bucket_elements=4, ranges=ranges)
        results[name] = (torch.equal(out, want) and torch.equal(parts, want), summary, d)
    return results


def test_split_by_spans():
    outside, inside = split_by_spans([(3, 17), (38, 40)], 4, 10)
    assert inside == [[(3, 7)], [(0, 7)], [], [(8, 2)]]
    assert outside == [[(0, 3)], [(7, 3)], [(0, 10)], [(0, 8)]]
    assert split_by_spans([], 2, 5) == ([[(0, 5)], [(0, 5)]], [[], []])


def test_ring_reduce_scatter_sums_each_partition_at_the_ring_minimum():
    for rank, results in enumerate(spawn(_reduce_scatter_worker, 4, timeout=120)):
        for name, (exact, summary, d) in results.items():
            assert exact, (rank, name)
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
