"""Held-out check of the two ZeRO-3 constants (``zero3_comm_efficiency``, ``zero3_overlap_exponent``).

The shipped values were set while looking at the same PTD-P Table 2 ZeRO-3 cells the validation
judges them on, so those cells are what the model is *calibrated on*, not validated against. Here
the constants are instead fitted on one model's ZeRO-3 rows (175B or 530B; grid search minimising the
largest relative TFLOP/s error, then the squared error) and the fit is judged on the other model's
rows. ``python -m lab.plan_check.heldout`` prints the table docs/planner.md reports.
"""
from __future__ import annotations

import dataclasses

from mtds.plan.candidate import Workload
from mtds.plan.hardware import Cluster, get_gpu
from mtds.plan.model_spec import ModelSpec
from mtds.plan.search import evaluate
from mtds.plan.tables import load_table

SIZES = {174.6: (96, 12288, 96), 529.6: (105, 20480, 128)}  # layers, hidden, heads of the Table 2 models
EFFICIENCIES = [e / 100 for e in range(30, 101)]            # 0.30 .. 1.00
EXPONENTS = [k / 10 for k in range(10, 61)]                 # 1.0 (no overlap) .. 6.0


def zero3_rows() -> dict[float, list[dict]]:
    rows = [r for r in load_table("ptdp_vs_zero3_2021_table2.csv") if r["scheme"] == "zero3"]
    return {size: [r for r in rows if r["params_billion"] == size] for size in SIZES}


def relative_error(row: dict, efficiency: float, exponent: float) -> float:
    """Predicted / published TFLOP/s per GPU − 1 for one ZeRO-3 cell under the given constants."""
    base = get_gpu("A100-80GB")
    gpu = dataclasses.replace(base, calibration=base.calibration.with_overrides(
        zero3_comm_efficiency=efficiency, zero3_overlap_exponent=exponent))
    layers, hidden, heads = SIZES[row["params_billion"]]
    model = ModelSpec(layers=layers, hidden=hidden, heads=heads, vocab=51200, seq=2048)
    pr = evaluate(model, Workload(row["global_batch"]), Cluster(gpu, row["gpus"]), tp=1, pp=1,
                  microbatch=row["microbatch"], zero_stage=3, recompute="full", sequence_parallel=False)
    return pr.tflops_per_gpu / row["tflops_per_gpu"] - 1.0


def fit(rows: list[dict]) -> tuple[float, float]:
    """(efficiency, exponent) on the grid minimising (max |error|, sum of squared errors) over rows."""
    def loss(c):
        errs = [abs(relative_error(r, *c)) for r in rows]
        return max(errs), sum(e * e for e in errs)
    return min(((e, k) for e in EFFICIENCIES for k in EXPONENTS), key=loss)


def held_out_report() -> list[dict]:
    """For each direction: the fitted constants, in-sample and held-out relative errors per cell."""
    rows = zero3_rows()
    out = []
    for train, test in ((174.6, 529.6), (529.6, 174.6)):
        constants = fit(rows[train])
        out.append({"fit_on": train, "test_on": test, "efficiency": constants[0], "exponent": constants[1],
                    "in_sample": {r["gpus"]: relative_error(r, *constants) for r in rows[train]},
                    "held_out": {r["gpus"]: relative_error(r, *constants) for r in rows[test]}})
    return out


if __name__ == "__main__":
    shipped = get_gpu("A100-80GB").calibration
    for size, rs in zero3_rows().items():
        errs = {r["gpus"]: f"{relative_error(r, shipped.zero3_comm_efficiency, shipped.zero3_overlap_exponent):+.1%}"
                for r in rs}
        print(f"shipped constants ({shipped.zero3_comm_efficiency}, {shipped.zero3_overlap_exponent}), "
              f"{size}B: {errs}")
    for d in held_out_report():
        fmt = lambda errs: ", ".join(f"{g}: {e:+.1%}" for g, e in errs.items())  # noqa: E731
        print(f"fit on {d['fit_on']}B -> efficiency {d['efficiency']:.2f}, exponent {d['exponent']:.1f}; "
              f"in-sample {fmt(d['in_sample'])}; held-out {d['test_on']}B {fmt(d['held_out'])}")
