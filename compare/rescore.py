"""Re-score a saved sweep with the current planner: ``python -m compare.rescore RESULTS.json [...]``.

Recomputes every cell's prediction from the saved rows (scheme, layout, link rate, batch) and a device
profile -- the sweep's own (``meta.profile``) or ``--profile FILE`` -- without rerunning anything, and
prints predicted / measured tokens/s per cell and per column's winner. Columns named by ``--fit-on``
are marked in-sample (the columns any constant may be looked at on), the others held out. Rows saved
before a sweep recorded them run DeepSpeed's ZeRO-1 all-reduce and the uniform partition (what the
trainer did then). ``--json`` prints the rows.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from .predict import predict_cell
from .schemes import parse_scheme


RATES = ("matmul_tflops", "memory_gbps", "elementwise_gbps", "allreduce_busbw_gbps")
TIMES = ("optimizer_s_per_param", "optimizer_s_per_tensor", "allreduce_latency_s")


def slowed_profile(profile: dict, factor: float) -> dict:
    """The profile of a host ``factor`` x slower at everything it measured (rates divided, times
    multiplied): to re-score a sweep whose own profile is lost on another day's machine, with the factor
    recovered from the sweep's saved predictions (see docs/cluster.md), never from its measurements."""
    out = dict(profile)
    for k in RATES:
        if k in out:
            out[k] = out[k] / factor
    for k in TIMES:
        if out.get(k) is not None:
            out[k] = out[k] * factor
    if "engine_overhead" in out:
        out["engine_overhead"] = {s: [c * factor for c in v] for s, v in out["engine_overhead"].items()}
    return out


def load(path: str, meta: dict | None = None) -> dict:
    """A sweep's results.json, or its results.csv (flat rows; nodes, ranks per node and the batch taken
    from ``meta``, the first results.json given)."""
    if not path.endswith(".csv"):
        with open(path) as f:
            return json.load(f)
    import csv
    if meta is None:
        raise ValueError("a results.csv needs a results.json before it on the command line (its meta)")
    rows = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            kind = next(k for k in ("hf-zero3", "zero3", "zero1", "ptdp", "autotp") if r["scheme"].startswith(k))
            rows.append({"scheme": r["scheme"], "kind": kind, "tp": int(r["tp"]), "pp": int(r["pp"]),
                         "model": r["model"], "status": r["status"], "link": r["link"],
                         "link_bits_per_s": float(r["link_bits_per_s"]), "nodes": meta["nodes"],
                         "ranks_per_node": meta["ranks_per_node"],
                         "tokens_per_s": float(r["tokens_per_s"] or 0),
                         "predicted": {"tokens_per_s": float(r["predicted_tokens_per_s"] or 0)}})
    return {"meta": meta, "rows": rows}


def scheme_of(row: dict):
    """The Scheme a saved row ran (its name encodes tp, pp, schedule; kind and model are saved)."""
    kind = row["kind"]
    if kind in ("zero3", "zero1", "hf-zero3"):
        return parse_scheme(kind)
    if kind == "ptdp":
        return parse_scheme(f"ptdp:tp={row['tp']},pp={row['pp']}")
    return None


