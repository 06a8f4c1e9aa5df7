"""Pipeline schedules as planner knobs: bubble time and in-flight activations of each schedule
train.py runs (``--pipeline-schedule``; ``mtds.parallel.choices.PIPELINE_SCHEDULES``).

Per micro-batch and pipeline rank, a stage's work is F (forward), B (input gradient, including any
recomputed forward and the backward tensor-parallel collectives) and W (weight gradient GEMMs and the
gradient-accumulation pass); the full backward is B + W. Bubble time per step, p ranks, v chunks:

  1f1b         (p − 1)(F + B + W)                       PTD-P (arXiv 2104.04473) §2.2
  interleaved  (p − 1)(F + B + W) / v                   PTD-P §2.2.2
  zb-h1        (p − 1)(F + B − W)                       Qi et al. 2023 (arXiv 2401.10241) §2.1
  dualpipev    (p − 1)(F/2 + B + W)                     DualPipe README (PP/2 − 1)(F&B + B − 3W) with
               PP = 2p chunks of half a stage, F&B = F + B (DeepSpeed runs the pair one after the
               other) and W = 0 (DeepSpeed 0.19.8 keeps W inside its backward); chunk time = stage/2.

With F = B = W = 1 these are the bubble fractions (p−1)/m, (p−1)/(v m), (p−1)/(3m) and
5(p−1)/(6m) of the ideal step m(F + B + W). They are checked against discrete-event simulations of the
orders that run: mtds.pipe.schedules (1f1b, interleaved, zb-h1: exact) and DeepSpeed's own
DualPipeVSchedule (lab.pipe_sim.dualpipev_sim: its simulated idle is (p − 1)(F/2 + B + W) minus at most
one chunk, tests/test_plan_pipeline.py).

Activations the fullest rank holds at its peak, relative to 1F1B's first rank (min(p, m) micro-batches
of l/p layers): interleaved 1 + (p − 1)/(p v) (Korthikanti 2022 §4.2.3; = rank 0's warm-up + 1 chunk
activations); zb-h1 1 (every rank holds up to p micro-batches until their W, rank 0's 1F1B peak);
dualpipev 1 + 1/(2p) (2p + 1 chunk activations of l/(2p) layers, DualPipe README "PP + 1").
"""
from __future__ import annotations



def interleaved_activation_factor(p: int, v: int) -> float:
    """Peak activations of the interleaved schedule's first rank relative to 1F1B's: 1 + (p-1)/(p v)
    (Korthikanti 2022 Section 4.2.3). It is rank 0's warm-up + 1 = v p + p - 1 chunk activations of
    1/(p v) of the model each (checked against mtds.pipe.schedules in tests/test_pipe_schedules.py)."""
    return 1.0 + (p - 1) / (p * v)


def bubble_time(schedule: str, p: int, v: int, f: float, b: float, w: float) -> float:
    """Pipeline bubble per step (seconds), from one micro-batch's stage times F, B (input grad), W."""
    if p <= 1:
        return 0.0
    if schedule == "1f1b":
        return (p - 1) * (f + b + w)
    if schedule == "interleaved":
        return (p - 1) * (f + b + w) / v
    if schedule == "zb-h1":
        return (p - 1) * max(f + b - w, 0.0)
    if schedule == "dualpipev":
        return (p - 1) * (f / 2 + b + w)
    raise ValueError(f"unknown pipeline schedule {schedule!r}")


def activation_factor(schedule: str, p: int, v: int) -> float:
    """Peak in-flight activations of the fullest rank relative to 1F1B's first rank."""
    if schedule == "interleaved":
        return interleaved_activation_factor(p, v)
    if schedule == "dualpipev":
        return 1.0 + 1.0 / (2 * p)
    return 1.0


def p2p_messages(schedule: str, p: int, v: int, m: int) -> int:
    """Activation + gradient messages on a step's critical path: 2 (v m + p − 1) (PTD-P §4.1 counts v m
    per direction for interleaving); dualpipev has two chunks per rank, like v = 2."""
    chunks = 2 if schedule == "dualpipev" else v
    return 2 * (chunks * m + p - 1)

