"""Pipeline schedule orders, without processes: completeness, dependency order, no deadlock, and the
unit-cost bubble of a discrete-event simulation equal to the theory, exactly (rational arithmetic)."""
from fractions import Fraction

import pytest

from mtds.pipe.schedules import SCHEDULES, Action, check_microbatches, has_weight_pass, schedule_actions
from lab.pipe_sim.simulate import (InvalidSchedule, ScheduleDeadlock, default_costs, peak_in_flight, simulate,
                                simulate_schedule, validate)


def theory_bubble(name, p, v, m):
    """Bubble time over ideal compute time (PTD-P §2.2; Qi et al. 2023 §2 for ZB-H1 with F = B = W)."""
    return {"1f1b": Fraction(p - 1, m), "interleaved": Fraction(p - 1, v * m),
            "zb-h1": Fraction(p - 1, 3 * m)}[name]


GRID = [(name, p, v, m) for name in SCHEDULES for p in (2, 3, 4) for v in (1, 2, 3)
        for m in (p, 2 * p, 3 * p + 1)]


def supported(name, p, v, m):
    try:
        check_microbatches(name, p, v, m)
        return True
    except ValueError:
        return False


@pytest.mark.parametrize("name,p,v,m", [g for g in GRID if supported(*g)])
def test_order_complete_deadlock_free_and_bubble_equals_theory(name, p, v, m):
    actions = [schedule_actions(name, p, v, m, r) for r in range(p)]
    validate(actions, p=p, v=v, m=m, weight_pass=has_weight_pass(name))  # each F/B(/W) once, F<B<W
    result = simulate(actions, p=p, v=v, m=m, costs=default_costs(name), weight_pass=has_weight_pass(name))
    per_micro = 3  # F + B (+ W) units per micro-batch per chunk, by the cost convention
    assert result.busy == [per_micro * v * m] * p
    bubble = theory_bubble(name, p, v, m)
    assert result.bubble_ratio == [bubble] * p
    assert result.idle_fraction == [bubble / (1 + bubble)] * p
    assert len(result.events) == sum(len(a) for a in actions)


