"""--pipeline-layout syntax and --pipeline-balance cost, in the test process (no ranks): parsing and
its one-line errors, the uniform split against DeepSpeed's own, the cost partition against brute force,
its memory constraint, and the planner's view of a partition."""
from __future__ import annotations

import itertools

import pytest

from mtds.parallel.pipeline_layout import PipelineLayoutError, StageLayout, parse_layout, uniform_layout
from mtds.plan import Cluster, Candidate, ModelSpec, Workload, get_gpu
from mtds.plan.balance import LayerCosts, balanced_layout, cost_layout, rank_memory, stage_report


@pytest.mark.parametrize("text, stages, blocks", [
    ("Et*3|t*3|t*2L", 3, (3, 3, 2)),
    ("E|t*4|t*4|L", 4, (0, 4, 4, 0)),
    ("Et|(tt|)*3tL", 5, (1, 2, 2, 2, 1)),
    (" E t t , | t*2 L ", 2, (2, 2)),
    ("E(t*2)*2|tL", 2, (4, 1)),
])
def test_layouts_parse(text, stages, blocks):
    layout = parse_layout(text, stages=stages, num_layers=sum(blocks))
    assert layout.blocks == blocks
    assert parse_layout(str(layout), stages=stages, num_layers=sum(blocks)) == layout   # str() round-trips


def test_long_layouts_print_as_groups():
    assert str(StageLayout((1,) * 23 + (0,))) == "Et|(t|)*22L"
    assert str(StageLayout((0, 2, 2, 3, 1))) == "E|(t*2|)*2t*3|tL"
    assert str(StageLayout((4,))) == "Et*4L"


def test_spec_parts_cut_embedding_blocks_and_head():
    # specs: [E, t1..t8, final norm, head]; E rides with stage 0, norm + head with the last stage
    assert StageLayout((3, 3, 2)).spec_parts() == [0, 4, 7, 11]
    assert StageLayout((0, 4, 4, 0)).spec_parts() == [0, 1, 5, 9, 11]
    assert [list(r) for r in StageLayout((0, 3, 1)).block_ranges()] == [[], [1, 2, 3], [4]]


@pytest.mark.parametrize("text, stages, layers, expected", [
    ("Et*2|t|tL", 2, 4, "has 3 stages ('|' + 1) but the run has p x v = 2 virtual stages"),
    ("Et*3|t*2L", 2, 4, "holds 5 transformer blocks but the model has 4"),
    ("tE*1t|t*2L", 2, 4, "needs exactly one E, first in the first stage"),
    ("Et*2|t*2", 2, 4, "needs exactly one L, last in the last stage"),
    ("EtL|t*2L", 2, 3, "needs exactly one L"),
    ("Et*2||t*2L", 3, 4, "stage 1 holds nothing"),
    ("Et*2|x*2L", 2, 4, "unexpected 'x' at character 6"),
    ("E(t*2|t*2L", 2, 4, "missing ')'"),
    ("Et*|t*2L", 2, 4, "'*' needs a count"),
    ("Et)|t*2L", 2, 4, "unmatched ')'"),
])
def test_bad_layouts_are_one_line(text, stages, layers, expected):
    with pytest.raises(PipelineLayoutError) as err:
        parse_layout(text, stages=stages, num_layers=layers)
    assert expected in str(err.value) and "\n" not in str(err.value), str(err.value)


@pytest.mark.parametrize("layers, stages", [(l, s) for l in range(2, 13) for s in (2, 3, 4, 8) if l >= s])
def test_uniform_is_deepspeeds_type_partition(layers, stages):
    """What mtds ran before layouts existed (DeepSpeed's type:TransformerLayer split), so uniform runs and
    their checkpoints are unchanged."""
    from deepspeed.runtime.utils import partition_balanced
    weights = [0] + [1] * layers + [0, 0]
    assert uniform_layout(layers, stages).spec_parts() == [int(x) for x in partition_balanced(weights, stages)]


@pytest.mark.parametrize("costs", [LayerCosts(0.05, 1.0, 4.4), LayerCosts(0.3, 1.0, 1.7), LayerCosts(0.0, 1.0, 0.0),
                                   LayerCosts(2.5, 1.0, 2.5)])
@pytest.mark.parametrize("layers, stages", [(4, 2), (8, 2), (8, 4), (6, 3), (5, 4)])
def test_cost_layout_is_optimal(costs, layers, stages):
    """The costliest stage of the cost partition is the smallest any partition achieves (brute force
    over every split with something on each stage)."""
    def worst(blocks):
        return max(costs.stage(n, k == 0, k == stages - 1) for k, n in enumerate(blocks))

    best = min(worst(b) for b in itertools.product(range(layers + 1), repeat=stages)
               if sum(b) == layers and all(n >= 1 for n in b[1:-1]))
    got = cost_layout(costs, layers, stages)
    assert got.num_layers == layers and got.stages == stages
    assert worst(got.blocks) == pytest.approx(best)


