"""Logs of finished runs -> one row per scheme, written as JSON and markdown.

tokens/s and TFLOP/s are medians over steps after the first (warm-up); TFLOP/s per rank uses the
PTD-P formulas of mtds.metrics (model: 72 B s l h^2 (1 + s/6h + V/12lh); hardware adds recomputation).
Peak memory is the largest peak RSS (CPU) over the scheme's ranks; bytes are payload bytes of every
collective a rank issued in the last step (max over ranks, and the mean).
"""
from __future__ import annotations

import glob
import json
import os

from benchmarks.measure import median


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _comm_total(summary: dict) -> int:
    return sum(v["bytes"] for k, v in summary.items() if not k.startswith("barrier"))


def summarise(launched: dict) -> dict:
    scheme = launched["scheme"]
    steps = [r for r in read_jsonl(launched["log"]) if r.get("kind") == "train"]
    ranks = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(launched["probe_dir"], "rank*.json")))]
    timed = steps[1:] or steps
    last_comm = [_comm_total(r["comm_per_step"][-1]) if r["comm_per_step"] else 0 for r in ranks]
    return {
        "scheme": scheme.name, "tp": scheme.tp, "pp": scheme.pp, "dp": ranks[0]["world"] // (scheme.tp * scheme.pp),
        "layout": ranks[0]["layout"], "ranks": len(ranks), "config": os.path.basename(scheme.config),
        "tokens_per_s": median([s["tokens_per_s"] for s in timed]),
        "tflops_model_per_rank": median([s["tflops_model"] for s in timed]),
        "tflops_hw_per_rank": median([s["tflops_hw"] for s in timed]),
        "peak_mem_gib": max(r["peak_rss_gib"] for r in ranks),
        "comm_bytes_per_step_max_rank": max(last_comm), "comm_bytes_per_step_mean": sum(last_comm) / len(last_comm),
        "comm_by_kind_rank0": ranks[0]["comm_per_step"][-1] if ranks[0]["comm_per_step"] else {},
        "steps": [s["step"] for s in steps], "losses": [s["loss"] for s in steps],
        "final_loss": steps[-1]["loss"] if steps else None, "wall_s": launched["wall_s"],
    }


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# PTD-P vs ZeRO-3 on this machine ({meta['nproc']} ranks, model {meta['model']}, "
             f"{meta['steps']} steps, seq {meta['seq_length']})", "",
             "| scheme | (t,p,d) | tokens/s | TFLOP/s/rank model | TFLOP/s/rank hw | peak mem GiB | "
             "comm B/step/rank (max) | final loss |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['scheme']} | ({r['tp']},{r['pp']},{r['dp']}) | {r['tokens_per_s']:,.0f} | "
                     f"{r['tflops_model_per_rank']:.4f} | {r['tflops_hw_per_rank']:.4f} | {r['peak_mem_gib']:.3f} | "
                     f"{r['comm_bytes_per_step_max_rank']:,.0f} | {r['final_loss']:.4f} |")
    if meta.get("loss_agreement"):
        lines += ["", meta["loss_agreement"]]
    lines += ["", "Peak memory is peak RSS per process on CPU (includes the Python/torch/DeepSpeed runtime). "
              "Comm bytes are collective payloads of the last step, counted from before DeepSpeed starts "
              "(so ZeRO's cached all-gather / reduce-scatter calls are included)."]
    return "\n".join(lines) + "\n"


def loss_agreement(rows: list[dict]) -> tuple[float, str]:
    """Largest relative difference of the step-1 loss from the first scheme's."""
    if len(rows) < 2 or not all(r["losses"] for r in rows):
        return 0.0, ""
    ref = rows[0]["losses"][0]
    worst = max(abs(r["losses"][0] - ref) / abs(ref) for r in rows[1:])
    return worst, (f"step-1 loss: " + ", ".join(f"{r['scheme']} {r['losses'][0]:.6f}" for r in rows)
                   + f" (max relative difference {worst:.2e}; same init and data, so they should agree)")


def write(rows: list[dict], meta: dict, out_dir: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "compare.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    text = markdown(rows, meta)
    with open(os.path.join(out_dir, "compare.md"), "w") as f:
        f.write(text)
    return text
