"""Local-cluster prediction vs a measured run (lab.plan_check.check_local), end to end.

The issue's goal is +-25% on CPU. It is checked by `python -m lab.plan_check.check_local` (exit code 1
outside the tolerance; measured numbers in docs/planner.md), not asserted here: on a shared
2-core machine other jobs slow individual steps by tens of percent, so a timed assertion in the
test suite would fail for reasons unrelated to the model. This test checks that calibration,
prediction and the measured runs work for every layout kind (tensor, pipeline, data parallel)
and that each layout's prediction charges the communication it really does.
"""
import json
import math

from lab.plan_check.check_local import LAYOUTS, check_local, main


def test_local_calibration_prediction_and_measurement_run_end_to_end(tmp_path):
    """`mtds-plan --calibrate` writes a profile that the planner's command line reads and that the prediction
    of each layout uses. One calibration for both (a calibration is two fresh interpreters measuring for a
    few seconds, ~10 CPU-s); where a GPU is visible --calibrate refuses (tests/test_plan_calibrate.py) and
    check_local calibrates by itself."""
    from mtds.cli.plan import main as plan, visible_gpus
    profile = None
    if not visible_gpus():
        profile = str(tmp_path / "prof.json")
        assert plan(["--calibrate", "--profile", profile, "--json"]) == 0
        with open(profile) as f:
            prof = json.load(f)
        for key in ("matmul_tflops", "memory_gbps", "allreduce_busbw_gbps", "allreduce_latency_s",
                    "optimizer_s_per_param"):
            assert prof[key] > 0
        assert prof["concurrency"] == 2 and prof["host_cores"] >= 1     # the contention it was measured at
        assert plan(["--gpu", "local", "--profile", profile, "--layers", "2", "--hidden", "64", "--heads", "4",
                     "--vocab", "256", "--seq", "32", "--gpus", "2", "--global-batch", "4", "--tp", "2", "--pp", "1",
                     "--json"]) == 0
    # one calibration and a small model keep the test short (it checks the plumbing, not the accuracy)
    rows = check_local(steps=3, calibrate_each=False, hidden=128, seq=64, profile=profile)
    assert [r["layout"] for r in rows] == ["t{} p{} d{}".format(*lay) for lay in LAYOUTS]
    by_layout = {r["layout"]: r for r in rows}
    for r in rows:
        assert r["predicted_step_s"] > 0 and len(r["measured_step_times_s"]) == 3
        assert all(t > 0 for t in r["measured_step_times_s"])
        assert math.isfinite(r["ratio_measured_over_predicted"]) and r["ratio_measured_over_predicted"] > 0
    assert by_layout["t2 p1 d1"]["predicted_breakdown_s"]["tp_comm"] > 0
    assert by_layout["t1 p2 d1"]["predicted_breakdown_s"]["pp_comm"] > 0
    assert by_layout["t1 p2 d1"]["predicted_breakdown_s"]["bubble"] > 0
    assert by_layout["t1 p1 d2"]["predicted_breakdown_s"]["dp_comm"] > 0
    single = by_layout["t1 p1 d1"]["predicted_breakdown_s"]
    assert single["tp_comm"] == single["pp_comm"] == single["dp_comm"] == 0


def test_check_exit_code_follows_the_tolerance(monkeypatch, capsys):
    """The check fails (exit 1) when a layout is outside the tolerance, passes otherwise."""
    import lab.plan_check.check_local as cl

    def fake(*args, **kwargs):   # stands in for the measured run only; the comparison is real
        return [{"layout": "t1 p1 d1", "predicted_step_s": 1.0, "measured_step_s": ratio,
                 "predicted_tokens_per_s": 1.0, "measured_tokens_per_s": 1.0,
                 "ratio_measured_over_predicted": ratio, "ratio_fastest_over_predicted": ratio}]
    monkeypatch.setattr(cl, "check_local", fake)
    ratio = 1.2
    assert main([]) == 0
    ratio = 1.3
    assert main(["--repeats", "1"]) == 1
    assert main(["--repeats", "1", "--tolerance", "0.35"]) == 0
    assert "OUTSIDE 25%" in capsys.readouterr().out


def test_one_disturbed_repeat_does_not_decide(monkeypatch):
    """Each layout is judged by the median ratio over repeats."""
    import lab.plan_check.check_local as cl

    ratios = iter([1.6, 1.0, 1.1])

    def fake(**kwargs):
        r = next(ratios)
        return [{"layout": "t1 p1 d1", "predicted_step_s": 1.0, "measured_step_s": r, "predicted_tokens_per_s": 1.0,
                 "measured_tokens_per_s": 1.0 / r, "ratio_measured_over_predicted": r,
                 "ratio_fastest_over_predicted": r}]
    monkeypatch.setattr(cl, "check_local", fake)
    (row,) = cl.check_local_repeated(3)
    assert row["ratio_measured_over_predicted"] == 1.1 and row["ratios_per_repeat"] == [1.6, 1.0, 1.1]
