"""Sweep rows -> results.json (everything), results.csv (one flat line per cell) and results.md (a table
per link speed with ratios against the ZeRO-3 row, predicted / measured beside each cell, and a
summary of tokens/s per scheme and link with the winner of every column)."""
from __future__ import annotations

import csv
import json
import os

from .table import fmt_bytes, learning_rate, peer_notes

CSV_FIELDS = ["link", "link_bits_per_s", "scheme", "model", "tp", "pp", "dp", "status", "error", "step_s_median",
              "step_s_p25", "step_s_p75", "step_s_min", "step_s_max", "timed_steps", "tokens_per_s",
              "tflops_model_per_rank", "tflops_hw_per_rank", "peak_mem_gib", "ar_bytes", "ag_bytes", "rs_bytes",
              "p2p_bytes", "link_bytes_per_step_per_node", "link_formula_bytes",
              "traced_inter_bytes_per_step_per_node", "traced_intra_bytes_per_step_per_node",
              "state_rank", "state_psi", "state_params", "state_grads", "state_optimizer", "state_other", "state_total",
              "formula_params", "formula_grads", "formula_optimizer", "formula_total", "formula", "bubble",
              "bubble_per_stage", "predicted_step_s",
              "predicted_tokens_per_s", "predicted_over_measured", "loss_max_rel_diff", "final_loss", "framework",
              "parameters"]


