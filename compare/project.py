"""Project schemes to a GPU cluster with the planner (mtds.plan) next to PTD-P's Table 2.

Narayanan et al. 2021 (arXiv 2104.04473) Table 2 compares PTD-P with ZeRO-3 (no model parallelism)
for GPT-3 175B and 530B on A100-80GB at fixed global batch: achieved TFLOP/s per GPU (hardware
FLOPs, full recomputation) and days to train 300B tokens. The same layouts go through the planner's
``predict`` and both numbers are printed side by side.
"""
from __future__ import annotations

# Model shapes of Table 2 (PTD-P Table 1 rows): layers, hidden, heads; seq 2048, vocab 51200.
PAPER_MODELS = {174.6: (96, 12288, 96), 529.6: (105, 20480, 128)}
PAPER_TP = 8          # PTD-P rows use t = 8 (model_parallel = t x p)


class PlannerUnavailable(RuntimeError):
    pass


def _planner():
    try:
        from mtds.plan.candidate import Candidate, Workload
        from mtds.plan.hardware import Cluster, get_gpu
        from mtds.plan.model_spec import ModelSpec, resolve_model
        from mtds.plan.predict import predict
        from mtds.plan.tables import load_table
    except ImportError as err:
        raise PlannerUnavailable(f"the planner (mtds.plan) is not available here ({err}); `compare project` "
                                 f"needs it — `compare run` works without it") from None
    return Candidate, Workload, Cluster, get_gpu, ModelSpec, resolve_model, predict, load_table


def paper_rows(gpu: str = "A100-80GB", precision: str = "fp16") -> list[dict]:
    Candidate, Workload, Cluster, get_gpu, ModelSpec, _, predict, load_table = _planner()
    rows = []
    for row in load_table("ptdp_vs_zero3_2021_table2.csv"):
        l, h, a = PAPER_MODELS[row["params_billion"]]
        model = ModelSpec(layers=l, hidden=h, heads=a, vocab=51200, seq=2048)
        mp, gpus = row["model_parallel"], row["gpus"]
        if row["scheme"] == "ptdp":
            layout = Candidate(tp=PAPER_TP, pp=mp // PAPER_TP, dp=gpus // mp, microbatch=row["microbatch"],
                            zero_stage=0, recompute="full")
        else:
            layout = Candidate(tp=1, pp=1, dp=gpus, microbatch=row["microbatch"], zero_stage=3, recompute="full")
        pred = predict(model, layout, Workload(row["global_batch"], precision), Cluster(get_gpu(gpu, precision), gpus))
        rows.append({"model_B": row["params_billion"], "scheme": row["scheme"], "gpus": gpus,
                     "layout": layout.short(), "global_batch": row["global_batch"],
                     "paper_tflops": row["tflops_per_gpu"], "predicted_tflops": pred.tflops_per_gpu,
                     "paper_days": row["days_for_300B_tokens"], "predicted_days": pred.days_to_train,
                     "fits": pred.fits, "reasons": list(pred.reasons)})
    return rows


def scheme_rows(schemes, model_name: str, gpus: int, global_batch: int, microbatch: int, gpu: str,
                precision: str) -> list[dict]:
    """The user's schemes (tp/pp/cp from the spec, d = gpus / (t c p)) projected for one model."""
    Candidate, Workload, Cluster, get_gpu, _, resolve_model, predict, _ = _planner()
    model = resolve_model(model_name)
    rows = []
    for s in schemes:
        layout = Candidate(tp=s.tp, pp=s.pp, dp=s.data_parallel(gpus), microbatch=microbatch,
                        zero_stage=s.zero_stage, recompute="full", sequence_parallel=bool(s.sp), cp=s.cp,
                        cp_comm_type=s.comm)
        pred = predict(model, layout, Workload(global_batch, precision), Cluster(get_gpu(gpu, precision), gpus))
        rows.append({"scheme": s.name, "gpus": gpus, "layout": layout.short(), "global_batch": global_batch,
                     "predicted_tflops": pred.tflops_per_gpu, "predicted_days": pred.days_to_train,
                     "memory_gib": pred.memory.gib()["total"], "fits": pred.fits, "reasons": list(pred.reasons)})
    return rows


def markdown(rows: list[dict], title: str) -> str:
    has_paper = any("paper_tflops" in r for r in rows)
    head = ["model", "scheme", "GPUs", "layout", "B"] if has_paper else ["scheme", "GPUs", "layout", "B"]
    head += ["paper TFLOP/s/GPU", "predicted", "paper days", "predicted days"] if has_paper else \
        ["predicted TFLOP/s/GPU", "predicted days", "mem GiB/GPU"]
    lines = [f"# {title}", "", "| " + " | ".join(head) + " | note |", "|" + "---|" * (len(head) + 1)]
    for r in rows:
        cells = ([f"{r['model_B']}B"] if has_paper else []) + [r["scheme"], str(r["gpus"]), r["layout"],
                                                                 str(r["global_batch"])]
        if has_paper:
            cells += [f"{r['paper_tflops']}", f"{r['predicted_tflops']:.0f}", f"{r['paper_days']}",
                      f"{r['predicted_days']:.0f}"]
        else:
            cells += [f"{r['predicted_tflops']:.0f}", f"{r['predicted_days']:.0f}", f"{r['memory_gib']:.1f}"]
        note = "; ".join(r["reasons"]) if r["reasons"] else ("" if r["fits"] else "does not fit")
        lines.append("| " + " | ".join(cells) + f" | {note} |")
    return "\n".join(lines) + "\n"
