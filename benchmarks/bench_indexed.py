"""Indexed-data numbers for docs/data.md (a benchmark, not a test).

  python benchmarks/bench_indexed.py preprocess --mb 25 100 --workers 1 2   # tokens/s, peak RSS vs corpus size
  python benchmarks/bench_indexed.py big --gb 28                            # a dataset larger than RAM
  python benchmarks/bench_indexed.py blend                                  # shares, epochs, dp=1 vs dp=2
  python benchmarks/bench_indexed.py layouts                                # (1,1,1) vs (2,2,2) on real ranks

`preprocess` writes jsonl corpora of the given sizes (lines of the shipped corpus in a seeded order,
14 lines per document) and runs mtds-preprocess on each; `big` writes random token ids straight
into PREFIX.bin/.idx, times start-up (index + sample indices) and reading, and deletes the files.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _corpus(path: str, megabytes: float) -> int:
    from mtds.data import SHIPPED_CORPUS
    lines = []
    for name in sorted(os.listdir(SHIPPED_CORPUS)):
        if name.endswith(".txt"):
            lines += open(os.path.join(SHIPPED_CORPUS, name), encoding="utf-8").read().splitlines()
    rng, written, docs = np.random.default_rng(0), 0, 0
    with open(path, "w") as f:
        while written < megabytes * 1e6:
            start = rng.integers(0, len(lines) - 14, size=4096)
            for s in start:
                line = json.dumps({"text": "\n".join(lines[s:s + 14])}) + "\n"
                f.write(line)
                written += len(line)
                docs += 1
    return docs


def preprocess(args) -> None:
    work = tempfile.mkdtemp(prefix="bench-pp-", dir=args.dir)
    try:
        for mb in args.mb:
            corpus = os.path.join(work, f"c{mb}.jsonl")
            docs = _corpus(corpus, mb)
            for workers in args.workers:
                out = os.path.join(work, f"o{mb}w{workers}")
                load_before = os.getloadavg()[0]
                t = time.perf_counter()
                child = subprocess.Popen([sys.executable, "-m", "mtds.cli.preprocess", "--input", corpus,
                                          "--output-prefix", out, "--workers", str(workers), "--no-progress",
                                          "--append-eod"], stdout=subprocess.PIPE, text=True)
                main_peak, worker_peak = _poll_peaks(child)
                wall = time.perf_counter() - t
                stdout = child.stdout.read()
                tokens = int(re.search(r"([\d,]+) tokens \(", stdout).group(1).replace(",", ""))
                # The machine is shared: the 1-minute load average before and after each run.
                load = f"{load_before:.1f}-{os.getloadavg()[0]:.1f}"
                print(f"| {mb:.0f} MB ({docs:,} docs, {tokens / 1e6:.1f} M tokens) | {workers} | {wall:.1f} | "
                      f"{tokens / wall:,.0f} | {main_peak:.0f} | "
                      f"{f'{worker_peak:.0f}' if workers > 1 else '-'} | {load} |", flush=True)
                for ext in (".bin", ".idx"):
                    os.remove(out + "_text_document" + ext)
            os.remove(corpus)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _status(pid, key: str) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) / 1024
    except (OSError, StopIteration):
        return 0.0


def _poll_peaks(child):
    """Peak RSS (VmHWM, the process's own) of a child and of the largest of its children, polled
    until it exits (ru_maxrss would start at the parent's RSS at fork)."""
    main = workers = 0.0
    while child.poll() is None:
        main = max(main, _status(child.pid, "VmHWM"))
        try:
            with open(f"/proc/{child.pid}/task/{child.pid}/children") as f:
                kids = f.read().split()
        except OSError:
            kids = []
        for kid in kids:
            workers = max(workers, _status(kid, "VmHWM"))
        time.sleep(0.2)
    return main, workers


def _rss_mib(kind: str = "VmRSS") -> float:
    """VmRSS, or RssAnon (memory the process allocated) / RssFile (mapped page cache: the .bin's
    pages read so far, shared and reclaimable)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(kind + ":")) / 1024


def _read_rate(ds, seq: int, n: int = 4000) -> float:
    from mtds.data import MicroBatchStream
    stream = MicroBatchStream(ds, global_batch_size=16, micro_batch_size=16, shuffle=False)
    t = time.perf_counter()
    for _ in range(n // 16):
        next(stream)
    return n * seq / (time.perf_counter() - t)


def big(args) -> None:
    from mtds.data.indexed import IndexedWriter
    from mtds.data.indexed.blended_dataset import build_blended
    work = tempfile.mkdtemp(prefix="bench-big-", dir=args.dir)
    try:
        prefix, rng = os.path.join(work, "random"), np.random.default_rng(0)
        tokens = int(args.gb * 1e9 / 2)
        t = time.perf_counter()
        with IndexedWriter(prefix, np.uint16) as w:
            done = 0
            while done < tokens:
                lengths = rng.integers(200, 4000, size=25_000)
                flat = rng.integers(0, 8192, size=int(lengths.sum()), dtype=np.uint16)
                w.add_documents(flat, lengths)
                done += len(flat)
        print(f"wrote {args.gb:.1f} GB ({done / 1e9:.2f} B tokens, {w.num_documents:,} documents) in "
              f"{time.perf_counter() - t:.0f} s; RSS {_rss_mib():.0f} MiB", flush=True)
        small = os.path.join(work, "small")
        with IndexedWriter(small, np.uint16) as w:
            lengths = rng.integers(200, 4000, size=2000)
            w.add_documents(rng.integers(0, 8192, size=int(lengths.sum()), dtype=np.uint16), lengths)
        for name, p in (("big", prefix), ("small", small)):
            for attempt in ("cold", "cached"):
                before = _rss_mib()
                t = time.perf_counter()
                ds = build_blended([(1.0, p)], seq_length=args.seq, num_samples=args.samples, seed=1,
                                   builder=True, cache_dir=os.path.join(work, "cache"), log=lambda _: None)
                start_up = time.perf_counter() - t
                print(f"{name} ({attempt} indices): start-up {start_up:.2f} s, RSS {before:.0f} -> "
                      f"{_rss_mib():.0f} MiB ({_rss_mib('RssAnon'):.0f} anonymous)", flush=True)
            if args.train_steps:   # first: a child's ru_maxrss starts at its parent's RSS at fork
                _train(name, p, args.train_steps, work)
            rate = _read_rate(ds, args.seq)
            print(f"{name}: reads {rate:,.0f} tokens/s into micro-batches; RSS {_rss_mib():.0f} MiB = "
                  f"{_rss_mib('RssAnon'):.0f} anonymous + {_rss_mib('RssFile'):.0f} mapped file pages", flush=True)
            del ds
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _train(name: str, prefix: str, steps: int, work: str) -> None:
    """train.py on one rank (gpt2-tiny, seq 128): start-up to the first step, tokens/s, peak RSS."""
    log = os.path.join(work, f"{name}.jsonl")
    t = time.perf_counter()
    child = subprocess.Popen([sys.executable, "train.py", "--deepspeed_config", "ds_configs/cpu_fp32.json",
                              "--steps", str(steps), "--data-path", prefix, "--eval-split", "0", "--no-progress",
                              "--log-jsonl", log], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True, env=dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0",
                                                 MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000)))
    # The child's own peaks from /proc (its ru_maxrss would start at this process's RSS at fork).
    peak = {"VmHWM": 0.0, "RssAnon": 0.0}
    while child.poll() is None:
        try:
            with open(f"/proc/{child.pid}/status") as f:
                for line in f:
                    key = line.split(":")[0]
                    if key in peak:
                        peak[key] = max(peak[key], int(line.split()[1]) / 1024)
        except OSError:
            pass
        time.sleep(0.2)
    err = child.stderr.read()
    wall = time.perf_counter() - t
    if child.returncode:
        print(f"{name}: train.py failed: {err.strip().splitlines()[-1]}")
        return
    rows = [json.loads(line) for line in open(log) if '"step"' in line]
    rates = sorted(r["tokens_per_s"] for r in rows[1:] if "tokens_per_s" in r)
    step_time = sum(r.get("step_time_s", 0) for r in rows)
    print(f"{name}: train.py {steps} steps in {wall:.1f} s (start-up and exit {wall - step_time:.1f} s); "
          f"median {rates[len(rates) // 2]:,.0f} tokens/s; peak RSS {peak['VmHWM']:.0f} MiB "
          f"(anonymous {peak['RssAnon']:.0f})", flush=True)


def blend(args) -> None:
    from mtds.data import MicroBatchStream
    from mtds.data.indexed import IndexedWriter
    from mtds.data.indexed.blended_dataset import build_blended
    work = tempfile.mkdtemp(prefix="bench-blend-", dir=args.dir)
    try:
        rng, pairs = np.random.default_rng(0), []
        for k, (weight, docs) in enumerate(((0.5, 3000), (0.3, 400), (0.2, 50))):
            p = os.path.join(work, f"src{k}")
            with IndexedWriter(p, np.uint16) as w:
                lengths = rng.integers(50, 800, size=docs)
                w.add_documents(np.full(int(lengths.sum()), k, dtype=np.uint16), lengths)
            pairs.append((weight, p))
        ds = build_blended(pairs, seq_length=128, num_samples=10_000, seed=1, builder=True,
                           cache_dir=os.path.join(work, "cache"), log=lambda _: None)
        for k, src in enumerate(ds.sources):
            share = np.mean([int(ds[n][0]) == k for n in range(len(ds))])
            print(f"| {os.path.basename(src['prefix'])} | {src['weight']:.2f} | {share:.4f} | {src['documents']:,} | "
                  f"{src['tokens']:,} | {src['epochs']} |")
        one = MicroBatchStream(ds, global_batch_size=16, micro_batch_size=2, shuffle=False)
        two = [MicroBatchStream(ds, global_batch_size=16, micro_batch_size=2, dp_rank=r, dp_size=2, shuffle=False)
               for r in range(2)]
        same = all(np.array_equal(one.global_batch_indices(16 * k),
                                  np.concatenate([s.rank_indices(16 * k) for s in two])) for k in range(625))
        print(f"dp=1 vs dp=2: the same samples in all 625 global batches: {same}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _layout_reads(prefixes, weights, tp, pp, steps):
    """On each rank of a (tp, pp, dp) layout: train.py's data path (``build_streams`` with the real
    process groups) for ``steps`` global batches; what this rank's micro-batches hold."""
    import torch.distributed as dist

    from mtds.data import build_streams
    from mtds.parallel.layout import ParallelLayout
    from mtds.training import TrainConfig
    from mtds.training.ds_config import BatchPlan
    world = dist.get_world_size()
    layout = ParallelLayout.for_world(world, tp=tp, pp=pp)
    groups = layout.build_groups(timeout_s=300)
    blend = [str(x) for pair in zip(weights, prefixes) for x in pair]
    cfg = TrainConfig(deepspeed_config={}, data_path=tuple(blend), seq_length=128, steps=steps, eval_split=0.0,
                      seed=1, tp=tp, pp=pp)
    batch = BatchPlan(global_batch=16, micro_batch=2, accumulation=16 // 2 // layout.dp)

    class Quiet:
        def info(self, _):
            pass
    from mtds.hf.resolve import resolve_model_config
    stream, _ = build_streams(cfg, resolve_model_config("gpt2-tiny"), batch, groups, Quiet())
    reads = [next(stream) for _ in range(steps * batch.accumulation)]
    return dict(rank=dist.get_rank(), tp=groups.tp_rank, pp=groups.pp_rank, dp=groups.dp_rank,
                first=groups.is_first_stage, last=groups.is_last_stage, accumulation=batch.accumulation,
                inputs=[r[0] for r in reads], labels=[r[1] for r in reads])


def layouts(args) -> None:
    """The blend's samples at (tp, pp, dp) = (1,1,1) and (2,2,2) on real ranks: the same global batches."""
    import torch

    from mtds.data.indexed import IndexedWriter
    from lab.testing import spawn
    work = tempfile.mkdtemp(prefix="bench-layouts-", dir=args.dir)
    try:
        rng, prefixes = np.random.default_rng(0), []
        for k, docs in enumerate((3000, 400, 50)):
            prefixes.append(os.path.join(work, f"src{k}"))
            with IndexedWriter(prefixes[-1], np.uint16) as w:
                lengths = rng.integers(50, 800, size=docs)
                w.add_documents(rng.integers(1, 8192, size=int(lengths.sum()), dtype=np.uint16), lengths)
        weights = (0.5, 0.3, 0.2)   # the indices are cached next to src0, in `work`
        (one,) = spawn(_layout_reads, 1, prefixes, weights, 1, 1, args.steps, timeout=600)
        eight = spawn(_layout_reads, 8, prefixes, weights, 2, 2, args.steps, timeout=600)
        m1, m8 = one["accumulation"], eight[0]["accumulation"]
        same, checked = True, 0
        for step in range(args.steps):
            whole = torch.cat(one["inputs"][step * m1:(step + 1) * m1]), torch.cat(one["labels"][step * m1:(step + 1) * m1])
            for part, key, role in ((0, "inputs", "first"), (1, "labels", "last")):
                for tp in (0, 1):
                    ranks = sorted((r for r in eight if r[role] and r["tp"] == tp), key=lambda r: r["dp"])
                    got = torch.cat([mb for r in ranks for mb in r[key][step * m8:(step + 1) * m8]])
                    same &= torch.equal(got, whole[part])
                    checked += 1
        print(f"(1,1,1) vs (2,2,2), {args.steps} global batches of 16 x 128 tokens from a blend of 3 sources: "
              f"the first stages' inputs and the last stages' labels, both TP ranks, data-parallel ranks in "
              f"order, equal the single rank's: {same} ({checked} comparisons)", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="where to write the temporary data [system temp]")
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("preprocess")
    a.add_argument("--mb", type=float, nargs="+", default=[25, 100])
    a.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    b = sub.add_parser("big")
    b.add_argument("--gb", type=float, default=28)
    b.add_argument("--seq", type=int, default=1024)
    b.add_argument("--samples", type=int, default=20_000)
    b.add_argument("--train-steps", type=int, default=20, help="train.py steps on each dataset (0: none)")
    sub.add_parser("blend")
    c = sub.add_parser("layouts")
    c.add_argument("--steps", type=int, default=50)
    args = ap.parse_args()
    {"preprocess": preprocess, "big": big, "blend": blend, "layouts": layouts}[args.cmd](args)


if __name__ == "__main__":
    main()
