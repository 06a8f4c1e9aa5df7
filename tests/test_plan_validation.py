"""The planner's analytical model against published measurements shipped in mtds/plan/data.

Sources: Narayanan et al. 2021 (arXiv 2104.04473) Tables 1 and 2; Korthikanti et al. 2022
(arXiv 2205.05198) Tables 3 and 5. One calibration (A100) for all rows; no per-row constants.
Layout knobs the papers state are fixed; the rest (virtual stages) are chosen by the planner.
"""
import pytest

from mtds.observe import metrics
from mtds.plan.candidate import Workload
from mtds.plan.hardware import Cluster, get_gpu
from mtds.plan.model_spec import ModelSpec
from mtds.plan.search import evaluate, plan
from mtds.plan.tables import load_table, source_comment

A100 = get_gpu("A100-80GB")
TABLE1 = load_table("ptdp_2021_table1.csv")
TABLE2 = load_table("ptdp_vs_zero3_2021_table2.csv")
K3 = load_table("korthikanti_2022_table3.csv")
K5 = {r["model"]: r for r in load_table("korthikanti_2022_table5.csv")}
SIZES = {174.6: (96, 12288, 96), 529.6: (105, 20480, 128)}   # layers, hidden, heads (Table 2 models)
# PTD-P 2021 setting: Megatron's schedules (1F1B, interleaved), whether or not train.py runs them yet
MEGATRON_SCHEDULES = ("1f1b", "interleaved")
PAPER = dict(recompute="full", sequence_parallel=False, zero_stage=0, pipeline_schedule=MEGATRON_SCHEDULES,
             runnable_only=False)


def gpt(layers, hidden, heads):
    return ModelSpec(layers=layers, hidden=hidden, heads=heads, vocab=51200, seq=2048)


def rel(pred, ref):
    return pred / ref - 1.0


def test_tables_keep_their_source():
    assert "2104.04473" in source_comment("ptdp_2021_table1.csv")
    assert "2205.05198" in source_comment("korthikanti_2022_table5.csv")
    assert len(TABLE1) == 10 and len(TABLE2) == 12 and len(K5) == 4


@pytest.mark.parametrize("row", TABLE1, ids=lambda r: f"{r['params_billion']}B")
def test_ptdp_table1_tflops_within_10pct(row):
    model = gpt(row["layers"], row["hidden"], row["heads"])
    assert model.params / 1e9 == pytest.approx(row["params_billion"], rel=0.03)
    pr = evaluate(model, Workload(row["global_batch"]), Cluster(A100, row["gpus"]), tp=row["tp"], pp=row["pp"],
                  dp=row["dp"], microbatch=row["microbatch"], **PAPER)
    assert pr.fits, pr.reasons
    assert abs(rel(pr.tflops_per_gpu, row["tflops_per_gpu"])) <= 0.10, (pr.tflops_per_gpu, row)


