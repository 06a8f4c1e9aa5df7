"""HF parity matrix: every pipeline schedule train.py runs, at p = 2 (and t = 2 where four ranks exist), in
each precision of the device, against the single-process HuggingFace reference -- per-step mean loss and
pre-clip global gradient norm."""
from __future__ import annotations

import functools
from dataclasses import dataclass

from .report import Section

# Relative tolerance per precision, against the fp32 reference:
#  fp32: only the order of sums differs (TP/pipeline partial sums, the norm over ranks): 1e-5, as the suite.
#  bf16: 8-bit mantissa (unit roundoff 2^-8 = 3.9e-3) in every activation and weight copy; the mean loss
#        averages that out, the clipped, normalised Adam update keeps the weights close, but the gradient
#        norm sums squares of bf16 gradients. Measured on CPU (tiny model, 6 steps): see docs/gpucheck.md.
#  fp16: 11-bit mantissa (2^-11), 8x finer than bf16, behind a loss scale that divides out exactly (a
#        power of two): bf16's bound holds for it with room to spare.
TOLERANCE = {"fp32": (1e-5, 1e-5), "bf16": (2e-2, 5e-2), "fp16": (2e-2, 5e-2)}   # (loss, grad norm)


@dataclass(frozen=True)
class Case:
    schedule: str
    tp: int
    pp: int
    precision: str
    device: str
    workload: object

    @property
    def name(self) -> str:
        return f"{self.schedule} (t,p,d)=({self.tp},{self.pp},1) {self.precision}"


def _train(case: Case) -> dict:
    from mtds.training import run

    from .ds_configs import train_config
    cfg = train_config(case.workload, case.precision, case.device, tp=case.tp, pp=case.pp,
                       pipeline_schedule=case.schedule,
                       virtual_stages=2 if case.schedule == "interleaved" else 1)
    result = run(cfg)
    return {"losses": result.losses, "grad_norms": result.grad_norms, "skipped": result.skipped}


def _reference(workload, device: str):
    """On rank 0 only (the others wait at the barrier that follows): the HF reference on this rank's device."""
    import torch
    import torch.distributed as dist
    if dist.get_rank() != 0:
        return None
    from .reference import train_reference
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    return train_reference(workload, dev)


def cases_for(machine, workload, precisions) -> dict[int, list[Case]]:
    """{world: cases}: p = 2 for each schedule, t = 1 (and t = 2 with four ranks); one GPU: (1,1,1) only."""
    from mtds.pipe.select import PIPELINE_SCHEDULES
    if machine.ranks < 2:
        return {1: [Case("1f1b", 1, 1, p, machine.device, workload) for p in precisions]}
    out = {}
    for tp in (1, 2):
        if 2 * tp <= machine.ranks and (machine.cuda or tp == 1):    # CPU: 2 gloo ranks (the suite's budget)
            out[2 * tp] = [Case(s, tp, 2, p, machine.device, workload) for s in PIPELINE_SCHEDULES for p in precisions]
    return out


def judge(precision: str, value: dict, ref) -> tuple[bool, str, str]:
    """(pass, numbers, why not) for one run's losses/grad norms/skipped steps against the reference."""
    from .reference import max_rel_diff
    loss_tol, norm_tol = TOLERANCE[precision]
    dl, dn = max_rel_diff(value["losses"], ref.losses), max_rel_diff(value["grad_norms"], ref.grad_norms)
    skipped = sum(value["skipped"])
    why = "; ".join(w for w in (f"loss {dl:.2e} > {loss_tol:g}" if not dl <= loss_tol else "",
                                f"grad norm {dn:.2e} > {norm_tol:g}" if not dn <= norm_tol else "",
                                f"{skipped} step(s) skipped by the loss scaler" if skipped else "") if w)
    numbers = f"loss {dl:.2e}, grad norm {dn:.2e}, final loss {value['losses'][-1]:.4f} (HF {ref.losses[-1]:.4f})"
    return not why, numbers, why


def check(machine, workload, precisions, timeout: float) -> Section:
    from .ranks import run_cases
    tol_text = ", ".join(f"{p}: loss {TOLERANCE[p][0]:g}, grad norm {TOLERANCE[p][1]:g}" for p in precisions)
    section = Section("HF parity matrix", f"Every schedule of mtds.pipe.select against HuggingFace GPT2LMHeadModel + "
                      f"torch AdamW in fp32 (one process, same weights, batches, LR schedule and clipping), "
                      f"{workload.describe()}. Max relative difference per step of the loss and the pre-clip "
                      f"grad norm; tolerance {tol_text} (why: mtds/gpucheck/parity.py). A step skipped by the "
                      f"loss scaler fails the case.")
    for world, cases in cases_for(machine, workload, precisions).items():
        outcome, ref = run_cases(machine, world, _train, cases, timeout=timeout,
                                 setup=functools.partial(_reference, workload, machine.device))
        section.seconds += outcome.seconds
        if outcome.error:
            for case in cases:
                section.fail(case.name, f"world {world}: {outcome.error}")
            continue
        for i, case in enumerate(cases):
            if i >= len(outcome.cases):
                section.fail(case.name, "not run: an earlier case failed on these ranks")
                continue
            ok, value = outcome.cases[i]
            if not ok:
                section.fail(case.name, value)
                continue
            section.add(case.name, *judge(case.precision, value, ref))
    return section
