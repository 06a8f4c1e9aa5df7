"""Local-cluster prediction vs a measured run (mtds.plan.check_local), end to end.

The issue's goal is +-25% on CPU; the measured/predicted ratio is a benchmark number, reported by
`python -m mtds.plan.check_local` (see docs/planner.md), not asserted here: on a shared 2-core
machine step times of one run vary by more than 2x (0.7-3.3 s per step observed; a CI run measured
2.4x at (2,1,1) while two earlier runs were within 2x). This test checks that calibration,
prediction and the measured run all work and produce sane, comparable numbers.
"""
import math

from mtds.plan.check_local import LAYOUTS, check_local


def test_local_calibration_prediction_and_measurement_run_end_to_end():
    rows = check_local(steps=4)
    assert [r["layout"] for r in rows] == ["t{} p{} d{}".format(*lay) for lay in LAYOUTS]
    for r in rows:
        assert r["predicted_step_s"] > 0 and len(r["measured_step_times_s"]) == 4
        assert all(t > 0 for t in r["measured_step_times_s"])
        assert math.isfinite(r["ratio_measured_over_predicted"]) and r["ratio_measured_over_predicted"] > 0
    # tensor parallelism over gloo must be predicted to cost communication
    assert rows[1]["predicted_breakdown_s"]["tp_comm"] > 0
