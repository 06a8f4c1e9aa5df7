"""One rank of a compare run: train.py's own CLI (mtds.training.cli.main), with a ``LoopProbe``
installed first so every collective — including ZeRO-3's parameter all-gathers, which DeepSpeed calls
through function references cached at start-up — is counted per step, then written per rank.

    torchrun --nproc_per_node N -m compare.entry PROBE_DIR <train.py arguments>
    deepspeed ... --module compare.entry PROBE_DIR <train.py arguments>
"""
from __future__ import annotations

import json
import os
import sys


def _link_counter(train_loop) -> list[dict]:
    """On an emulated cluster node (MTDS_LINK_DEVICE names the node's link): bytes the link sent and
    received during each step, read from the kernel counters around ``train_step`` at boundaries all
    ranks share (mtds.cluster.netns.boundary_link_stats). [] elsewhere."""
    device, per_step = os.environ.get("MTDS_LINK_DEVICE"), []
    if not device:
        return per_step
    import torch.distributed as dist

    from mtds.cluster.netns import boundary_link_stats
    train_step = train_loop.train_step

    def counted_train_step(*args, **kwargs):
        before = boundary_link_stats(device, dist.barrier)
        out = train_step(*args, **kwargs)
        after = boundary_link_stats(device, dist.barrier)
        per_step.append({**{k: after[k] - before[k] for k in ("tx_bytes", "rx_bytes")},
                         "tx_at_start": before["tx_bytes"], "tx_at_end": after["tx_bytes"]})
        return out

    train_loop.train_step = counted_train_step
    return per_step


def main() -> None:
    # The DeepSpeed launcher puts --local_rank=N first; train.py's parser takes it anywhere.
    local = [a for a in sys.argv[1:] if a.startswith("--local_rank")]
    rest = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    probe_dir, train_args = rest[0], rest[1:] + local
    from lab.measure import peak_rss_gib
    from lab.run_probe import LoopProbe
    from mtds.training import cli, job, train_loop

    from .state import StateProbe

    probe = LoopProbe(warmup=1, barrier=True).install()     # compare.table times steps from a barrier
    if os.environ.get("MTDS_RANKS_PER_NODE"):       # on an emulated cluster: split bytes by node
        probe.tracer.ranks_per_node = int(os.environ["MTDS_RANKS_PER_NODE"])
    link = _link_counter(train_loop)
    state = StateProbe()
    run = job.run

    def run_and_record(cfg, *, on_engine_ready=()):
        # cli.main imports job.run at call time, so it gets this wrapper
        result = run(cfg, on_engine_ready=(*on_engine_ready, lambda engine, groups: state.install(engine)))
        import torch.distributed as dist
        rank = dist.get_rank()
        os.makedirs(probe_dir, exist_ok=True)
        with open(os.path.join(probe_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"rank": rank, "world": dist.get_world_size(), "layout": result.layout,
                       "step_times_s": probe.step_times, "step_cpu_s": probe.step_cpu, "comm_per_step": probe.comm_per_step,
                       "parameters": probe.parameters, "peak_rss_gib": peak_rss_gib(),
                       "losses": result.losses, "link_per_step": link,
                       "model_state": state.peak}, f)
        return result

    job.run = run_and_record
    cli.main(train_args)


if __name__ == "__main__":
    main()
