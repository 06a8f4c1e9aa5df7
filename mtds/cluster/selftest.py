"""One all-reduce across the emulated cluster, with the node link's byte counters read around it.

Run on every node by the DeepSpeed launcher (``mtds-cluster selftest`` does that):

    deepspeed --hostfile H --no_ssh --node_rank i ... --module mtds.cluster.selftest OUT_DIR NUMEL

Each rank all-reduces NUMEL fp32 values (rank r contributes r + 1, so every element must equal
world (world + 1) / 2); local rank 0 of each node writes OUT_DIR/node<i>.json with what its node's
link sent and received during the all-reduce (barriers before and after, included: a few bytes).
"""
from __future__ import annotations

import json
import os
import sys
import time


def main(argv: list[str] | None = None) -> None:
    argv = [a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("--local_rank")]
    out_dir, numel = argv[0], int(argv[1])
    import torch
    import torch.distributed as dist

    from .cluster import DEVICE
    from .netns import own_link_stats
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    tensor = torch.full((numel,), float(rank + 1))
    dist.barrier()
    before, start = own_link_stats(DEVICE), time.perf_counter()
    dist.all_reduce(tensor)
    dist.barrier()
    elapsed, after = time.perf_counter() - start, own_link_stats(DEVICE)
    expected = world * (world + 1) / 2
    if local_rank == 0:
        node = rank // int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", 1)))
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, f"node{node}.json"), "w") as f:
            json.dump({"node": node, "world": world, "numel": numel, "seconds": elapsed,
                       "correct": bool(torch.all(tensor == expected)),
                       **{k: after[k] - before[k] for k in after}}, f)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0 if torch.all(tensor == expected) else 1)   # os._exit: avoids gloo's random abort at exit


if __name__ == "__main__":
    main()
