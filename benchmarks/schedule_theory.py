"""Theory Gantt charts and bubble table of the pipeline schedules (unit costs, simulated orders).

    python benchmarks/schedule_theory.py [--out docs/pipeline] [--p 4] [--m 4 8 16] [--v 2]

Writes one PNG per schedule at the first m, and prints a markdown table of the theoretical bubble
(idle / step time, and the papers' idle / compute) for every m. No processes, no GPUs."""
import argparse
import os

from lab.pipe_sim.theory import ALL_SCHEDULES, simulate_any, theory_bubble
from mtds.observe.timeline import events_from_simulation, write_gantt_png


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="docs/pipeline")
    ap.add_argument("--p", type=int, default=4)
    ap.add_argument("--v", type=int, default=2, help="chunks per rank of the interleaved schedule")
    ap.add_argument("--m", type=int, nargs="+", default=[4, 8, 16])
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    p = args.p
    print(f"| schedule | " + " | ".join(f"m={m}" for m in args.m) + " |")
    print("|---|" + "---|" * len(args.m))
    for name in ALL_SCHEDULES:
        v = args.v if name == "interleaved" else (2 if name == "dualpipev" else 1)
        cells = []
        for m in args.m:
            if name == "dualpipev" and m < 2 * p:
                cells.append("needs m ≥ 2p")
                continue
            t = theory_bubble(name, p, v, m)
            cells.append(f"{t['bubble_fraction']:.1%} ({t['bubble_ratio']:.3f})")
        print(f"| {name}{' v=' + str(v) if v > 1 else ''} | " + " | ".join(cells) + " |")
        m = args.m[0] if name != "dualpipev" else max(args.m[0], 2 * p)
        result = simulate_any(name, p, v, m)
        png = os.path.join(args.out, f"theory_{name}_p{p}_m{m}.png")
        write_gantt_png(events_from_simulation(result), png, time_label="cost units (F = 1)",
                        title=f"{name}{f' v={v}' if v > 1 else ''}, p={p}, m={m}: unit-cost simulation")
    print(f"\nGantt charts in {args.out}/")


if __name__ == "__main__":
    main()