@pytest.mark.parametrize("name,p,v,m", [g for g in GRID if not supported(*g)])
def test_unsupported_combinations_fail_with_one_line(name, p, v, m):
    with pytest.raises(ValueError) as err:
        schedule_actions(name, p, v, m, 0)
    message = str(err.value)
    assert "\n" not in message
    if name == "interleaved" and v > 1:   # m = 3p + 1: three groups of at least p would leave a remainder
        suggested = int(message.rsplit(" ", 1)[1])
        assert f"equal groups of at least the pipeline size ({p})" in message and m < suggested <= 4 * p
        assert all(k % (k // p) for k in range(m, suggested))            # the next count that works ...
        simulate_schedule(name, p, v, suggested)                           # ... and it runs
    elif name != "interleaved":     # the rulebook's line (mtds.rules.schedule), as train.py says it
        assert "--virtual-stages" in message and "one chunk per rank" in message
    else:
        assert "--virtual-stages >= 2" in message


@pytest.mark.parametrize("p,v", [(2, 2), (3, 2), (4, 3), (5, 2)])
def test_interleaved_relaxed_micro_batch_counts_reach_theory(p, v):
    # m >= p in m // p equal groups (G = m / (m // p) >= p): the same bubble as m % p == 0
    counts = [m for m in range(p, 5 * p + 2) if m % p and m % (m // p) == 0]
    assert p + 1 in counts, counts  # one group of p + 1: the smallest count m % p != 0 allows (p=4: 5, 6, 7, 10, ...)
    for m in counts:
        result = simulate_schedule("interleaved", p, v, m)
        assert result.bubble_ratio == [Fraction(p - 1, v * m)] * p, m
    with pytest.raises(ValueError, match=f"to {p}$"):
        check_microbatches("interleaved", p, v, p - 1)  # fewer than p


def test_interleaved_placement_and_first_actions():
    # p=2, v=2, m=4, rank 0: warm-up (2-0-1)*2 + (2-1)*2 = 4 forwards: micro 0,1 on chunk 0, then chunk 1
    acts = schedule_actions("interleaved", 2, 2, 4, 0)
    assert acts[:5] == [Action("F", 0, 0), Action("F", 0, 1), Action("F", 1, 0), Action("F", 1, 1),
                        Action("F", 0, 2)]
    assert acts[5] == Action("B", 1, 0)  # backward starts on the last chunk
    assert schedule_actions("1f1b", 3, 1, 3, 2) == [Action("F", 0, 0), Action("B", 0, 0), Action("F", 0, 1),
                                                    Action("B", 0, 1), Action("F", 0, 2), Action("B", 0, 2)]


@pytest.mark.parametrize("p,v", [(2, 2), (3, 2), (4, 2), (4, 3)])
def test_interleaved_peak_activations_are_megatrons_factor(p, v):
    # rank 0 holds (warm-up + 1) chunk activations of 1/(p·v) of the model each: 1 + (p−1)/(p·v) times
    # 1F1B's p micro-batches of 1/p of the model -- the factor the planner charges
    from mtds.plan.memory import interleaved_activation_factor
    peak = peak_in_flight(schedule_actions("interleaved", p, v, 4 * p, 0), weight_pass=False)
    assert Fraction(peak, p * v) == 1 + Fraction(p - 1, p * v)
    assert interleaved_activation_factor(p, v) == pytest.approx(float(Fraction(peak, p * v)))


@pytest.mark.parametrize("p", [2, 3, 4])
def test_zb_h1_peak_activations_equal_1f1b_rank0(p):
    m = 3 * p + 1
    one_f_one_b = [peak_in_flight(schedule_actions("1f1b", p, 1, m, r), False) for r in range(p)]
    zb = [peak_in_flight(schedule_actions("zb-h1", p, 1, m, r), True) for r in range(p)]
    assert one_f_one_b == [p - r for r in range(p)]
    assert zb == [p] * p and max(zb) == max(one_f_one_b)


def test_simulator_detects_deadlock():
    # rank 1 wants micro-batch 1 first; rank 0 sends it only after B of micro-batch 0, which needs rank 1
    rank0 = [Action("F", 0, 0), Action("B", 0, 0), Action("F", 0, 1), Action("B", 0, 1)]
    rank1 = [Action("F", 0, 1), Action("F", 0, 0), Action("B", 0, 0), Action("B", 0, 1)]
    with pytest.raises(ScheduleDeadlock, match="rank 0 at .*rank 1 at"):
        simulate([rank0, rank1], p=2, v=1, m=2, costs=default_costs("1f1b"), weight_pass=False)


def test_validation_rejects_missing_duplicate_and_out_of_order_actions():
    good = schedule_actions("zb-h1", 2, 1, 2, 1)
    validate([good], p=1, v=1, m=2, weight_pass=True)
    with pytest.raises(InvalidSchedule, match="expected 6"):
        validate([good[:-1]], p=1, v=1, m=2, weight_pass=True)
    with pytest.raises(InvalidSchedule, match="twice"):
        validate([good + good[-1:]], p=1, v=1, m=2, weight_pass=True)
    with pytest.raises(InvalidSchedule, match="before its B"):
        w_first = [a for a in good if a.kind == "W"][:1] + [a for a in good if a != good[-1] or a.kind != "W"]
        validate([w_first], p=1, v=1, m=2, weight_pass=True)
    with pytest.raises(InvalidSchedule, match="not valid"):
        validate([good], p=1, v=1, m=2, weight_pass=False)  # W in a schedule without W passes


def test_zb_h1_bubble_is_papers_formula_with_unequal_costs():
    # (p−1)(T_F + T_B − T_W) per rank (Qi et al. 2023 §2.1) when T_W <= T_F, T_B
    p, m = 4, 8
    costs = {"F": 3, "B": 4, "W": 2}
    result = simulate_schedule("zb-h1", p, 1, m, costs=costs)
    assert result.idle == [(p - 1) * (3 + 4 - 2)] * p


def _torch_orders(name, p, v, m):
    """Per-rank compute orders from torch.distributed.pipelining's schedule classes (private API, used as
    an independent oracle): the order generators run on a bare instance, no process group needed.
    ScheduleInterleavedZeroBubble with one stage per rank is ZB1P = ZB-H1. Not used for 1f1b: torch
    2.13's Schedule1F1B._get_pipeline_order (a visualisation helper, not its runtime) starts the last
    rank at micro-batch 1 and never runs micro-batch 0, so it is no oracle."""
    from torch.distributed.pipelining import schedules as sched
    cls = sched.ScheduleInterleaved1F1B if name == "interleaved" else sched.ScheduleInterleavedZeroBubble
    obj = object.__new__(cls)
    obj.pp_group_size, obj.n_local_stages, obj._n_microbatches = p, v, m
    obj.number_of_rounds = max(1, m // p)
    obj.microbatches_per_round = m // obj.number_of_rounds
    raw = {r: obj._calculate_single_rank_operations(r) for r in range(p)}
    kinds = {"F": "F", "B": "B", "I": "B", "W": "W"}
    return [[Action(kinds[a.computation_type.value], a.stage_index // p, a.microbatch_index)
             for a in raw[r] if a is not None and a.computation_type.value in kinds] for r in range(p)]


@pytest.mark.parametrize("name,p,v,m", [("interleaved", 4, 2, 8), ("interleaved", 4, 2, 4),
                                        ("interleaved", 4, 2, 10), ("interleaved", 3, 2, 5),
                                        ("interleaved", 3, 3, 6), ("interleaved", 2, 3, 4),
                                        ("zb-h1", 4, 1, 8), ("zb-h1", 3, 1, 10)])
def test_orders_match_torch_pipelining(name, p, v, m):
    ours = [schedule_actions(name, p, v, m, r) for r in range(p)]
    assert ours == _torch_orders(name, p, v, m)


@pytest.mark.parametrize("p", [2, 3, 4])
def test_1f1b_order_is_deepspeeds_train_schedule(p):
    # the oracle for 1f1b: DeepSpeed's own TrainSchedule (what --pipeline-schedule 1f1b runs); its
    # instructions name pipe buffers, micro-batch k uses buffer k % num_pipe_buffers()
    from deepspeed.runtime.pipe.schedule import BackwardPass, ForwardPass, TrainSchedule
    for m in (1, p, 3 * p + 1):
        for rank in range(p):
            sched = TrainSchedule(micro_batches=m, stages=p, stage_id=rank)
            theirs = [("F" if isinstance(c, ForwardPass) else "B", c.buffer_id) for step in sched.steps()
                      for c in step if isinstance(c, (ForwardPass, BackwardPass))]
            ours = [(a.kind, a.micro % sched.num_pipe_buffers()) for a in schedule_actions("1f1b", p, 1, m, rank)]
            assert ours == theirs, (m, rank)
