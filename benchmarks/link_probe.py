#!/usr/bin/env python
"""How much of a shaped inter-node link each transfer pattern gets (issue 22's 30mbit question): the same
bytes as a gloo all-reduce, as mtds's ring reduce-scatter over point-to-point messages (mtds.parallel.dp_reduce,
ZeRO-1's gradient path on gloo) once and twice back to back, and as cross-node send/recv pairs in one
piece or in 128 KiB pieces (pipeline-activation sized). Best of ``PROBE_REPS`` timed repetitions each;
the first rank of each node reads its interface's transmit counter, so efficiency = bytes sent / time /
nominal rate is computed from what the link carried, not from a formula.

    mtds-cluster run --nodes 2 --ranks-per-node 2 --inter-node 30mbit -- benchmarks/link_probe.py
    PROBE_MB=16 mtds-cluster run ... -- benchmarks/link_probe.py      # larger transfers

Each node's log (runs/cluster/node*.log) holds one ``PROBE`` line of JSON: seconds and bytes per pattern.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SMALL = 32768          # elements of one small piece: 128 KiB of fp32


def tx_bytes(device: str = "eth0") -> int:
    """Bytes the interface has sent (-1 where there is no such interface, as outside the cluster)."""
    try:
        with open(f"/sys/class/net/{device}/statistics/tx_bytes") as f:
            return int(f.read())
    except OSError:
        return -1


def probe(megabytes: float, reps: int) -> dict:
    """{pattern: {"s": best seconds, "tx": this node's bytes sent in that repetition}} on the default group."""
    from mtds.parallel.dp_reduce import _Ring
    r, w = dist.get_rank(), dist.get_world_size()
    n = max(int(megabytes * 2 ** 20) // 4 // (2 * SMALL) * (2 * SMALL), 2 * SMALL * w)
    buf = torch.ones(n)
    ring = _Ring(dist.group.WORLD)
    pieces = list(torch.ones(n).chunk(w))
    spare = torch.empty(pieces[0].numel())
    peer = (r + w // 2) % w                    # the same local rank on the other node (2 nodes)
    half, half_in = torch.ones(n // 2), torch.empty(n // 2)
    small, small_in = torch.ones(SMALL), torch.empty(SMALL)

    def exchange(out, into):
        for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, out, peer), dist.P2POp(dist.irecv, into, peer)]):
            work.wait()

    def ring_rs():
        ring.reduce_scatter([p.clone() for p in pieces], spare)

    patterns = {
        "allreduce": lambda: dist.all_reduce(buf),
        "ring_rs": ring_rs,
        "ring_rs_x2": lambda: (ring_rs(), ring_rs()),
        "pairs": lambda: exchange(half, half_in),
        "pairs_small": lambda: [exchange(small, small_in) for _ in range((n // 2) // SMALL)],
    }
    out = {}
    for name, fn in patterns.items():
        fn()                                   # warm: connections up, buffers allocated
        best = None
        for _ in range(reps):
            dist.barrier()
            t0, b0 = time.perf_counter(), tx_bytes()
            fn()
            dist.barrier()
            took, sent = time.perf_counter() - t0, tx_bytes() - b0
            if best is None or took < best[0]:
                best = (took, sent)
        out[name] = {"s": best[0], "tx": best[1]}
    return out


def main() -> None:
    dist.init_process_group("gloo")
    result = probe(float(os.environ.get("PROBE_MB", "4")), int(os.environ.get("PROBE_REPS", "3")))
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        print("PROBE", dist.get_rank(), json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
