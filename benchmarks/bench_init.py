"""Per-shard initialisation vs the full fill it replaces: time and peak RSS of building one TP rank's
shard of a large weight. Each case runs in its own process so peak RSS is that case's alone.

    python benchmarks/bench_init.py [--rows 32768 --cols 8192 --tp 8]

Peak RSS is ru_maxrss after the case minus before (Linux: KiB); the full fill holds rows*cols*4 bytes,
the shard path one shard (rows*cols*4/tp) plus one chunk (mtds.tp.init_shard.DEFAULT_CHUNK_ELEMENTS*4).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

_CASE = r"""
import json, resource, sys, time, torch
from mtds.tp.init_shard import NormalInit, build_shard
from mtds.tp import shard_rows
rows, cols, tp, dim, how = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
torch.manual_seed(0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.perf_counter()
if how == "full":
    full = torch.empty(rows, cols)
    NormalInit(0.02)(full)
    shard = shard_rows(full, dim, tp, tp // 2)
    del full
else:
    shard = build_shard((rows, cols), dim, tp, tp // 2, NormalInit(0.02))
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "rss_gib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 2**20,
                  "sum": float(shard.double().sum())}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4 * 8192)
    parser.add_argument("--cols", type=int, default=8192)
    parser.add_argument("--tp", type=int, default=8)
    args = parser.parse_args()
    print(f"weight [{args.rows}, {args.cols}] fp32 ({args.rows * args.cols * 4 / 2**30:.2f} GiB), shard of rank "
          f"{args.tp // 2} of {args.tp}")
    print("| split | path | seconds | peak RSS added (GiB) |\n|---|---|---:|---:|")
    for dim, name in ((0, "column-parallel (dim 0)"), (1, "row-parallel (dim 1)")):
        sums = set()
        for how in ("full", "shard"):
            out = subprocess.run([sys.executable, "-c", _CASE, str(args.rows), str(args.cols), str(args.tp), str(dim),
                                  how], capture_output=True, text=True, check=True, env={"OMP_NUM_THREADS": "1"})
            result = json.loads(out.stdout.strip().splitlines()[-1])
            sums.add(result["sum"])
            print(f"| {name} | {how} | {result['seconds']:.2f} | {result['rss_gib']:.2f} |")
        if len(sums) != 1:
            raise SystemExit(f"error: the shard differs from the full fill's slice for dim {dim}")


if __name__ == "__main__":
    main()
