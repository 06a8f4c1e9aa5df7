"""The spread behind the suite's 16-bit bounds: run the test files that hold bounds named with
``tests.bounds.within`` under three sets of CPU kernels, and print each bound against the values measured.

    python -m lab.bounds_audit [--isa native avx2 default] [--out runs/bounds] [-k EXPR] [test files ...]

Kernels: ``native`` as the machine has them; ``avx2`` PyTorch, oneDNN and MKL held to AVX2 (no AVX-512, no bf16
instructions: the slowest machine of our kind); ``default`` PyTorch's unvectorised kernels, oneDNN held to SSE4.1.
The switches are the libraries' own environment variables (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA,
MKL_ENABLE_INSTRUCTIONS), read when a process imports them, so every rank the suite starts runs under them. A
bound should sit well above the largest value of every kernel set and below what its mutations move it to
(each test's comment says what a mutation gives). Besides the bounds (``within``: the largest value counts) the
table holds the floors (``beyond``: a difference that must be there, the smallest value counts) and the claims of
bit-equality (``same``: 0 where equal, else the largest relative difference seen)."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict

KERNELS = {
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "default": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
}
# the files holding named bounds, floors and claims of bit-equality (grep -lE "within\(|beyond\(|same\(" tests/;
# tests/training_helpers.py's are reached through test_pipe_parity and test_pipe_matrix)
FILES = ("tests/test_moe.py", "tests/test_moe_checkpoint.py", "tests/test_reshard.py", "tests/test_pipe_parity.py",
         "tests/test_pipe_matrix.py", "tests/test_context_parallel.py", "tests/test_training_features.py",
         "tests/test_fused_cross_entropy.py", "tests/test_cross_entropy_16bit.py", "tests/test_bf16_flat.py",
         "tests/test_zero2_pipeline.py")


def run(isa: str, files, out: str, extra: list[str]) -> str:
    log = os.path.join(out, f"{isa}.jsonl")
    if os.path.exists(log):
        os.remove(log)
    env = {**os.environ, **KERNELS[isa], "MTDS_BOUNDS_LOG": os.path.abspath(log), "OMP_NUM_THREADS": "1"}
    if KERNELS[isa]:    # Inductor's FX graph cache key leaves the ISA out: a cache per ISA (scripts/slow-machine)
        env["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(os.environ.get("TMPDIR", "/tmp"), "torchinductor-audit", isa)
    start = time.monotonic()
    code = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra, *files], env=env)
    print(f"{isa}: pytest exit {code} in {time.monotonic() - start:.0f} s", flush=True)
    return log


def table(logs: dict[str, str]) -> str:
    """One row per name: per kernel set the largest value of a bound (``within``), the smallest of a floor
    (``beyond``), the largest difference of a claim of bit-equality (``same``); then across the sets that value, what
    it is held to and the room (bound / largest, smallest / floor)."""
    values: dict[str, dict[str, float]] = defaultdict(dict)
    bounds: dict[str, float] = {}
    kinds: dict[str, str] = {}
    for isa, log in logs.items():
        if not os.path.exists(log):
            continue
        for line in open(log):
            r = json.loads(line)
            name, kind = r["name"], r.get("kind", "below")
            pick = min if kind == "above" else max
            got = values[name]
            got[isa] = pick(got[isa], r["value"]) if isa in got else r["value"]
            bounds[name], kinds[name] = r["bound"], kind
    isas = list(logs)
    rows = ["| bound | " + " | ".join(isas) + " | worst | held to | room |", "|---" * (len(isas) + 4) + "|"]
    for name in sorted(values):
        got, kind, bound = values[name], kinds[name], bounds[name]
        cells = " | ".join(f"{got[i]:.2g}" if i in got else "–" for i in isas)
        if kind == "above":
            worst = min(got.values())
            held, room = f"> {bound:.2g}", f"{worst / bound:.1f}x" if bound > 0 else "–"
        elif kind == "exact":
            worst = max(got.values())
            held, room = "equal", "equal" if worst == 0 else "NOT EQUAL"
        else:
            worst = max(got.values())
            held, room = f"< {bound:.2g}", f"{bound / worst:.0f}x" if worst > 0 else "exact"
        rows.append(f"| `{name}` | {cells} | {worst:.2g} | {held} | {room} |")
    return "\n".join(rows)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--isa", nargs="+", default=list(KERNELS), choices=list(KERNELS))
    ap.add_argument("--out", default="runs/bounds", help="one JSON-lines file per kernel set [runs/bounds]")
    ap.add_argument("--table-only", action="store_true", help="print the table of the logs in --out, run nothing")
    ap.add_argument("-k", dest="keyword", help="pytest's -k: only the tests whose names match")
    ap.add_argument("files", nargs="*", default=list(FILES))
    args, extra = ap.parse_known_args(argv)
    if args.keyword:
        extra = ["-k", args.keyword, *extra]
    os.makedirs(args.out, exist_ok=True)
    logs = {isa: os.path.join(args.out, f"{isa}.jsonl") for isa in args.isa}
    if not args.table_only:
        logs = {isa: run(isa, args.files, args.out, extra) for isa in args.isa}
    print(table(logs))


if __name__ == "__main__":
    main()