def add_loss_agreement(rows: list[dict], references: dict | None = None) -> dict:
    """Each ok row's largest relative loss difference, over all steps, from the first ok row training
    the same model, or from that model's single-host reference run (`references`: model -> losses)
    where there is one. Returns the worst over the rows of the run's main model."""
    worst = {}
    for r in rows:
        if r.get("status") != "ok" or not r.get("losses"):
            continue
        model = r.get("model")
        ref = (references or {}).get(model)
        if not isinstance(ref, list):     # the first mtds row of the model (a peer's initialisation is its own)
            same = [x for x in rows if x.get("status") == "ok" and x.get("losses") and x.get("model") == model]
            ref = next((x for x in same if not x.get("framework")), same[0])["losses"]
        n = min(len(ref), len(r["losses"]))
        r["loss_max_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(r["losses"][:n], ref[:n]))
        if r.get("framework"):   # its own initialisation: only the first step compares (before any update)
            r["loss_step1_rel_diff"] = abs(r["losses"][0] - ref[0]) / abs(ref[0])
            key = ("peers", model)
            worst[key] = max(worst.get(key, 0.0), r["loss_step1_rel_diff"])
            continue
        worst[model] = max(worst.get(model, 0.0), r["loss_max_rel_diff"])
    return worst


def _flat(row: dict) -> dict:
    fam = row.get("comm_by_family_max_rank", {})
    pred = row.get("predicted", {})
    out = {k: row.get(k) for k in CSV_FIELDS}
    out.update(ar_bytes=fam.get("all_reduce"), ag_bytes=fam.get("all_gather"), rs_bytes=fam.get("reduce_scatter"),
               p2p_bytes=fam.get("p2p_send"), predicted_step_s=pred.get("step_s"),
               predicted_tokens_per_s=pred.get("tokens_per_s"))
    state, form = row.get("model_state") or {}, row.get("model_state_formula") or {}
    for key in ("rank", "psi", "params", "grads", "optimizer", "other", "total"):
        out[f"state_{key}"] = state.get(key)
    for key in ("params", "grads", "optimizer", "total"):
        out[f"formula_{key}"] = form.get(key)
    out["formula"] = form.get("label")
    if row.get("bubble_per_stage"):
        out["bubble_per_stage"] = " ".join(f"{b:.3f}" for b in row["bubble_per_stage"])
    if pred.get("tokens_per_s") and row.get("tokens_per_s"):
        out["predicted_over_measured"] = pred["tokens_per_s"] / row["tokens_per_s"]
    return out


def _cell_table(rows: list[dict]) -> list[str]:
    zero3 = next((r for r in rows if r["scheme"] == "zero3" and r["status"] == "ok"), None)
    lines = ["| scheme | (t,p,d) | step s median [p25-p75] | tokens/s | x ZeRO-3 | predicted tokens/s | pred/meas | "
             "TFLOP/s/rank model / hw | peak GiB | model state/rank: measured (formula) | bubble | all-reduce | "
             "all-gather (shard) | reduce-scatter | p2p send | link B/step/node: counters (formula) | traced inter / "
             "intra-node B/step/node | loss rel. diff |",
             "|---|---|---|---:|---:|---:|---:|---|---:|---|---:|---:|---:|---:|---:|---|---|---:|"]
    for r in rows:
        layout = f"({r['tp']},{r['pp']},{r['dp']})"
        pred = r.get("predicted", {})
        ptxt = f"{pred['tokens_per_s']:,.0f}" if "tokens_per_s" in pred else pred.get("error", "-")
        if r["status"] != "ok":
            lines.append(f"| {r['scheme']} | {layout} | **failed**: {r['error']} | - | - | {ptxt} | - | - | - | - | - "
                         f"| - | - | - | - | - | - | - |")
            continue
        fam = r["comm_by_family_max_rank"]
        ratio = f"{r['tokens_per_s'] / zero3['tokens_per_s']:.2f}" if zero3 else "-"
        pm = f"{pred['tokens_per_s'] / r['tokens_per_s']:.2f}" if "tokens_per_s" in pred else "-"
        formula = f" ({fmt_bytes(r['link_formula_bytes'])})" if r.get("link_formula_bytes") else ""
        lines.append(
            f"| {r['scheme']} | {layout} | {r['step_s_median']:.3f} [{r['step_s_p25']:.3f}-{r['step_s_p75']:.3f}] | "
            f"{r['tokens_per_s']:,.0f} | {ratio} | {ptxt} | {pm} | {r['tflops_model_per_rank']:.4f} / "
            f"{r['tflops_hw_per_rank']:.4f} | {r['peak_mem_gib']:.2f} | {_state_cell(r)} | {_bubble_cell(r)} | "
            f"{fmt_bytes(fam['all_reduce'])} | "
            f"{fmt_bytes(fam['all_gather'])} | {fmt_bytes(fam['reduce_scatter'])} | {fmt_bytes(fam['p2p_send'])} | "
            f"{fmt_bytes(r.get('link_bytes_per_step_per_node'))}{formula} | "
            f"{fmt_bytes(r.get('traced_inter_bytes_per_step_per_node'))} / "
            f"{fmt_bytes(r.get('traced_intra_bytes_per_step_per_node'))} | {r.get('loss_max_rel_diff', 0):.1e} |")
    return lines


def _state_cell(r: dict) -> str:
    """params + grads + optimizer = total (formula total, its label), for the rank holding the most."""
    state, form = r.get("model_state"), r.get("model_state_formula")
    if not state:
        return "-"
    text = (f"{fmt_bytes(state['params'])} + {fmt_bytes(state['grads'])} + {fmt_bytes(state['optimizer'])} = "
            f"{fmt_bytes(state['total'])}")
    persistent = f", Ψp={state['psi_persistent']:,}" if state.get("psi_persistent") else ""
    return text + (f" ({fmt_bytes(form['total'])}, {form['label']}, Ψ={state['psi']:,}{persistent})" if form else "")


def _bubble_cell(r: dict) -> str:
    if r.get("bubble") is None:
        return "-"
    stages = r.get("bubble_per_stage") or []
    return f"{r['bubble']:.2f}" + (f" ({' / '.join(f'{b:.2f}' for b in stages)})" if stages else "")


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
    out += ["", meta.get("loss_agreement", ""), "", learning_rate([r for r in rows if r.get("status") == "ok"]),
            *peer_notes([r for r in rows if r.get("status") == "ok"]), "",
            "Communication columns are payload bytes per rank per step (max over ranks), one per collective family "
            "(an all-gather's payload is the rank's shard, a reduce-scatter's and an all-reduce's the full tensor, "
            "so they are never added). Link bytes are what each node's interface sent per timed step (kernel "
            "counters), with the formula of mtds.cluster.formulas in parentheses; traced inter / intra-node bytes are "
            "what the tracer's placement split says a node's ranks send to other nodes / to each other (ring "
            "collectives to the next rank of their group, p2p to the peer; mtds.observe.comm_trace). Model state is the rank "
            "holding the most: parameters + gradients + optimizer states measured from the engine's tensors on entry "
            "to the optimizer step (compare.state), beside the ZeRO formula for the configured precision. Bubble: "
            "median over timed steps of the largest per-stage idle / step time (train.py --timeline), per stage in "
            "parentheses. pred/meas is predicted over measured tokens/s."]
    return "\n".join(out) + "\n"


def _dropout_caveat(model) -> str:
    """Dropout masks are keyed by layer and rank, so layouts draw different masks (Megatron's do too):
    with dropout on, equal losses are not expected, and the line says why rather than hide it."""
    if not model:
        return ""
    from mtds.hf.resolve import resolve_model_config
    try:
        cfg = resolve_model_config(model)
    except (OSError, ValueError):
        return ""
    p = max(cfg.hidden_dropout, cfg.attention_dropout)
    return (f" The model has dropout (p = {p:g}): its masks differ between layouts, so the losses agree only "
            f"statistically; set the dropouts to 0 to compare them exactly." if p > 0 else "")


def write_results(rows: list[dict], meta: dict, out_dir: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    worst = add_loss_agreement(rows, meta.get("references"))
    main = worst.pop(meta.get("model"), 0.0)
    peers = {m: worst.pop(k) for k in list(worst) if isinstance(k, tuple) for m in [k[1]]}
    meta["loss_agreement"] = (f"Loss agreement: every {meta.get('model')} scheme's loss at every step is within "
                              f"{main:.1e} (relative) of the first scheme's (same initial weights, samples and seed)."
                              + "".join(f" {m}: within {w:.1e} of mtds on one rank on this host (same model, data, seed)."
                                        for m, w in worst.items())
                              + "".join(f" Peer frameworks on {m} (their own initialisation, so only the first "
                                        f"step compares): step-1 loss within {w:.1e} of the first mtds row's."
                                        for m, w in peers.items())
                              + _dropout_caveat(meta.get("model")))
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
