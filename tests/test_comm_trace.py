"""The collective tracer: calls and payload bytes per kind and group, also through references cached
before it started (as DeepSpeed caches them)."""
import torch
import torch.distributed as dist

from mtds.comm_trace import CommTracer
from tests.dist import spawn


def _trace_worker():
    first = CommTracer().install()
    cached_all_reduce = dist.all_reduce          # what a library would keep a reference to
    group = dist.new_group([0, 1])
    first.name_group(group, "pair")
    x = torch.ones(10)
    dist.all_reduce(x, group=group)
    dist.broadcast(x, src=0)
    out = torch.empty(20)
    dist.all_gather_into_tensor(out, x)
    dist.reduce_scatter_tensor(torch.empty(5), out[:10])
    if dist.get_rank() == 0:
        dist.send(torch.ones(3), dst=1)
    else:
        dist.recv(torch.empty(3), src=0)
    first_summary = first.summary()
    first.uninstall()
    second = CommTracer().install()
    cached_all_reduce(torch.ones(4, dtype=torch.float64))
    second_summary = second.summary()
    second.uninstall()
    return first_summary, second_summary


def test_tracer_counts_kinds_groups_and_bytes():
    for rank, (first, second) in enumerate(spawn(_trace_worker, 2, timeout=120)):
        p2p = {"send/world": {"calls": 1, "bytes": 12}} if rank == 0 else {"recv/world": {"calls": 1, "bytes": 12}}
        assert first == {"all_reduce/pair": {"calls": 1, "bytes": 40}, "broadcast/world": {"calls": 1, "bytes": 40},
                         "all_gather/world": {"calls": 1, "bytes": 40},
                         "reduce_scatter/world": {"calls": 1, "bytes": 40}, **p2p}, first
        assert second == {"all_reduce/world": {"calls": 1, "bytes": 32}}, second
