"""The learning-rate schedule on its own, against its closed form at hand-picked steps (the parity
reference writes the schedule out independently, so it no longer shares this code)."""
import math

import pytest
import torch

from mtds.training.schedule import build_scheduler, lr_factor

BASE, MIN, WARMUP, TOTAL = 1e-3, 1e-4, 4, 14     # 10 decay steps after warm-up


def lr(step, decay, warmup=WARMUP, total=TOTAL, min_lr=MIN):
    return BASE * lr_factor(step, base_lr=BASE, min_lr=min_lr, warmup=warmup, total=total, decay=decay)


def test_linear_warmup_reaches_the_base_lr_on_the_last_warmup_step():
    # step k (0-based) of the warm-up runs at (k + 1) / warmup of the base LR
    assert [lr(k, "cosine") for k in range(WARMUP)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])


@pytest.mark.parametrize("decay", ["cosine", "linear", "constant"])
def test_decay_closed_form(decay):
    # progress p = (step - warmup) / (total - warmup): at steps 4, 9, 14 p = 0, 1/2, 1
    expected = {
        # cosine: min + (base - min) (1 + cos(pi p)) / 2 -> base, midpoint, min
        "cosine": [1e-3, 5.5e-4, 1e-4],
        # linear: min + (base - min)(1 - p)
        "linear": [1e-3, 5.5e-4, 1e-4],
        "constant": [1e-3, 1e-3, 1e-3],
    }[decay]
    assert [lr(s, decay) for s in (4, 9, 14)] == pytest.approx(expected, rel=1e-12)
    # a quarter of the way: cosine 1e-4 + 9e-4 (1 + cos(pi/4)) / 2 = 8.682e-4; linear 1e-4 + 9e-4 * 0.75
    quarter = {"cosine": 1e-4 + 9e-4 * (1 + math.sqrt(0.5)) / 2, "linear": 7.75e-4, "constant": 1e-3}[decay]
    assert lr(4 + 2.5, decay) == pytest.approx(quarter, rel=1e-12)
    # past the end the LR stays at its final value
    assert lr(TOTAL + 5, decay) == pytest.approx(expected[-1], rel=1e-12)


def test_no_warmup_and_zero_min_lr():
    assert lr(0, "cosine", warmup=0, min_lr=0.0) == pytest.approx(1e-3)
    assert lr(7, "linear", warmup=0, min_lr=0.0) == pytest.approx(1e-3 * 0.5)
    assert lr(14, "cosine", warmup=0, min_lr=0.0) == pytest.approx(0.0, abs=1e-15)


def test_scheduler_applies_the_factor_per_optimizer_step():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=BASE)
    sched = build_scheduler(opt, base_lr=BASE, min_lr=MIN, warmup=WARMUP, total=TOTAL, decay="linear")
    seen = []
    for _ in range(TOTAL + 1):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen[:WARMUP + 1] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])
    assert seen[9] == pytest.approx(5.5e-4) and seen[14] == pytest.approx(1e-4)
