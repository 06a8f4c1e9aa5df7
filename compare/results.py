"""Sweep rows -> results.json (everything), results.csv (one flat line per cell) and results.md (a table
per link speed with ratios against the ZeRO-3 row, predicted / measured beside each cell, and a
summary of tokens/s per scheme and link with the winner of every column)."""
from __future__ import annotations

import csv
import json
import os

from .table import fmt_bytes

CSV_FIELDS = ["link", "link_bits_per_s", "scheme", "tp", "pp", "dp", "status", "error", "step_s_median",
              "step_s_p25", "step_s_p75", "step_s_min", "step_s_max", "timed_steps", "tokens_per_s",
              "tflops_model_per_rank", "tflops_hw_per_rank", "peak_mem_gib", "ar_bytes", "ag_bytes", "rs_bytes",
              "p2p_bytes", "link_bytes_per_step_per_node", "link_formula_bytes", "predicted_step_s",
              "predicted_tokens_per_s", "predicted_over_measured", "loss_max_rel_diff", "final_loss"]


def add_loss_agreement(rows: list[dict]) -> float:
    """Each ok row's largest relative loss difference from the first ok row, over all steps."""
    ok = [r for r in rows if r.get("status") == "ok" and r.get("losses")]
    if not ok:
        return 0.0
    ref = ok[0]["losses"]
    worst = 0.0
    for r in ok:
        n = min(len(ref), len(r["losses"]))
        r["loss_max_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(r["losses"][:n], ref[:n]))
        worst = max(worst, r["loss_max_rel_diff"])
    return worst


def _flat(row: dict) -> dict:
    fam = row.get("comm_by_family_max_rank", {})
    pred = row.get("predicted", {})
    out = {k: row.get(k) for k in CSV_FIELDS}
    out.update(ar_bytes=fam.get("all_reduce"), ag_bytes=fam.get("all_gather"), rs_bytes=fam.get("reduce_scatter"),
               p2p_bytes=fam.get("p2p_send"), predicted_step_s=pred.get("step_s"),
               predicted_tokens_per_s=pred.get("tokens_per_s"))
    if pred.get("tokens_per_s") and row.get("tokens_per_s"):
        out["predicted_over_measured"] = pred["tokens_per_s"] / row["tokens_per_s"]
    return out


def _cell_table(rows: list[dict]) -> list[str]:
    zero3 = next((r for r in rows if r["scheme"] == "zero3" and r["status"] == "ok"), None)
    lines = ["| scheme | (t,p,d) | step s median [p25-p75] | tokens/s | x ZeRO-3 | predicted tokens/s | pred/meas | "
             "TFLOP/s/rank model / hw | peak GiB | all-reduce | all-gather (shard) | reduce-scatter | p2p send | "
             "link B/step/node (formula) | loss rel. diff |",
             "|---|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        layout = f"({r['tp']},{r['pp']},{r['dp']})"
        pred = r.get("predicted", {})
        ptxt = f"{pred['tokens_per_s']:,.0f}" if "tokens_per_s" in pred else pred.get("error", "-")
        if r["status"] != "ok":
            lines.append(f"| {r['scheme']} | {layout} | **failed**: {r['error']} | - | - | {ptxt} | - | - | - | - | - "
                         f"| - | - | - | - |")
            continue
        fam = r["comm_by_family_max_rank"]
        ratio = f"{r['tokens_per_s'] / zero3['tokens_per_s']:.2f}" if zero3 else "-"
        pm = f"{pred['tokens_per_s'] / r['tokens_per_s']:.2f}" if "tokens_per_s" in pred else "-"
        formula = f" ({fmt_bytes(r['link_formula_bytes'])})" if r.get("link_formula_bytes") else ""
        lines.append(
            f"| {r['scheme']} | {layout} | {r['step_s_median']:.3f} [{r['step_s_p25']:.3f}-{r['step_s_p75']:.3f}] | "
            f"{r['tokens_per_s']:,.0f} | {ratio} | {ptxt} | {pm} | {r['tflops_model_per_rank']:.4f} / "
            f"{r['tflops_hw_per_rank']:.4f} | {r['peak_mem_gib']:.2f} | {fmt_bytes(fam['all_reduce'])} | "
            f"{fmt_bytes(fam['all_gather'])} | {fmt_bytes(fam['reduce_scatter'])} | {fmt_bytes(fam['p2p_send'])} | "
            f"{fmt_bytes(r.get('link_bytes_per_step_per_node'))}{formula} | {r.get('loss_max_rel_diff', 0):.1e} |")
    return lines


def summary_table(rows: list[dict], links: list[str]) -> list[str]:
    """tokens/s measured (predicted) per scheme and link, and each column's winner."""
    schemes = list(dict.fromkeys(r["scheme"] for r in rows))
    cell = {(r["scheme"], r["link"]): r for r in rows}
    lines = ["| scheme | " + " | ".join(links) + " |", "|---|" + "---:|" * len(links)]
    for s in schemes:
        parts = []
        for link in links:
            r = cell.get((s, link))
            if not r or r["status"] != "ok":
                parts.append("failed")
                continue
            pred = r.get("predicted", {}).get("tokens_per_s")
            parts.append(f"{r['tokens_per_s']:,.0f}" + (f" ({pred:,.0f})" if pred else ""))
        lines.append(f"| {s} | " + " | ".join(parts) + " |")
    for label, key in (("winner, measured", "tokens_per_s"), ("winner, predicted", "predicted")):
        winners = []
        for link in links:
            ok = [cell[(s, link)] for s in schemes if (s, link) in cell and cell[(s, link)]["status"] == "ok"]
            if key == "predicted":
                ok = [r for r in ok if "tokens_per_s" in r.get("predicted", {})]
                best = max(ok, key=lambda r: r["predicted"]["tokens_per_s"], default=None)
            else:
                best = max(ok, key=lambda r: r["tokens_per_s"], default=None)
            winners.append(best["scheme"] if best else "-")
        lines.append(f"| *{label}* | " + " | ".join(winners) + " |")
    return lines


def markdown(rows: list[dict], meta: dict) -> str:
    out = [f"# PTD-P vs ZeRO-3 on an emulated cluster: {meta['nodes']} nodes x {meta['ranks_per_node']} ranks, "
           f"model {meta['model']}, global batch {meta['global_batch']} x seq {meta['seq_length']}", "",
           f"{meta['steps']} steps per cell, the first {meta['warmup']} excluded from timings; inter-node links "
           f"shaped with tc (htb) per node and direction; latency {meta['latency']}; planner profile "
           f"`{os.path.basename(meta['profile']) if meta.get('profile') else 'none'}`.", "",
           "## tokens/s measured (predicted)", "", *summary_table(rows, meta["links"])]
    for link in meta["links"]:
        out += ["", f"## inter-node link {link}", "", *_cell_table([r for r in rows if r["link"] == link])]
    out += ["", meta.get("loss_agreement", ""), "",
            "Communication columns are payload bytes per rank per step (max over ranks), one per collective family "
            "(an all-gather's payload is the rank's shard, a reduce-scatter's and an all-reduce's the full tensor, "
            "so they are never added). Link bytes are what each node's interface sent per timed step (kernel "
            "counters), with the formula of mtds.cluster.formulas in parentheses. pred/meas is predicted over "
            "measured tokens/s."]
    return "\n".join(out) + "\n"


def write_results(rows: list[dict], meta: dict, out_dir: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    worst = add_loss_agreement(rows)
    meta["loss_agreement"] = (f"Loss agreement: every scheme's loss at every step is within {worst:.1e} (relative) of "
                              f"the first scheme's (same initial weights, samples and seed).")
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=2)
    with open(os.path.join(out_dir, "results.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        writer.writeheader()
        writer.writerows(_flat(r) for r in rows)
    text = markdown(rows, meta)
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(text)
    return text
