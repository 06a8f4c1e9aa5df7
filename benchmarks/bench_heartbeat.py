"""Store load of the heartbeat at a simulated world size (threads as ranks, real TCPStore clients, no
training): keys read per rank per beat, on the whole store per beat, against watching every rank.

    python benchmarks/bench_heartbeat.py [--world 8 64 512]
"""
import argparse

from lab.heartbeat_load import measure


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, nargs="+", default=[8, 64, 512])
    args = ap.parse_args()
    print("| ranks | keys read / rank / beat | store keys / beat | watching every rank: keys / beat | "
          "round of all beats (s) |")
    print("|---:|---:|---:|---:|---:|")
    for world in args.world:
        m = measure(world)
        print(f"| {world} | {m['keys_read_per_rank_per_beat']:.2f} | {m['store_keys_read_per_beat']:,.0f} | "
              f"{m['all_ranks_formula_keys_per_beat']:,} | {m['round_s']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
