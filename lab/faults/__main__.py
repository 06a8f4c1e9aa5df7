"""``python -m lab.faults --tries 10``: kill -9 tries during training and during saves; prints counts.
``python -m lab.faults --restarts 3 --tries 3``: runs under ``torchrun --max-restarts``, each with that many faults
(kill -9 in training, kill -9 during a background save, SIGSTOP; random ranks and steps), checked against an
uninterrupted run, with each fault's time to the next trained step and its parts."""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile

from lab.faults.harness import EXIT_BOUND_S, run_try


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.faults", description=__doc__)
    p.add_argument("--tries", type=int, default=10, help="tries per mode [10]")
    p.add_argument("--modes", nargs="+", default=["train", "save"], choices=["train", "save"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", action="store_true", help="keep the work folders (printed) for inspection")
    p.add_argument("--restarts", type=int, default=0, metavar="K",
                   help="instead: runs under torchrun --max-restarts K with K random faults each")
    args = p.parse_args(argv)
    if args.restarts:
        return restart_tries(args)
    failures = 0
    for mode in args.modes:
        counts = {"tries": 0, "slow_exit": 0, "rank_not_named": 0, "corrupt_loads": 0, "lost_complete": 0}
        worst = 0.0
        for i in range(args.tries):
            work = tempfile.mkdtemp(prefix=f"mtds-fault-{mode}-{i}-")
            r = run_try(work, args.seed * 1000 + i + (500 if mode == "save" else 0), mode)
            counts["tries"] += 1
            counts["slow_exit"] += r.exit_s >= EXIT_BOUND_S
            counts["rank_not_named"] += not r.launcher_named_rank
            counts["corrupt_loads"] += r.corrupt_load
            counts["lost_complete"] += bool(r.lost_complete)
            worst = max(worst, r.exit_s)
            print(json.dumps({"mode": mode, "try": i, "layout": r.layout, "killed_rank": r.killed_rank,
                              "after_step": r.killed_at_step, "exit_s": round(r.exit_s, 1),
                              "complete": r.complete_after_kill[-3:], "resumed": r.resumed_step, "ok": r.ok,
                              **({"work": work} if args.keep or not r.ok else {})}), flush=True)
            if r.ok and not args.keep:
                shutil.rmtree(work, ignore_errors=True)
            failures += not r.ok
        print(f"{mode}: {counts['tries']} kill -9 tries; survivors gone within {EXIT_BOUND_S:.0f} s: "
              f"{counts['tries'] - counts['slow_exit']} (slowest {worst:.1f} s); dead rank named: "
              f"{counts['tries'] - counts['rank_not_named']}; corrupt loads: {counts['corrupt_loads']}; "
              f"lost complete checkpoints: {counts['lost_complete']}", flush=True)
    return 1 if failures else 0


def restart_tries(args) -> int:
    import random
    import statistics

    from lab.faults.restarts import KINDS, reference, run_with_faults
    failures, parts = 0, {}
    for i in range(args.tries):
        work = tempfile.mkdtemp(prefix=f"mtds-fault-restarts-{i}-")
        rng = random.Random(args.seed * 1000 + i)
        kinds = [rng.choice(KINDS) for _ in range(args.restarts)]
        run = run_with_faults(work, args.seed * 1000 + i, kinds, steps=6 + 3 * args.restarts,
                              max_restarts=args.restarts)
        equal = run.returncode == 0 and run.steps == reference(work, 6 + 3 * args.restarts)
        ok = equal and len(run.error_lines) == args.restarts
        failures += not ok
        for f in run.faults:
            for name, value in f.parts.items():
                parts.setdefault((f.kind, name), []).append(value)
        print(json.dumps({"try": i, "rc": run.returncode, "final_losses_equal": equal, "ok": ok,
                          "faults": [{"kind": f.kind, "rank": f.rank, "after_step": f.after_step, "named": f.named,
                                      **{k: round(v, 2) for k, v in f.parts.items()}} for f in run.faults],
                          **({"work": work} if args.keep or not ok else {})}), flush=True)
        if ok and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    for (kind, name), values in sorted(parts.items()):
        print(f"{kind:9s} {name:8s} median {statistics.median(values):6.2f} s  max {max(values):6.2f} s  "
              f"(n={len(values)}, seconds since the fault)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
