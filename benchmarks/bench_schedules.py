"""Measured pipeline bubble of each schedule train.py runs, next to the unit-cost theory.

    python benchmarks/bench_schedules.py [--p 4] [--m 4 8 16] [--steps 4] [--out docs/pipeline]

For every schedule (1f1b; interleaved with --v chunks per rank; dualpipev) and micro-batch count m, one
launch of train.py at (t, p, d) = (1, p, 1) with --timeline, on one GPT-2 for every schedule (gpt2-tiny
widened to --hidden, with 4p transformer blocks: 4 per rank, 2 per chunk at v = 2 and in DualPipeV's V). m is set through the DeepSpeed config:
train_batch_size = m x micro batch. The measured bubble is the median over steps 2..N (step 1 is warm-up)
of the step log's per-stage idle / step time (``mtds.observe.timeline.measured_bubble``). Theory
(``lab.pipe_sim.theory``) is reported in the same unit: idle / step time = b / (1 + b), where b is the
papers' idle / compute. A schedule train.py does not run is theory only; a case train.py refuses shows
train.py's own check message. Writes the markdown table (stdout and OUT/measured_p{p}.md) and one
Gantt PNG of the last step per case (OUT/measured_{schedule}_p{p}_m{m}.png); traces and logs go to --work.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEDULES = ("1f1b", "interleaved", "zb-h1", "dualpipev")


def write_model(path: str, blocks: int, hidden: int) -> str:
    """gpt2-tiny with ``blocks`` blocks of width ``hidden`` as a HF config.json (what train.py --model reads)."""
    from mtds.model.config import PRESETS
    from mtds.hf import hf_config_from_model_config
    cfg = replace(PRESETS["gpt2-tiny"], num_layers=blocks, hidden_size=hidden, ffn_hidden_size=4 * hidden)
    hf_config_from_model_config(cfg).save_pretrained(path)
    return path


def write_ds_config(path: str, m: int, micro: int) -> str:
    """The shipped CPU fp32 config with m micro-batches per step (d = 1: accumulation = m)."""
    with open(os.path.join(REPO, "ds_configs", "cpu_fp32.json")) as f:
        config = json.load(f)
    config.update(train_batch_size=m * micro, train_micro_batch_size_per_gpu=micro)
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
    return path


def run_train(cmd: list[str], case: str) -> str | None:
    """Run a train.py launch from the repository root, its output in CASE/stdout.txt; None if it exited 0,
    else its first ``error:`` line (or where to look)."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    with open(os.path.join(case, "stdout.txt"), "w") as out:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    if proc.returncode == 0:
        return None
    with open(os.path.join(case, "stdout.txt")) as f:
        errors = [line.strip() for line in f if line.startswith("error:")]
    return errors[0] if errors else f"train.py exit {proc.returncode}, see {case}/stdout.txt"


def launch(args, name: str, v: int, m: int, model: str, work: str, extra: tuple = (), tag: str = "") -> dict:
    """One train.py run (v: chunks per rank, passed on for interleaved only; ``extra``: more train.py
    flags, ``tag`` names their case folder); returns per-step bubble records (steps 2..N), the timeline
    PNG and trace paths."""
    from lab.testing import free_port
    case = os.path.join(work, f"{name}_m{m}{tag}")
    os.makedirs(case, exist_ok=True)
    config = write_ds_config(os.path.join(case, "ds_config.json"), m, args.micro_batch)
    jsonl, trace = os.path.join(case, "log.jsonl"), os.path.join(case, "timeline.json")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.p),
           "--master_port", str(free_port()), os.path.join(REPO, "train.py"),
           "--deepspeed_config", config, "--pp", str(args.p), "--pipeline-schedule", name,
           "--virtual-stages", str(v if name == "interleaved" else 1), "--model", model, "--seq-length", str(args.seq_length),
           "--steps", str(args.steps), "--eval-split", "0", "--lr-decay", "constant", "--no-progress",
           "--log-jsonl", jsonl, "--timeline", trace, *extra]
    start = time.monotonic()
    error = run_train(cmd, case)
    if error:
        return {"error": error}
    with open(jsonl) as f:
        steps = [r for r in map(json.loads, f) if r.get("kind", "train") == "train" and "bubble" in r]
    return {"steps": [r for r in steps if r["step"] >= 2], "png": os.path.splitext(trace)[0] + ".png",
            "trace": trace, "stdout": os.path.join(case, "stdout.txt"), "wall_s": time.monotonic() - start}