def test_cost_layout_moves_blocks_off_an_expensive_head():
    assert cost_layout(LayerCosts(0.05, 1.0, 4.4), 8, 2).blocks == (6, 2)
    assert cost_layout(LayerCosts(0.05, 1.0, 2.0), 4, 2).blocks == (3, 1)
    assert cost_layout(LayerCosts(0.05, 1.0, 4.4), 4, 2).blocks == (4, 0)   # a stage with no block
    assert cost_layout(LayerCosts(0.0, 1.0, 0.0), 8, 4).blocks == (2, 2, 2, 2)
    # blocks beyond l under the target come off the costliest stage: (3, 3, 2) -> (2, 2, 2), not (1, 3, 2)
    assert cost_layout(LayerCosts(0.0, 1.0, 1.0), 6, 3).blocks == (2, 2, 2)


MODEL = ModelSpec(layers=8, hidden=256, heads=4, vocab=8192, seq=128)
WORK = Workload(global_batch=8, precision="fp32")


def _view(p=2, v=1, schedule="1f1b"):
    layout = Candidate(tp=1, pp=p, dp=1, microbatch=1, virtual_stages=v, recompute="none", pipeline_schedule=schedule)
    return MODEL, layout, WORK, Cluster(get_gpu("A100", "fp32"), gpus=p)


@pytest.mark.parametrize("p, v, schedule", [(2, 1, "1f1b"), (2, 2, "interleaved"), (4, 1, "zb-h1"),
                                            (2, 2, "dualpipev")])
def test_balanced_layout_beats_uniform_in_the_planners_model(p, v, schedule):
    view = _view(p, v, schedule)
    uniform = stage_report(*view, uniform_layout(8, p * v))
    balanced = stage_report(*view, balanced_layout(*view))
    assert max(balanced.stage_s) < max(uniform.stage_s)
    assert uniform.critical_rank == p - 1 or schedule == "dualpipev"   # the head's rank, today


def test_memory_constraint_limits_the_partition():
    view = _view()
    free = balanced_layout(*view)
    need = max(rank_memory(*view, free))
    uniform = uniform_layout(8, 2)
    assert max(rank_memory(*view, uniform)) < need      # moving blocks to rank 0 costs it memory
    tight = balanced_layout(*view, capacity_bytes=need * 0.999)
    assert tight != free and max(rank_memory(*view, tight)) <= need * 0.999
    assert balanced_layout(*view, capacity_bytes=1.0) == uniform     # nothing fits: uniform, not a guess


def test_rank_memory_counts_micro_batches_in_flight():
    """1F1B: rank r holds min(p - r, m) micro-batches' activations; equal middle stages differ by that."""
    view = _view(4, 1, "1f1b")
    memory = rank_memory(*view, StageLayout((2, 2, 2, 2)))
    assert memory[1] > memory[2]


def test_dualpipev_places_the_v():
    """DualPipeV: rank 0 runs stages 0 and 2p - 1, so it holds both E and L (the critical rank)."""
    from mtds.plan.balance import rank_of_stage
    assert [rank_of_stage(k, 2, "dualpipev") for k in range(4)] == [0, 1, 1, 0]
    assert [rank_of_stage(k, 2, "interleaved") for k in range(4)] == [0, 1, 0, 1]
    assert stage_report(*_view(2, 2, "dualpipev"), StageLayout((2, 2, 2, 2))).critical_rank == 0


def test_stage_report_names_the_critical_rank_and_memory():
    view = _view()
    report = stage_report(*view, StageLayout((2, 6)))
    assert report.critical_rank == 1 and report.imbalance > 1.3
    assert report.rank_memory[1] > report.rank_memory[0]       # more blocks and the logits
    d = report.as_dict()
    assert d["pipeline_layout"] == "Et*2|t*6L" and d["critical_rank"] == 1


