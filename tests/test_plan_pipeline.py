"""Pipeline schedules as planner knobs: bubble and memory formulas against simulations of the orders
that run, the runnable-features gate, and sequence parallelism's shared-gradient all-reduce."""
import json

import pytest

from lab.pipe_sim.dualpipev_sim import deepspeed_dualpipev_actions, simulate_deepspeed_dualpipev
from lab.pipe_sim.simulate import peak_in_flight, simulate_schedule, validate
from mtds.plan.candidate import Candidate, Workload
from mtds.plan.hardware import Cluster, get_gpu
from mtds.plan.memory import in_flight_layers
from mtds.plan.model_spec import ModelSpec
from mtds.plan.pipeline import activation_factor, bubble_time
from mtds.plan.predict import predict, sequence_parallel_grad_time
from mtds.plan.search import evaluate, plan

A100 = get_gpu("A100-80GB")
GPT3 = ModelSpec(layers=96, hidden=12288, heads=96, vocab=51200, seq=2048)


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("m_per_p", [1, 2])
def test_planner_bubble_equals_simulated_idle(p, m_per_p):
    m = m_per_p * p
    # stage costs f, b, w per micro-batch; the simulator's chunk costs are those divided by v
    assert bubble_time("1f1b", p, 1, 1, 1, 1) == simulate_schedule("1f1b", p, 1, m).idle[0]
    for v in (2, 3):
        sim = simulate_schedule("interleaved", p, v, m)
        assert bubble_time("interleaved", p, v, v, v, v) == sim.idle[0]
    assert bubble_time("zb-h1", p, 1, 1, 1, 1) == simulate_schedule("zb-h1", p, 1, m).idle[0]
    costs = {"F": 3, "B": 4, "W": 2}
    assert bubble_time("zb-h1", p, 1, 3, 4, 2) == simulate_schedule("zb-h1", p, 1, m, costs=costs).idle[0]


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("chunk", [(1, 2), (1, 1), (1, 3), (2, 3)])
def test_dualpipev_formula_bounds_deepspeeds_own_order(p, chunk):
    # DeepSpeed's DualPipeVSchedule (not ours), simulated with its batched-commit p2p: every rank idles
    # the planner's (p-1)(F/2 + B + W) (stage units) minus at most one chunk forward
    f_chunk, b_chunk = chunk   # chunk = half a stage; B is the full backward (B + W of the stage)
    for m in (2 * p, 2 * p + 1, 4 * p):
        for rendezvous in (False, True):   # sends complete at the sender's commit, or only when matched
            sim = simulate_deepspeed_dualpipev(p, m, {"F": f_chunk, "B": b_chunk}, rendezvous=rendezvous)
            formula = bubble_time("dualpipev", p, 2, 2 * f_chunk, 2 * b_chunk, 0)
            assert all(0 <= formula - idle <= f_chunk for idle in sim.idle), (sim.idle, formula)


def test_dualpipev_overlapped_pairs_are_the_planners():
    """Rank r of DeepSpeed's DualPipeV order runs 2m − 3p + 1 + r of its 2m chunk forwards right before the other
    chunk's backward (an overlapped pair): the count mtds.plan.ep_comm.overlapped_share takes (rank 0's)."""
    from lab.pipe_sim.dualpipev_sim import deepspeed_dualpipev_steps
    from mtds.plan.ep_comm import overlapped_share
    for p, m in ((2, 4), (2, 16), (3, 6), (4, 8), (4, 32)):
        for r in range(p):
            passes = [s for s in deepspeed_dualpipev_steps(p, m, r) if s[0] in "FB"]
            pairs = sum(a[0] == "F" and b[0] == "B" and a[1] != b[1] for a, b in zip(passes, passes[1:]))
            assert pairs == 2 * m - 3 * p + 1 + r, (p, m, r, pairs)
        lay = Candidate(1, p, 2, 1, pipeline_schedule="dualpipev", overlap_moe_expert_parallel_comm=True)
        assert overlapped_share(lay, m) == (2 * m - 3 * p + 1) / (2 * m)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_dualpipev_order_is_complete_and_holds_2p_plus_1_chunks(p):
    m = 2 * p + 1
    orders = [deepspeed_dualpipev_actions(p, m, r) for r in range(p)]
    validate(orders, p=p, v=2, m=m, weight_pass=False)
    # 2p + 1 chunk activations of l/(2p) layers: the planner's factor over 1F1B's l layers
    assert [peak_in_flight(o, False) for o in orders] == [2 * p + 1] * p
    assert activation_factor("dualpipev", p, 2) == pytest.approx((2 * p + 1) / (2 * p))


