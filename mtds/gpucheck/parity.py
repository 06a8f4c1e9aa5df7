"""HF parity matrix: every pipeline schedule train.py runs, at p = 2 (and t = 2 where four ranks exist), in
each precision of the device, against the single-process HuggingFace reference -- per-step mean loss and
pre-clip global gradient norm."""
from __future__ import annotations

import functools
from dataclasses import dataclass

from .report import Section

@dataclass(frozen=True)
class Tolerance:
    """Max relative difference from the fp32 reference: every step's loss, the first step's grad norm (same
    weights on both sides: only the arithmetic differs), every step's grad norm (weights drifted apart)."""
    loss: float
    first_norm: float
    norm: float

    def describe(self) -> str:
        return f"loss {self.loss:g}, grad norm {self.first_norm:g} at step 1 and {self.norm:g} after"


# fp32: only the order of sums differs (TP/pipeline partial sums, the norm over ranks): 1e-5, as the suite.
# bf16: 8-bit mantissa (unit roundoff u = 2^-8 = 3.9e-3) in every activation, gradient and weight copy.
#   Measured on CPU, every schedule at p = 2, the GPU shape (l=4 h=256 s=128 B=32, 10 clipped steps):
#   losses within 4.3e-4 (held to 5e-3, ~u); step-1 grad norm 4.1e-4 (held to 1e-2); later norms mostly
#   1e-3 but 2.2e-2 (1f1b) and 5.8e-2 (interleaved) at a step whose gradient spikes, once bf16 rounding
#   has moved the weights (held to 0.15: catches a lost loss scale or micro-batch factor, not drift).
# fp16: 11-bit mantissa (2^-11), 8x finer than bf16, behind a power-of-two loss scale that divides out
#   exactly: bf16's bounds hold for it with room to spare.
TOLERANCE = {"fp32": Tolerance(1e-5, 1e-5, 1e-5), "bf16": Tolerance(5e-3, 1e-2, 0.15),
             "fp16": Tolerance(5e-3, 1e-2, 0.15)}


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
    tol = TOLERANCE[precision]
    dl = max_rel_diff(value["losses"], ref.losses)
    d1 = max_rel_diff(value["grad_norms"][:1], ref.grad_norms[:1])
    dn = max_rel_diff(value["grad_norms"], ref.grad_norms)
    skipped = sum(value["skipped"])
    why = "; ".join(w for w in (f"loss {dl:.2e} > {tol.loss:g}" if not dl <= tol.loss else "",
                                f"step-1 grad norm {d1:.2e} > {tol.first_norm:g}" if not d1 <= tol.first_norm else "",
                                f"grad norm {dn:.2e} > {tol.norm:g}" if not dn <= tol.norm else "",
                                f"{skipped} step(s) skipped by the loss scaler" if skipped else "") if w)
    numbers = (f"loss {dl:.2e}, grad norm {d1:.2e} at step 1, {dn:.2e} max, final loss {value['losses'][-1]:.4f} "
               f"(HF {ref.losses[-1]:.4f})")
    return not why, numbers, why


def check(machine, workload, precisions, timeout: float) -> Section:
    from .ranks import run_cases
    tol_text = "; ".join(f"{p}: {TOLERANCE[p].describe()}" for p in precisions)
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