def test_planner_predicts_the_partition_used():
    """predict(stages=...): the uniform partition costs what the planner always predicted (its l/p blocks
    + head model, within the final norm and embedding it now prices), the cost partition less, and a
    worse one more; the report names the critical rank."""
    from mtds.plan.predict import predict
    model, layout, work, cluster = _view(4, 1, "1f1b")
    plain = predict(model, layout, work, cluster)
    uniform = predict(model, layout, work, cluster, stages=uniform_layout(8, 4))
    balanced = predict(model, layout, work, cluster, stages=balanced_layout(model, layout, work, cluster))
    worse = predict(model, layout, work, cluster, stages=StageLayout((1, 1, 1, 5)))
    assert uniform.step_time_s == pytest.approx(plain.step_time_s, rel=0.02)
    assert balanced.step_time_s < uniform.step_time_s < worse.step_time_s
    assert uniform.stages["critical_rank"] == 3 and worse.stages["critical_rank"] == 3
    assert balanced.as_dict()["stages"]["pipeline_layout"] == str(balanced_layout(model, layout, work, cluster))
    assert not plain.stages and "stages" not in plain.as_dict()


def test_plan_cli_reports_and_recommends_a_partition(capsys):
    from mtds.cli.plan import main
    args = ["--layers", "8", "--hidden", "256", "--heads", "4", "--vocab", "8192", "--seq", "128", "--gpus", "2",
            "--tp", "1", "--pp", "2", "--dp", "1", "--global-batch", "8", "--microbatch", "1", "--recompute", "none",
            "--precision", "fp32", "--pipeline-schedule", "1f1b"]
    main(args + ["--pipeline-balance", "uniform"])
    out = capsys.readouterr().out
    assert "pipeline layout: Et*4|t*4L" in out and "recommended for this cluster (--pipeline-layout): Et*5|t*3L" in out, out
    main(args)      # the default is train.py's: cost
    assert "pipeline layout: Et*5|t*3L" in capsys.readouterr().out
    main(args + ["--pipeline-layout", "Et*6|t*2L"])
    assert "pipeline layout: Et*6|t*2L" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="holds 7 transformer blocks"):
        main(args + ["--pipeline-layout", "Et*5|t*2L"])


def test_plan_cli_models_the_partition_train_py_builds(capsys, monkeypatch):
    """mtds-plan's modelled partition comes from train.py's own rule (run_partition, priced on
    REFERENCE_GPU), not from a cost partition priced on the user's cluster, which it only recommends."""
    import mtds.plan.balance as balance
    from mtds.cli.plan import main
    seen = []

    def fake_run_partition(model, layout, work, world, chosen, capacity_bytes):
        seen.append((world, chosen, capacity_bytes))
        return StageLayout((6, 2))
    monkeypatch.setattr(balance, "run_partition", fake_run_partition)
    main(["--layers", "8", "--hidden", "256", "--heads", "4", "--vocab", "8192", "--seq", "128", "--gpus", "2",
          "--tp", "1", "--pp", "2", "--dp", "1", "--global-batch", "8", "--microbatch", "1", "--recompute", "none",
          "--precision", "fp32", "--pipeline-schedule", "1f1b", "--gpu", "V100"])
    out = capsys.readouterr().out
    assert "pipeline layout: Et*6|t*2L" in out and "recommended for this cluster (--pipeline-layout): Et*5|t*3L" in out, out
    assert seen and seen[0][0] == 2 and seen[0][1] is None and seen[0][2] > 0


@pytest.mark.parametrize("schedule", ["interleaved", "dualpipev"])
@pytest.mark.parametrize("costs", [LayerCosts(0.05, 1.0, 2.5), LayerCosts(0.3, 1.0, 1.2)])
@pytest.mark.parametrize("layers", [4, 7, 8])
def test_cost_layout_balances_ranks_with_two_chunks(schedule, costs, layers):
    """v = 2 (p = 2): the costliest rank (its two stages summed) is the brute-force minimum."""
    from mtds.plan.balance import rank_of_stage

    def rank_costs(blocks):
        out = [0.0, 0.0]
        for k, n in enumerate(blocks):
            out[rank_of_stage(k, 2, schedule)] += costs.stage(n, k == 0, k == 3)
        return out

    candidates = [b for b in itertools.product(range(layers + 1), repeat=4) if sum(b) == layers and min(b[1:3]) >= 1]
    best = min(max(rank_costs(b)) for b in candidates)
    got = cost_layout(costs, layers, 4, rank_of=lambda k: rank_of_stage(k, 2, schedule))
    assert max(rank_costs(got.blocks)) == pytest.approx(best), got


def test_a_ranks_blocks_spread_over_its_chunks():
    """Interleaved placement (rank = stage mod 2): equal costs give every chunk the same blocks, and the
    head's chunk takes fewer."""
    assert cost_layout(LayerCosts(0.0, 1.0, 0.0), 8, 4, rank_of=lambda k: k % 2).blocks == (2, 2, 2, 2)
    assert cost_layout(LayerCosts(0.0, 1.0, 2.0), 8, 4, rank_of=lambda k: k % 2).blocks == (2, 2, 3, 1)
