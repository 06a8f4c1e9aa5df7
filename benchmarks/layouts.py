"""Part 2 of the benchmark: mtds layouts on CPU ranks against (1,1,1) at the same global batch, with
the bytes each rank communicated in its last step next to the formula (comm_formulas.py)."""
from __future__ import annotations

from .comm_formulas import expected_rows
from .workloads import Shape

# DeepSpeed's pipeline sends without a group argument: the tracer files point-to-point under "world".
_ALIASES = {"send/pp": ("send/pp", "send/world"), "recv/pp": ("recv/pp", "recv/world")}

NOTES = [
    "Notes: payload bytes (the tensor a rank hands to the collective), fp32. ZeRO-1 with d = 1 still "
    "issues its gradient all-reduce in a group of one (counted, moves nothing). At d = 2 DeepSpeed's "
    "ZeRO-1 all-reduces the gradients (4P, as textbook DP) and then all-gathers the updated parameter "
    "partitions (4P/d): on a ring that is 1.5x the bus bytes of plain DP at d = 2. A few extra bytes "
    "(+4/+8) are scalar reductions: grad-norm, loss averaging over data-parallel ranks.",
]


def match(expected, measured) -> str:
    if expected is None or measured is None:
        return "-"
    if measured == expected:
        return "exact"
    diff = measured - expected
    if abs(diff) <= 64:
        return f"{diff:+d} B (scalars)"
    return f"{measured / expected:.3f}x"


def _comm_rows(shape: Shape, t: int, p: int, d: int, ranks: list[dict], micro_batches: int) -> list[dict]:
    rows = []
    shown = [0] if p == 1 else [0, len(ranks) - 1]      # stages differ; TP and DP ranks are symmetric
    for r in shown:
        stage = 0 if p == 1 else (0 if r == 0 else p - 1)
        measured = dict(ranks[r]["comm_last_step"])
        for row in expected_rows(shape, t, p, d, micro_batches, stage):
            keys = _ALIASES.get(row["traffic"], (row["traffic"],))
            got = next((measured.pop(k)["bytes"] for k in keys if k in measured), None)
            rows.append({**row, "rank": r, "measured_bytes": got, "match": match(row["expected_bytes"], got)})
        for key, stats in measured.items():            # anything the formulas do not model
            if not key.startswith("barrier") and stats["bytes"]:
                rows.append({"rank": r, "traffic": key, "formula": "(not modelled)", "expected_bytes": None,
                             "measured_bytes": stats["bytes"], "match": "-"})
    return rows


def run_layouts(shape: Shape, triples, args, with_baseline: bool = True) -> tuple[list[dict], list[str]]:
    """Run (1,1,1) (unless ``with_baseline`` is False: then ratios are to the first layout) and each triple."""
    from lab.testing import spawn

    from .mtds_side import train_mtds
    global_batch = 2 * shape.micro_batch       # two micro-batches per step at d = 1, one per rank at d = 2
    results, baseline = [], None
    layouts = [tuple(tr) for tr in triples if tuple(tr) != (1, 1, 1)]
    for t, p, d in ([(1, 1, 1)] if with_baseline else []) + layouts:
        ranks = spawn(train_mtds, t * p * d, shape.as_dict(), t, p, global_batch, args.layout_steps, 1, args.seed,
                      timeout=args.timeout)
        step_s = max(r["median_step_s"] for r in ranks)      # the slowest rank sets the pace
        tokens_per_s = global_batch * shape.seq / step_s
        baseline = baseline or tokens_per_s
        micro_batches = global_batch // (shape.micro_batch * d)
        results.append({"layout": f"({t},{p},{d})", "tp": t, "pp": p, "dp": d, "global_batch": global_batch,
                        "tokens_per_s": tokens_per_s, "relative_throughput": tokens_per_s / baseline,
                        "losses": ranks[-1]["losses"], "peak_rss_gib": [r["peak_rss_gib"] for r in ranks],
                        "comm": _comm_rows(shape, t, p, d, ranks, micro_batches),
                        "comm_raw": [r["comm_last_step"] for r in ranks]})
        print(f"[bench] layout ({t},{p},{d}): {tokens_per_s:,.0f} tokens/s ({tokens_per_s / baseline:.2f}x)",
              flush=True)
    return results, NOTES
