"""``python -m lab.faults --tries 10``: kill -9 tries during training and during saves; prints counts."""
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
    args = p.parse_args(argv)
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


if __name__ == "__main__":
    sys.exit(main())