def rescore(data: dict, profile: str, fit_on=("10gbit", "1gbit"), fit_model: str | None = None) -> list[dict]:
    """One dict per modelled cell: predicted / measured tokens/s now and as saved; ``held_out`` unless
    the cell's column is in ``fit_on`` and its model is ``fit_model`` (default: this sweep's)."""
    meta = data["meta"]
    fit_model = fit_model or meta["model"]
    out = []
    for row in data["rows"]:
        scheme = scheme_of(row)
        if row.get("status") != "ok" or scheme is None:
            continue
        world = row["nodes"] * row["ranks_per_node"]
        pred = predict_cell(scheme, model=row.get("model_path") or row["model"], seq=meta["seq_length"],
                            global_batch=meta["global_batch"], micro_batch=meta["micro_batch"], world=world,
                            ranks_per_node=row["ranks_per_node"], link_bytes_per_s=row["link_bits_per_s"] / 8,
                            profile=profile, balance=row.get("pipeline_balance", "uniform"),
                            grad_reduce=row.get("grad_reduce", "all-reduce"))
        if "error" in pred:
            continue
        model = row["model"]
        label = row["scheme"] + ("" if model == fit_model else f" [{os.path.basename(model)}]")
        out.append({"scheme": label, "model": model, "link": row["link"], "measured_tokens_per_s": row["tokens_per_s"],
                    "predicted_tokens_per_s": pred["tokens_per_s"],
                    "ratio": pred["tokens_per_s"] / row["tokens_per_s"],
                    "old_ratio": (row.get("predicted") or {}).get("tokens_per_s", 0) / row["tokens_per_s"],
                    "held_out": row["link"] not in fit_on or model != fit_model,
                    "breakdown_s": pred["breakdown_s"]})
    return out


def table(rows: list[dict]) -> list[str]:
    links = list(dict.fromkeys(r["link"] for r in rows))
    schemes = list(dict.fromkeys(r["scheme"] for r in rows))
    cell = {(r["scheme"], r["link"]): r for r in rows}
    head = [f"{link}{' (held out)' if all(r['held_out'] for r in rows if r['link'] == link) else ''}" for link in links]
    lines = ["predicted / measured tokens/s (as saved in brackets); rows of another model than the fitted "
             "one are held out in every column", "",
             "| scheme | " + " | ".join(head) + " |", "|---|" + "---:|" * len(links)]
    for s in schemes:
        lines.append(f"| {s} | " + " | ".join(
            f"{cell[(s, link)]['ratio']:.2f} ({cell[(s, link)]['old_ratio']:.2f})" if (s, link) in cell else "-"
            for link in links) + " |")
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        for label, key in (("winner, measured", "measured_tokens_per_s"), ("winner, predicted", "predicted_tokens_per_s")):
            lines.append(f"| *{label}, {os.path.basename(model)}* | " + " | ".join(
                max((r for r in mine if r["link"] == link), key=lambda r: r[key], default={"scheme": "-"})["scheme"]
                for link in links) + " |")
    inside = sum(abs(r["ratio"] - 1) <= 0.25 for r in rows)
    lines += ["", f"{inside} of {len(rows)} cells within ±25 %"]
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m compare.rescore", description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", help="results.json of one or more sweeps (their rows are pooled)")
    ap.add_argument("--profile", help="device profile (default: the first sweep's meta.profile)")
    ap.add_argument("--fit-on", default="10gbit,1gbit", help="columns counted in-sample (default 10gbit,1gbit)")
    ap.add_argument("--slower", type=float, default=1.0,
                    help="model a host this many times slower than the profile (a lost profile of another day)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    datas = []
    for path in a.results:
        try:
            datas.append(load(path, datas[0]["meta"] if datas else None))
        except (OSError, ValueError, KeyError) as err:
            print(f"error: cannot read {path}: {err}", file=sys.stderr)
            return 2
    profile = a.profile or datas[0]["meta"].get("profile")
    if not profile or not os.path.exists(profile):
        print(f"error: no device profile at {profile!r}; pass --profile FILE (mtds-plan --calibrate "
              f"--calibrate-ranks N writes one)", file=sys.stderr)
        return 2
    if a.slower <= 0:
        print(f"error: --slower must be > 0, got {a.slower}", file=sys.stderr)
        return 2
    if a.slower != 1.0:
        import tempfile
        with open(profile) as f:
            slowed = slowed_profile(json.load(f), a.slower)
        tmp = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
        json.dump(slowed, tmp)
        tmp.close()
        profile = tmp.name
    fit_on = tuple(x.strip() for x in a.fit_on.split(",") if x.strip())
    rows = [r for d in datas for r in rescore(d, profile, fit_on, datas[0]["meta"]["model"])]
    print(json.dumps(rows, indent=2) if a.json else "\n".join(table(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
