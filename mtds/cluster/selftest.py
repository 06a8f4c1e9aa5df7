"""One all-reduce across the emulated cluster, with the node link's byte counters read around it.

Run on every node by the DeepSpeed launcher (``mtds-cluster selftest`` does that):

    deepspeed --hostfile H --no_ssh --node_rank i ... --module mtds.cluster.selftest OUT_DIR NUMEL [OP]

Each rank runs one collective OP (all_reduce [default], all_gather or reduce_scatter) on a full
tensor of NUMEL fp32 values (all-gather: NUMEL / world per rank); rank r contributes r + 1, so the
result is checked exactly. Local rank 0 of each node writes OUT_DIR/node<i>.json with what its
node's link sent and received during the collective (barriers before and after included: a few bytes).
"""
from __future__ import annotations

import json
import os
import sys
import time


def settled_link_stats(device: str, quiet_s: float = 0.05, limit_s: float = 2.0) -> dict[str, int]:
    """Counters once the link has been idle for `quiet_s`: a collective can return while its last
    bytes still wait in the shaping queue, which the counters only see when they are sent."""
    from mtds.cluster.netns import own_link_stats
    last, deadline = own_link_stats(device), time.monotonic() + limit_s
    while time.monotonic() < deadline:
        time.sleep(quiet_s)
        now = own_link_stats(device)
        if now["tx_bytes"] == last["tx_bytes"]:
            return now
        last = now
    return last


def main(argv: list[str] | None = None) -> None:
    argv = [a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("--local_rank")]
    out_dir, numel, op = argv[0], int(argv[1]), (argv[2] if len(argv) > 2 else "all_reduce")
    import torch
    import torch.distributed as dist

    from mtds.cluster.cluster import DEVICE
    from mtds.cluster.netns import boundary_link_stats
    from mtds.tp.mappings import all_gather_single, reduce_scatter_single
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    tensor = torch.full((numel,), float(rank + 1))
    shard = torch.empty(numel // world)
    before, start = boundary_link_stats(DEVICE, dist.barrier), time.perf_counter()
    if op == "all_reduce":
        dist.all_reduce(tensor)
        result, expected = tensor, torch.full((numel,), world * (world + 1) / 2)
    elif op == "all_gather":
        all_gather_single(tensor, torch.full((numel // world,), float(rank + 1)))
        result, expected = tensor, torch.arange(1, world + 1, dtype=torch.float).repeat_interleave(numel // world)
    elif op == "reduce_scatter":
        reduce_scatter_single(shard, tensor)
        result, expected = shard, torch.full((numel // world,), world * (world + 1) / 2)
    else:
        raise SystemExit(f"error: unknown op {op!r}: use all_reduce, all_gather or reduce_scatter")
    dist.barrier()
    elapsed, after = time.perf_counter() - start, settled_link_stats(DEVICE)
    correct = bool(torch.equal(result, expected))
    if local_rank == 0:
        node = rank // int(os.environ.get("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", 1)))
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, f"node{node}.json"), "w") as f:
            json.dump({"node": node, "world": world, "numel": numel, "op": op, "seconds": elapsed, "correct": correct,
                       **{k: after[k] - before[k] for k in after}}, f)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0 if correct else 1)   # os._exit: avoids gloo's random abort at exit


if __name__ == "__main__":
    main()