def test_in_flight_activations_per_schedule():
    work = Workload(1536)
    base = in_flight_layers(GPT3, Candidate(8, 12, 16, 1), work)
    assert base == pytest.approx(96)                     # p micro-batches of l/p layers
    assert in_flight_layers(GPT3, Candidate(8, 12, 16, 1, pipeline_schedule="zb-h1"), work) == base
    assert in_flight_layers(GPT3, Candidate(8, 12, 16, 1, 2, pipeline_schedule="interleaved"), work) == \
        pytest.approx(96 * (1 + 11 / 24))
    assert in_flight_layers(GPT3, Candidate(8, 12, 16, 1, 2, pipeline_schedule="dualpipev"), work) == \
        pytest.approx(96 * (1 + 1 / 24))


def test_schedule_changes_only_the_bubble_and_p2p():
    work, cluster = Workload(1536), Cluster(A100, 1536)
    knobs = dict(tp=8, pp=12, dp=16, microbatch=1, zero_stage=0, recompute="full")
    one = predict(GPT3, Candidate(**knobs), work, cluster)
    zb = predict(GPT3, Candidate(**knobs, pipeline_schedule="zb-h1"), work, cluster)
    il = predict(GPT3, Candidate(**knobs, virtual_stages=4), work, cluster)
    dv = predict(GPT3, Candidate(**knobs, virtual_stages=2, pipeline_schedule="dualpipev"), work, cluster)
    assert il.layout.pipeline_schedule == "interleaved" and one.layout.pipeline_schedule == "1f1b"
    for pr in (zb, il, dv):
        assert pr.feasible, pr.reasons
        assert pr.time_breakdown_s["compute"] == one.time_breakdown_s["compute"]
    b = {name: pr.time_breakdown_s["bubble"] for name, pr in (("1f1b", one), ("zb", zb), ("il", il), ("dv", dv))}
    assert b["il"] == pytest.approx(b["1f1b"] / 4)
    assert b["zb"] < b["dv"] < b["1f1b"]
    assert dv.time_breakdown_s["pp_comm"] > il.time_breakdown_s["pp_comm"] / 2   # no scatter/gather


def test_pipeline_messages_and_the_tied_embedding_all_reduce():
    """pp_comm is the schedule's messages (1/t of s b h each with PTD-P's scatter/gather, the whole activation
    without it: Megatron-core's) plus, with a tied head only, the embedding-gradient all-reduce between the
    first and last stage (an untied head has nothing to keep equal: llama-tiny's link counters show none)."""
    from dataclasses import replace

    from mtds.plan import comm
    from mtds.plan.pipeline import p2p_messages
    work, cluster = Workload(64), Cluster(A100, 32)
    model = ModelSpec(layers=8, hidden=1024, heads=16, vocab=32000, seq=1024, untied_head=True)
    knobs = dict(tp=8, pp=4, dp=1, microbatch=1, zero_stage=1, recompute="none")
    act = 1024 * 1 * 1024 * 2                                # s b h, bf16
    messages = p2p_messages("1f1b", 4, 1, 64)
    untied = predict(model, Candidate(**knobs), work, cluster).time_breakdown_s["pp_comm"]
    split = comm.p2p(act / 8, True, cluster) + comm.all_gather(act, 8, 1, cluster)
    assert untied == pytest.approx(messages * split)
    whole = predict(model, Candidate(**knobs, pipeline_scatter_gather=False), work, cluster).time_breakdown_s["pp_comm"]
    assert whole == pytest.approx(messages * comm.p2p(act, True, cluster))
    tied = predict(replace(model, untied_head=False), Candidate(**knobs), work, cluster).time_breakdown_s["pp_comm"]
    assert tied > untied * 1.01


def test_schedule_constraints_are_reported():
    work, cluster = Workload(16), Cluster(A100, 16)
    model = ModelSpec(layers=24, hidden=2048, heads=16, vocab=51200, seq=2048)

    def reasons(b, v, schedule=""):   # t=2, p=4, d=2: m = 16 / (2 b)
        return predict(model, Candidate(2, 4, 2, b, v, pipeline_schedule=schedule), work, cluster).reasons

    assert any("cannot split 2 micro-batches into equal groups of at least the pipeline size (4)" in r
               for r in reasons(4, 2))                                           # interleaved, m = 2
    assert any("at least 2 x pp = 8 micro-batches per step, got 4" in r for r in reasons(2, 2, "dualpipev"))
    assert reasons(1, 2, "dualpipev") == ()                                      # m = 8
    assert any("v=2" in r for r in reasons(1, 3, "dualpipev"))
    assert any("zb-h1 runs one chunk per rank" in r for r in reasons(1, 2, "zb-h1"))


def _refuse(monkeypatch, schedule):
    """The rulebook with one rule more: train.py would refuse ``schedule`` as not built (as a new schedule
    stands until train.py runs it), so the planner must stop recommending it."""
    from mtds.rules import NOT_BUILT, Rule, book
    line = f"train.py cannot run --pipeline-schedule {schedule} yet"
    rule = Rule(f"no-{schedule}", lambda job: line if job.pp > 1 and job.pipeline_schedule == schedule else None,
                "--pipeline-schedule", "a test's", kind=NOT_BUILT)
    monkeypatch.setattr(book, "ALL_RULES", book.ALL_RULES + (rule,))