def small_png(src: str, dst: str, width: int = 1400) -> None:
    """Copy a Gantt PNG into the docs at most ``width`` px wide, as a 64-colour palette (tens of KB)."""
    from PIL import Image
    with Image.open(src) as img:
        img = img.convert("RGB")
        if img.width > width:
            img = img.resize((width, round(img.height * width / img.width)), Image.LANCZOS)
        img.quantize(colors=64).save(dst, optimize=True)


def theory(name: str, p: int, v: int, m: int) -> tuple[float, float, float]:
    """Worst-rank and mean idle / step time of the unit-cost simulation, and the papers' idle / compute."""
    from lab.pipe_sim.theory import simulate_any, theory_bubble
    worst = theory_bubble(name, p, v, m)
    fractions = simulate_any(name, p, v, m).idle_fraction
    return worst["bubble_fraction"], float(sum(fractions) / len(fractions)), worst["bubble_ratio"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--p", type=int, default=4, help="pipeline stages = world size [4]")
    ap.add_argument("--m", type=int, nargs="+", default=[4, 8, 16], help="micro-batches per step [4 8 16]")
    ap.add_argument("--v", type=int, default=2, help="chunks per rank of the interleaved schedule [2]")
    ap.add_argument("--steps", type=int, default=4, help="steps per run; step 1 is not measured [4]")
    ap.add_argument("--micro-batch", type=int, default=2, help="samples per micro-batch [2]")
    ap.add_argument("--seq-length", type=int, default=128, help="tokens per sample [128]")
    ap.add_argument("--hidden", type=int, default=256, help="model width (FFN: 4x; vocabulary 8192) [256]")
    ap.add_argument("--blocks", type=int, help="transformer blocks [4p]")
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    ap.add_argument("--out", default="docs/pipeline", help="table and Gantt PNGs [docs/pipeline]")
    ap.add_argument("--work", default="runs/bench_schedules", help="logs, traces, configs [runs/bench_schedules]")
    args = ap.parse_args(argv)
    if args.steps < 2:
        ap.error("--steps must be >= 2 (step 1 is warm-up and not measured)")
    sys.path.insert(0, REPO)
    from mtds.pipe.select import PIPELINE_SCHEDULES
    from mtds.rules.schedule import micro_batches_problem
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.work, exist_ok=True)
    model = write_model(os.path.join(args.work, "model"), args.blocks or 4 * args.p, args.hidden)
    p = args.p
    rows = ["| schedule | v | m | measured max | measured mean | per stage | step s | theory max (mean) "
            "| papers' idle/compute | measured / theory |", "|---|---|---|---|---|---|---|---|---|---|"]
    started = time.monotonic()
    for name in args.schedules:
        v = args.v if name == "interleaved" else (2 if name == "dualpipev" else 1)
        for m in args.m:
            lead = f"| {name} | {v} | {m} |"
            if name == "dualpipev" and m < 2 * p:
                # what train.py itself answers: the rulebook's line, no launch needed
                problem = micro_batches_problem(name, p, m)
                if problem is not None:
                    rows.append(f"{lead} train.py: {problem.split(':')[0]} | | | | | | |")
                    print(rows[-1], flush=True)
                    continue
            t_max, t_mean, t_ratio = theory(name, p, v, m)
            cells = f"{t_max:.1%} ({t_mean:.1%}) | {t_ratio:.3f} |"
            if name not in PIPELINE_SCHEDULES:
                rows.append(f"{lead} not runnable in train.py; theory only | | | | {cells} |")
                print(rows[-1], flush=True)
                continue
            run = launch(args, name, v, m, model, args.work)
            if "error" in run:
                rows.append(f"{lead} {run['error']} | | | | {cells} |")
                print(rows[-1], flush=True)
                continue
            steps = run["steps"]
            worst = statistics.median(r["bubble"] for r in steps)
            mean = statistics.median(statistics.mean(r["bubble_per_stage"]) for r in steps)
            stages = [statistics.median(r["bubble_per_stage"][s] for r in steps) for s in range(p)]
            step_s = statistics.median(r["step_time_s"] for r in steps)
            rows.append(f"{lead} {worst:.1%} | {mean:.1%} | {' / '.join(f'{b:.0%}' for b in stages)} | "
                        f"{step_s:.2f} | {cells} {worst / t_max:.2f} |")
            print(rows[-1] + f"   ({run['wall_s']:.0f} s)", flush=True)
            small_png(run["png"], os.path.join(args.out, f"measured_{name}_p{p}_m{m}.png"))
    table = "\n".join(rows) + "\n"
    path = os.path.join(args.out, f"measured_p{p}.md")
    with open(path, "w") as f:
        f.write(table)
    print(f"\n{table}\ntable: {path}; Gantt PNGs: {args.out}/measured_*_p{p}_m*.png; "
          f"logs and traces: {args.work}; {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
