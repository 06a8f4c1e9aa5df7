"""Render planner results: a rich table for people, JSON-ready dicts for scripts."""
from __future__ import annotations

from mtds.plan.candidate import Workload
from mtds.plan.hardware import Cluster
from mtds.plan.model_spec import ModelSpec
from mtds.plan.predict import Prediction
from mtds.plan.search import PlanResult

TIME_PARTS = ("compute", "tp_comm", "pp_comm", "dp_comm", "bubble")


def context_dict(model: ModelSpec, work: Workload, cluster: Cluster) -> dict:
    """The inputs of a prediction, echoed in every JSON answer."""
    return {
        "model": {"name": model.name, "layers": model.layers, "hidden": model.hidden, "heads": model.heads,
                  "vocab": model.vocab, "seq": model.seq, "ffn_hidden": model.ffn, "params": model.params},
        "cluster": {"gpu": cluster.gpu.name, "gpus": cluster.gpus, "gpus_per_node": cluster.per_node,
                    "nodes": cluster.nodes, "peak_tflops": cluster.gpu.peak_tflops,
                    "intra_gbps": cluster.intra_gbps or cluster.gpu.nvlink_gbps,
                    "inter_gbps": cluster.inter_gbps or cluster.gpu.internode_gbps},
        "workload": {"global_batch": work.global_batch, "precision": work.precision,
                     "train_tokens": work.train_tokens},
    }


def plan_dict(model, work, cluster, result: PlanResult, top: int | None, show_infeasible: bool) -> dict:
    ranked = result.feasible if top is None else result.feasible[:top]
    out = {**context_dict(model, work, cluster), "feasible_count": len(result.feasible),
           "layouts": [pr.as_dict() for pr in ranked]}
    if show_infeasible:
        out["infeasible"] = [{**lay.as_dict(), "reasons": list(reasons)} for lay, reasons in result.infeasible]
    return out




def _split(pr: Prediction) -> str:
    """Step-time split in percent: compute/tp/pp/dp/bubble (+ cp: context-parallel traffic, where c > 1)."""
    split = "/".join(f"{100 * pr.time_breakdown_s[k] / pr.step_time_s:.0f}" for k in TIME_PARTS)
    if "cp_comm" in pr.time_breakdown_s:
        split += f" +cp {100 * pr.time_breakdown_s['cp_comm'] / pr.step_time_s:.0f}"
    return split


def _mem(pr: Prediction) -> str:
    g = pr.memory.gib()
    return f"{g['total']:.1f} ({g['params']:.1f}/{g['grads']:.1f}/{g['optimizer']:.1f}/{g['activations']:.1f})"


def render_table(model, work, cluster, predictions: list, title: str, console=None) -> None:
    """Print ranked predictions as a rich table."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title=title, caption="layout = t c/cp-comm(context parallel, c > 1) p d b(microbatch) v(virtual stages) z(ZeRO) recompute[+sp] "
                                       "schedule; * = train.py cannot run it yet (--json: not_runnable); "
                                       "TFLOP/s = hardware/model; time split % = compute/TP/PP/DP/bubble; "
                                       "memory GiB = total (params/grads/optimizer/activations)")
    table.add_column("#", justify="right")
    table.add_column("layout", no_wrap=True)
    for col in ("step s", "TFLOP/s", "MFU", "memory GiB", "time split %", "days"):
        table.add_column(col, justify="right")
    for i, pr in enumerate(predictions, 1):
        table.add_row(str(i), pr.layout.short() + (" *" if pr.not_runnable else ""), f"{pr.step_time_s:.3g}",
                      f"{pr.tflops_per_gpu:.0f}/{pr.model_tflops_per_gpu:.0f}",
                      f"{100 * pr.mfu:.1f}%", _mem(pr), _split(pr),
                      f"{pr.days_to_train:.1f}")
    console.print(f"[bold]{model}[/bold] on {cluster.gpus} x {cluster.gpu.name} "
                  f"({cluster.nodes} nodes x {cluster.per_node}), global batch {work.global_batch}, {work.precision}")
    console.print(table)


def render_infeasible(infeasible: list, console=None, limit: int = 50) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title=f"Infeasible layouts ({len(infeasible)}; first {min(limit, len(infeasible))})")
    for col in ("layout", "reason"):
        table.add_column(col)
    for lay, reasons in infeasible[:limit]:
        table.add_row(lay.short(), "; ".join(reasons))
    console.print(table)


def render_text(pr: Prediction) -> str:
    """Plain one-layout summary (no rich), for non-TTY output."""
    lines = [f"layout: {pr.layout.short()}",
             f"step time: {pr.step_time_s:.4g} s  (split {_split(pr)} % compute/tp/pp/dp/bubble)",
             f"TFLOP/s per GPU: {pr.tflops_per_gpu:.1f} hardware, {pr.model_tflops_per_gpu:.1f} model; "
             f"MFU {100 * pr.mfu:.1f}%",
             f"memory per GPU: {_mem(pr)} of {pr.memory_capacity_gib:.0f} GiB; fits={pr.fits}",
             f"days to train: {pr.days_to_train:.1f}"]
    if pr.stages:
        lines.append(partition_line(pr))
    if pr.reasons:
        lines.append("infeasible: " + "; ".join(pr.reasons))
    if pr.not_runnable:
        lines.append("not runnable: " + "; ".join(pr.not_runnable))
    return "\n".join(lines)


def partition_line(pr: Prediction) -> str:
    """The pipeline partition modelled: per-rank compute per micro-batch, the critical rank, memory,
    and the cost partition priced on this cluster (mtds.plan.balance), which train.py builds only when
    passed as --pipeline-layout: its own ``cost`` prices on REFERENCE_GPU so every rank decides alike."""
    st = pr.stages
    line = (f"pipeline layout: {st['pipeline_layout']}; per-rank compute per micro-batch "
            f"{' / '.join(f'{x:.3g}' for x in st['rank_ms'])} ms (critical rank {st['critical_rank']}, "
            f"{st['imbalance']:.2f}x the mean); memory {' / '.join(f'{x:.1f}' for x in st['rank_memory_gib'])} GiB")
    if "recommended" in st:
        line += (f"; recommended for this cluster (--pipeline-layout): {st['recommended']}, "
                 f"step {st['recommended_step_time_s']:.4g} s")
    return line