def test_planner_recommends_only_what_train_py_runs(monkeypatch):
    work, cluster = Workload(1536), Cluster(A100, 1536)
    res = plan(GPT3, work, cluster)
    assert res.feasible and all(not pr.not_runnable for pr in res.feasible)
    assert res.best.layout.pipeline_schedule == "interleaved"
    assert any(pr.layout.pipeline_schedule == "zb-h1" for pr in res.feasible)    # bf16 zb-h1 runs now
    _refuse(monkeypatch, "zb-h1")
    res = plan(GPT3, work, cluster)
    everything = plan(GPT3, work, cluster, runnable_only=False)
    flagged = [pr for pr in everything.feasible if pr.not_runnable]
    assert flagged and len(everything.feasible) > len(res.feasible)
    assert {pr.layout.pipeline_schedule for pr in flagged} == {"zb-h1"}
    # one rule more in the rulebook takes the schedule out of the recommendations
    _refuse(monkeypatch, "interleaved")
    now = plan(GPT3, work, cluster)
    assert now.best.layout.pipeline_schedule != "interleaved" and not now.best.not_runnable
    assert now.best.step_time_s > res.best.step_time_s


def test_evaluating_an_unrunnable_layout_flags_it(monkeypatch):
    def zb_h1(precision):
        return evaluate(GPT3, Workload(1536, precision=precision), Cluster(A100, 1536), tp=8, pp=12,
                        microbatch=1, recompute="full", pipeline_schedule="zb-h1")
    for precision in ("bf16", "fp32"):        # zb-h1 runs in every precision
        assert zb_h1(precision).not_runnable == () and zb_h1(precision).as_dict()["runnable"] is True
    _refuse(monkeypatch, "zb-h1")
    pr = zb_h1("bf16")
    assert pr.layout.pipeline_schedule == "zb-h1" and pr.feasible
    assert pr.not_runnable == ("train.py cannot run --pipeline-schedule zb-h1 yet",)
    assert pr.as_dict()["runnable"] is False


def test_sequence_parallel_shared_grads_once_per_step_for_zero01():
    work, cluster = Workload(512), Cluster(A100, 64)
    model = ModelSpec(layers=24, hidden=4096, heads=32, vocab=51200, seq=2048)
    z1 = Candidate(8, 1, 8, 1, zero_stage=1, recompute="selective", sequence_parallel=True)
    z2 = Candidate(8, 1, 8, 1, zero_stage=2, recompute="selective", sequence_parallel=True)
    m = z1.microbatches(work.global_batch)
    once, per_use = (sequence_parallel_grad_time(model, lay, work, cluster, m) for lay in (z1, z2))
    assert 0 < once and per_use > 10 * once      # m x 146 latency-bound all-reduces vs one bucket
    no_sp = Candidate(8, 1, 8, 1, zero_stage=1, recompute="selective")
    assert sequence_parallel_grad_time(model, no_sp, work, cluster, m) == 0
    a, b = predict(model, z1, work, cluster), predict(model, z2, work, cluster)
    assert b.time_breakdown_s["tp_comm"] - a.time_breakdown_s["tp_comm"] == pytest.approx(per_use - once)


def _cli(capsys, *argv):
    from mtds.cli.plan import main
    rc = main(list(argv))
    return rc, capsys.readouterr().out


def test_cli_pipeline_schedule_and_runnable_flags(capsys, monkeypatch):
    _refuse(monkeypatch, "zb-h1")
    gpt3 = ["--layers", "96", "--hidden", "12288", "--heads", "96", "--gpus", "1536", "--global-batch", "1536"]
    rc, out = _cli(capsys, *gpt3, "--tp", "8", "--pp", "12", "--microbatch", "1", "--recompute", "full",
                   "--pipeline-schedule", "interleaved", "--json")
    d = json.loads(out)
    assert rc == 0 and d["pipeline_schedule"] == "interleaved" and d["virtual_stages"] > 1 and d["runnable"] is True
    rc, out = _cli(capsys, *gpt3, "--tp", "8", "--pp", "12", "--microbatch", "1", "--recompute", "full",
                   "--pipeline-schedule", "zb-h1", "--json")
    d = json.loads(out)
    assert rc == 0 and d["runnable"] is False and "zb-h1" in d["not_runnable"][0]
    rc, out = _cli(capsys, *gpt3, "--json", "--top", "5")
    assert all(lay["runnable"] for lay in json.loads(out)["layouts"])
    rc, out = _cli(capsys, *gpt3, "--json", "--top", "0", "--include-unrunnable")
    assert any(not lay["runnable"] for lay in json.loads(out)["layouts"])
    rc, out = _cli(capsys, *gpt3, "--tp", "8", "--pp", "12", "--microbatch", "1", "--pipeline-schedule", "zb-h1")
    assert "not runnable: train.py cannot run --pipeline-schedule zb-h1 yet" in out
