"""One rank of a compare run: train.py's own CLI (mtds.training.cli.main), with a ``LoopProbe``
installed first so every collective — including ZeRO-3's parameter all-gathers, which DeepSpeed calls
through function references cached at start-up — is counted per step, then written per rank.

    torchrun --nproc_per_node N -m compare.entry PROBE_DIR <train.py arguments>
"""
from __future__ import annotations

import json
import os
import sys


def main() -> None:
    probe_dir, train_args = sys.argv[1], sys.argv[2:]
    from benchmarks.measure import peak_rss_gib
    from benchmarks.probe import LoopProbe
    from mtds.training import cli, loop

    probe = LoopProbe(warmup=1).install()
    run = loop.run

    def run_and_record(cfg):
        result = run(cfg)          # cli.main imports loop.run at call time, so it gets this wrapper
        import torch.distributed as dist
        rank = dist.get_rank()
        os.makedirs(probe_dir, exist_ok=True)
        with open(os.path.join(probe_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"rank": rank, "world": dist.get_world_size(), "layout": result.layout,
                       "step_times_s": probe.step_times, "comm_per_step": probe.comm_per_step,
                       "parameters": probe.parameters, "peak_rss_gib": peak_rss_gib(),
                       "losses": result.losses}, f)
        return result

    loop.run = run_and_record
    cli.main(train_args)


if __name__ == "__main__":
    main()