def _table2_prediction(row):
    layers, hidden, heads = SIZES[row["params_billion"]]
    model = gpt(layers, hidden, heads)
    cluster, work = Cluster(A100, row["gpus"]), Workload(row["global_batch"])
    if row["scheme"] == "zero3":
        return evaluate(model, work, cluster, tp=1, pp=1, microbatch=row["microbatch"], zero_stage=3,
                        recompute="full", sequence_parallel=False)
    t = 8
    return evaluate(model, work, cluster, tp=t, pp=row["model_parallel"] // t, microbatch=row["microbatch"], **PAPER)


@pytest.mark.parametrize("row", TABLE2, ids=lambda r: f"{r['params_billion']}B-{r['scheme']}-{r['gpus']}")
def test_ptdp_vs_zero3_table2_within_15pct(row):
    pr = _table2_prediction(row)
    assert pr.fits, pr.reasons           # every layout the paper ran must be predicted to fit
    assert abs(rel(pr.tflops_per_gpu, row["tflops_per_gpu"])) <= 0.15, (pr.tflops_per_gpu, row)
    # days for 300B tokens follow from the same step time (the paper's 8 T P / (n X))
    assert pr.days_to_train == pytest.approx(row["days_for_300B_tokens"], rel=0.25)


def test_table2_trends_zero3_collapses_ptdp_holds():
    rows = [r for r in TABLE2 if r["params_billion"] == 174.6]
    z = {r["gpus"]: _table2_prediction(r).tflops_per_gpu for r in rows if r["scheme"] == "zero3"}
    p = {r["gpus"]: _table2_prediction(r).tflops_per_gpu for r in rows if r["scheme"] == "ptdp"}
    assert z[384] / z[1536] > 2.5           # paper: 144 -> 44 (3.3x) as GPUs quadruple at fixed batch
    assert z[384] > z[768] > z[1536]
    assert min(p.values()) / max(p.values()) > 0.85   # paper: 153 / 149 / 141
    assert all(135 <= v <= 175 for v in p.values())


def test_korthikanti_configs_match_reported_mfu():
    """Transcription check: Table 3 configs + Table 5 times reproduce the paper's MFU column."""
    for row in K3:
        f = metrics.model_flops_per_iteration(row["global_batch"], 2048, row["layers"], row["hidden"], 51200)
        mfu = f / (row["gpus"] * K5[row["model"]]["iter_s_sp_selective"] * 312e12)
        assert 100 * mfu == pytest.approx(K5[row["model"]]["mfu_pct"], rel=0.01)


@pytest.mark.parametrize("row", K3, ids=lambda r: r["model"])
@pytest.mark.parametrize("mode", ["full", "sp_selective"])
def test_korthikanti_table5_iteration_time_within_15pct(row, mode):
    model = gpt(row["layers"], row["hidden"], row["heads"])
    d = row["gpus"] // (row["tp"] * row["pp"])
    knobs = dict(recompute="full", sequence_parallel=False) if mode == "full" else \
        dict(recompute="selective", sequence_parallel=True)
    pr = evaluate(model, Workload(row["global_batch"]), Cluster(A100, row["gpus"]), tp=row["tp"], pp=row["pp"],
                  dp=d, microbatch=row["microbatch"], zero_stage=0, pipeline_schedule=MEGATRON_SCHEDULES,
                  runnable_only=False, **knobs)
    ref = K5[row["model"]]["iter_s_full_recompute" if mode == "full" else "iter_s_sp_selective"]
    assert pr.fits, pr.reasons
    assert abs(rel(pr.step_time_s, ref)) <= 0.15, (pr.step_time_s, ref)


# Known misses (reported, not tuned away): even with fp32 gradient accumulation (memory and a
# per-microbatch pass), NCCL-level NVLink efficiency and allocator fragmentation, the model predicts
# a smaller-t / deeper interleaved pipeline to be faster than the paper's t=8 layout by more than 3%
# for these rows (18.4B: t2 p4 v5 b2 by 13%; 39.1B: t4 p4 v6 b3 by 9%; 145.6B: t4 p16 v5 b2 by 3.4%).
# See docs/planner.md. strict=True: if the model changes and they pass, the marker must go.
RECOMMENDATION_MISSES = {18.4, 39.1, 145.6, 529.6}


def _maybe_xfail(row):
    if row["params_billion"] in RECOMMENDATION_MISSES:
        return pytest.param(row, marks=pytest.mark.xfail(strict=True, reason="model prefers another layout by >3%; see docs/planner.md"))
    return row


def _megatron_runs(layout, work) -> bool:
    """The paper's option space: Megatron-LM's interleaved schedule takes micro-batch counts divisible by p
    only (mtds's order also runs m % (m // p) == 0, which train.py and so the planner accept)."""
    return layout.pipeline_schedule != "interleaved" or layout.microbatches(work.global_batch) % layout.pp == 0


@pytest.mark.parametrize("row", [_maybe_xfail(r) for r in TABLE1], ids=lambda r: f"{r['params_billion']}B")
def test_recommended_layout_is_papers_or_within_3pct(row):
    """Searching the paper's option space (full recompute, no SP, no ZeRO) on its cluster and
    batch must recommend its layout, or one predicted at most 3% faster."""
    model = gpt(row["layers"], row["hidden"], row["heads"])
    work, cluster = Workload(row["global_batch"]), Cluster(A100, row["gpus"])
    best = next(pr for pr in plan(model, work, cluster, **PAPER).feasible if _megatron_runs(pr.layout, work))
    paper = evaluate(model, work, cluster, tp=row["tp"], pp=row["pp"], dp=row["dp"],
                     microbatch=row["microbatch"], **PAPER)
    same = (best.layout.tp, best.layout.pp, best.layout.microbatch) == (row["tp"], row["pp"], row["microbatch"])
    assert same or paper.step_time_s <= 1.03 * best.step_time_s, (best.layout, paper.layout,
                                                                  best.step_time_s, paper.step_time_s)
