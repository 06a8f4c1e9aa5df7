"""Benchmark results -> JSON and a markdown report (the same numbers, two forms)."""
from __future__ import annotations

import json
import os


def _fmt_bytes(n) -> str:
    if n is None:
        return "-"
    return f"{n:,.0f}"


def markdown(result: dict) -> str:
    hf, mt = result["hf"], result["mtds"]
    shape = result["shape"]
    lines = [f"# mtds vs HuggingFace GPT-2 (fp32, CPU)", "",
             "shape: " + ", ".join(f"{k}={v}" for k, v in shape.items())
             + f"; {result['reps']} repetitions alternated, {result['steps']} steps each, first "
               f"{result['warmup']} not timed", "",
             "| | HF GPT2LMHeadModel + AdamW | mtds (1,1,1) | mtds / HF | goal | met |",
             "|---|---:|---:|---:|---:|---|"]
    g = result["goals"]
    lines.append(f"| tokens/s (median) | {hf['tokens_per_s']:,.0f} | {mt['tokens_per_s']:,.0f} | "
                 f"{g['throughput_ratio']:.3f} | >= 1.0 | {'yes' if g['throughput_met'] else '**no**'} |")
    lines.append(f"| peak RSS GiB | {hf['peak_rss_gib']:.3f} | {mt['peak_rss_gib']:.3f} | "
                 f"{g['memory_ratio']:.3f} | <= 1.1 | {'yes' if g['memory_met'] else '**no**'} |")
    lines.append(f"| RSS growth after imports+data, GiB | {hf['train_rss_gib']:.3f} | {mt['train_rss_gib']:.3f} | "
                 f"{g['train_memory_ratio']:.3f} | | |")
    lines.append(f"| loss at step 1 / last | {hf['losses'][0]:.4f} / {hf['losses'][-1]:.4f} | "
                 f"{mt['losses'][0]:.4f} / {mt['losses'][-1]:.4f} | | | |")
    lines += ["", "where a step's time goes (ms per measured step):", "",
              "| phase | HF | mtds |", "|---|---:|---:|"]
    for phase in sorted(set(hf["phases_s"]) | set(mt["phases_s"])):
        a, b = hf["phases_s"].get(phase), mt["phases_s"].get(phase)
        lines.append(f"| {phase} | {'-' if a is None else f'{a * 1e3:.1f}'} | {'-' if b is None else f'{b * 1e3:.1f}'} |")
    if result.get("profile"):
        lines += ["", "top operators by self CPU time (torch.profiler, one measured step):", ""]
        for side, ops in result["profile"].items():
            lines += [f"{side}:", "", "| op | self ms | calls |", "|---|---:|---:|"]
            lines += [f"| {op['name']} | {op['self_ms']:.1f} | {op['calls']} |" for op in ops]
            lines.append("")
    lines += ["", result["verdict"], ""]
    if result.get("layouts"):
        lines += ["## layouts on CPU ranks (regression guard)", "",
                  f"global batch {result['layouts'][0]['global_batch']} (micro batch {shape['micro_batch']}); "
                  "bytes are per rank per step (payload of the collective; see benchmarks/comm_formulas.py)", "",
                  "| (t,p,d) | tokens/s | vs (1,1,1) | rank | traffic | formula | expected B | measured B | match |",
                  "|---|---:|---:|---:|---|---|---:|---:|---|"]
        for lay in result["layouts"]:
            head = f"| {lay['layout']} | {lay['tokens_per_s']:,.0f} | {lay['relative_throughput']:.2f} |"
            rows = lay["comm"] or [{"rank": "-", "traffic": "(none)", "formula": "", "expected_bytes": None,
                                    "measured_bytes": None, "match": ""}]
            for i, row in enumerate(rows):
                prefix = head if i == 0 else "| | | |"
                lines.append(f"{prefix} {row['rank']} | {row['traffic']} | {row['formula']} | "
                             f"{_fmt_bytes(row['expected_bytes'])} | {_fmt_bytes(row['measured_bytes'])} | "
                             f"{row['match']} |")
        lines += ["", *result.get("notes", [])]
    return "\n".join(lines) + "\n"


def write(result: dict, out_dir: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "bench.json"), "w") as f:
        json.dump(result, f, indent=2)
    text = markdown(result)
    with open(os.path.join(out_dir, "bench.md"), "w") as f:
        f.write(text)
    return text
