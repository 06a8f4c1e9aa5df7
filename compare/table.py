"""Logs of finished runs -> one row per scheme, written as JSON and markdown.

A step's time is the same on every side (mtds, the HF scheme, the peers): all ranks pass a barrier, then
each times its step; the slowest rank's time is the step's. tokens/s and TFLOP/s are medians over steps
after the warm-up; TFLOP/s per rank uses the PTD-P
formulas of mtds.observe.metrics (model: 72 B s l h^2 (1 + s/6h + V/12lh); hardware adds recomputation).
Peak memory is the largest peak RSS (CPU) over the scheme's ranks. Communication is payload bytes per
rank in the last step, one column per collective family, never summed across families: an all-gather's
payload is the rank's shard, a reduce-scatter's and an all-reduce's the full tensor, a send the message,
so their sums would mean nothing (issue 11). On an emulated cluster, link bytes are what each node's
interface sent per step (kernel counters), averaged over nodes and timed steps.
"""
from __future__ import annotations

import glob
import json
import os

from lab.measure import median


def read_jsonl(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# collective kind -> column family (p2p: pipeline sends; receives mirror them and are not counted)
FAMILIES = {"all_reduce": "all_reduce", "all_gather": "all_gather", "reduce_scatter": "reduce_scatter",
            "send": "p2p_send", "broadcast": "broadcast"}


def comm_by_family(summary: dict) -> dict[str, int]:
    """{"all_reduce": bytes, "all_gather": ..., ...} of one rank's step summary ("kind/group" keys)."""
    out = {family: 0 for family in FAMILIES.values()}
    for key, value in summary.items():
        family = FAMILIES.get(key.split("/")[0])
        if family:
            out[family] += value["bytes"]
    return out


def _comm_total(summary: dict) -> int:
    return sum(v["bytes"] for k, v in summary.items() if not k.startswith("barrier"))


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _cpu_per_step(ranks: list[dict], warmup: int) -> float | None:
    """Process CPU seconds per timed step, the busiest rank's, median over steps; None where a rank did not
    record it. Unlike the step time it leaves out waiting for a core or for a peer: on a host shared with
    other jobs it compares the work two schemes do per step when their wall times are noise."""
    per_rank = [r.get("step_cpu_s") for r in ranks]
    if not all(per_rank):
        return None
    return median([max(step) for step in zip(*(cpu[warmup:] or cpu for cpu in per_rank))])


def _slowest_rank_steps(steps: list[dict], ranks: list[dict]) -> list[dict]:
    """The log's step records (rank 0's clock) re-timed by the slowest rank: every rank times its step from
    the same barrier (compare.entry, compare.hf_entry, compare.peer_entry), so the step ends when the last
    rank's does. tokens/s and TFLOP/s scale by the same factor. A probe without one time per logged step
    (an older run) leaves the log as it is."""
    per_rank = [r.get("step_times_s") or [] for r in ranks]
    if not per_rank or any(len(t) != len(steps) for t in per_rank):
        return steps
    out = []
    for s, slowest in zip(steps, (max(t) for t in zip(*per_rank))):
        scale = s["step_time_s"] / slowest
        out.append({**s, "step_time_s": slowest,
                    **{k: s[k] * scale for k in ("tokens_per_s", "tflops_model", "tflops_hw") if s.get(k) is not None}})
    return out


def summarise(launched: dict, warmup: int = 1, ranks_per_node: int | None = None) -> dict:
    scheme = launched["scheme"]
    steps = [r for r in read_jsonl(launched["log"]) if r.get("kind") == "train"]
    ranks = [json.load(open(p)) for p in sorted(glob.glob(os.path.join(launched["probe_dir"], "rank*.json")))]
    if not steps or not ranks:
        raise RuntimeError(f"{scheme.name}: the run wrote no step log or probe files")
    steps = _slowest_rank_steps(steps, ranks)
    timed = steps[warmup:] or steps
    step_times = [s["step_time_s"] for s in timed]
    last_comm = [_comm_total(r["comm_per_step"][-1]) if r["comm_per_step"] else 0 for r in ranks]
    families = [comm_by_family(r["comm_per_step"][-1]) if r["comm_per_step"] else {} for r in ranks]
    link = _link_per_step(ranks, warmup, ranks_per_node)
    bubbles = [s["bubble"] for s in timed if s.get("bubble") is not None]
    return {
        "scheme": scheme.name, "tp": scheme.tp, "pp": scheme.pp, "dp": ranks[0]["world"] // (scheme.tp * scheme.pp),
        "layout": ranks[0]["layout"], "ranks": len(ranks), "config": os.path.basename(scheme.config),
        "tokens_per_s": median([s["tokens_per_s"] for s in timed]),
        "tflops_model_per_rank": median([s["tflops_model"] for s in timed]),
        "tflops_hw_per_rank": median([s["tflops_hw"] for s in timed]),
        "peak_mem_gib": max(r["peak_rss_gib"] for r in ranks),
        "step_s_median": median(step_times), "step_s_p25": _quantile(step_times, 0.25),
        "step_s_p75": _quantile(step_times, 0.75), "step_s_min": min(step_times), "step_s_max": max(step_times),
        "timed_steps": len(step_times), "cpu_s_per_step": _cpu_per_step(ranks, warmup),
        "comm_bytes_per_step_max_rank": max(last_comm), "comm_bytes_per_step_mean": sum(last_comm) / len(last_comm),
        "comm_by_family_max_rank": {f: max(fam.get(f, 0) for fam in families) for f in FAMILIES.values()},
        "comm_by_kind_rank0": ranks[0]["comm_per_step"][-1] if ranks[0]["comm_per_step"] else {},
        "link_bytes_per_step_per_node": link,
        **_traced_by_node(ranks, warmup, ranks_per_node),
        **_model_state(ranks, scheme, launched.get("config")),
        "bubble": median(bubbles) if bubbles else None,
        "bubble_per_stage": timed[-1].get("bubble_per_stage") if bubbles else None,
        "steps": [s["step"] for s in steps], "losses": [s["loss"] for s in steps], "lrs": [s.get("lr") for s in steps],
        "final_loss": steps[-1]["loss"] if steps else None, "wall_s": launched["wall_s"],
        **_peer_fields(ranks[0]),
    }


def _peer_fields(rank0: dict) -> dict:
    """A peer's framework and version, torch's, every shim it needed and its parameter count (one replica)."""
    if not rank0.get("peer"):
        return {}
    return {"framework": f"{rank0['peer']} {rank0['peer_version']}", "framework_torch": rank0["torch_version"],
            "patches": rank0["patches"], "parameters": rank0["parameters_total"]}


def peer_notes(rows: list[dict]) -> list[str]:
    """One paragraph per peer framework: its version and every shim it ran with (compare/peer_shims.py)."""
    out, seen = [], set()
    for r in rows:
        if r.get("framework") and r["framework"] not in seen:
            seen.add(r["framework"])
            out += ["", f"{r['framework']} (torch {r['framework_torch']}; {r['parameters']:,} parameters in "
                        f"{r['scheme']}) ran with these shims, applied in its own process, nothing in "
                        f"site-packages edited: " + "; ".join(r["patches"]) + "."]
    if out:
        out += ["", "Communication columns count mtds's collectives (its tracer); a peer's are 0 there (not "
                    "traced): on an emulated cluster compare the link columns, read from the same kernel "
                    "counters for every scheme."]
    return out


def _link_per_step(ranks: list[dict], warmup: int, ranks_per_node: int | None) -> float | None:
    """Mean bytes a node's link sent per timed step. All ranks of a node read the same counters, each
    around its own steps; ranks whose steps are not aligned (no collective ends them together) see only
    part of the node's traffic in their own window, so the node's window runs from the earliest start of
    its first timed step to the latest end of its last (absolute counters), else its first rank's."""
    per_node = {}
    for r in ranks:
        steps = (r.get("link_per_step") or [])[warmup:]
        if not (steps and ranks_per_node):
            continue
        node = r["rank"] // ranks_per_node
        if "tx_at_start" in steps[0]:
            start, end = per_node.get(node, (None, None, 0))[:2]
            start = min(steps[0]["tx_at_start"], start if start is not None else steps[0]["tx_at_start"])
            end = max(steps[-1]["tx_at_end"], end if end is not None else steps[-1]["tx_at_end"])
            per_node[node] = (start, end, len(steps))
        elif r["rank"] % ranks_per_node == 0:
            per_node[node] = (0, sum(s["tx_bytes"] for s in steps), len(steps))
    values = [(end - start) / n for start, end, n in per_node.values()]
    return sum(values) / len(values) if values else None


def _traced_by_node(ranks: list[dict], warmup: int, ranks_per_node: int | None) -> dict:
    """Traced bytes a node's ranks send per timed step to peers on other nodes (what its link must carry)
    and to each other (loopback), from the tracer's placement split; averaged over nodes and steps.
    {} when the tracer did not split (no ranks_per_node)."""
    if not ranks_per_node:
        return {}
    inter, intra, by_kind = {}, {}, {}
    for r in ranks:
        steps = r["comm_per_step"][warmup:] or r["comm_per_step"]
        if not steps or not any("inter_bytes" in v for v in steps[0].values()):
            return {}
        node = r["rank"] // ranks_per_node
        for step in steps:
            for key, v in step.items():
                inter[node] = inter.get(node, 0) + v.get("inter_bytes", 0) / len(steps)
                intra[node] = intra.get(node, 0) + v.get("intra_bytes", 0) / len(steps)
                if v.get("inter_bytes"):
                    by_kind[key] = by_kind.get(key, 0) + v["inter_bytes"] / len(steps)
    nodes = len(inter)
    return {"traced_inter_bytes_per_step_per_node": sum(inter.values()) / nodes,
            "traced_intra_bytes_per_step_per_node": sum(intra.values()) / nodes,
            "traced_inter_by_kind_per_node": {k: v / nodes for k, v in sorted(by_kind.items())}}


def _model_state(ranks: list[dict], scheme, config_path: str | None) -> dict:
    """The rank holding the most model state (measured, compare.state) beside the ZeRO formula for the
    scheme's ZeRO stage and precision, its Ψ and its data-parallel size."""
    measured = [r for r in ranks if r.get("model_state")]
    if not measured or not config_path:
        return {}
    from mtds.training.ds_config import precision, zero_stage

    from .state import BUCKETS, formula
    with open(config_path) as f:
        config = json.load(f)
    top = max(measured, key=lambda r: sum(r["model_state"][b] for b in BUCKETS))
    state = {**top["model_state"], "rank": top["rank"]}
    state["total"] = sum(state[b] for b in BUCKETS)
    dp = top["world"] // (scheme.tp * scheme.pp)
    return {"model_state": state, "model_state_formula": formula(precision(config), zero_stage(config),
                                                                  state["psi"], dp, state.get("psi_persistent", 0))}


def fmt_bytes(n) -> str:
    if n is None:
        return "-"
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# PTD-P vs ZeRO-3 on this machine ({meta['nproc']} ranks, model {meta['model']}, "
             f"{meta['steps']} steps, seq {meta['seq_length']})", "",
             "| scheme | (t,p,d) | tokens/s | TFLOP/s/rank model | TFLOP/s/rank hw | peak mem GiB | "
             "all-reduce B | all-gather B (shard) | reduce-scatter B | p2p send B | final loss |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        fam = r["comm_by_family_max_rank"]
        lines.append(f"| {r['scheme']} | ({r['tp']},{r['pp']},{r['dp']}) | {r['tokens_per_s']:,.0f} | "
                     f"{r['tflops_model_per_rank']:.4f} | {r['tflops_hw_per_rank']:.4f} | {r['peak_mem_gib']:.3f} | "
                     f"{fmt_bytes(fam['all_reduce'])} | {fmt_bytes(fam['all_gather'])} | "
                     f"{fmt_bytes(fam['reduce_scatter'])} | {fmt_bytes(fam['p2p_send'])} | {r['final_loss']:.4f} |")
    if meta.get("loss_agreement"):
        lines += ["", meta["loss_agreement"]]
    if learning_rate(rows):
        lines += ["", learning_rate(rows)]
    lines += peer_notes(rows)
    lines += ["", "Peak memory is peak RSS per process on CPU (includes the Python/torch/DeepSpeed runtime). "
              "Communication columns are payload bytes per rank in the last step (max over ranks), counted from "
              "before DeepSpeed starts (so ZeRO's cached all-gather / reduce-scatter calls are included); one "
              "column per collective family, because an all-gather's payload is a shard and an all-reduce's "
              "the full tensor."]
    return "\n".join(lines) + "\n"


def learning_rate(rows: list[dict]) -> str:
    """The learning rate the schemes trained with, read from their step logs. compare run gives every scheme
    the same constant one (``--lr-decay constant``, no warm-up; the HF baselines a constant LambdaLR), so that
    their losses compare step for step and no schedule hides a difference."""
    values = [lr for r in rows for lr in r.get("lrs") or () if lr is not None]
    if not values:
        return ""
    if min(values) == max(values):
        return (f"Learning rate: constant {values[0]:.2e} at every step of every scheme (`--lr-decay constant`, no "
                f"warm-up: the DeepSpeed config's `optimizer.params.lr`), so that the losses compare step for step; "
                f"train.py's own default warms up and decays (cosine).")
    return f"Learning rate: from {min(values):.2e} to {max(values):.2e} over the steps and schemes."


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
