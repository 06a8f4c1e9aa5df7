"""p2p stress: the interleaved schedule at p = 2, v = 2 with large stage boundaries (64 MiB per message on
GPUs), several steps, under a hard time bound. Under NCCL a large send completes only when its receive
is posted, so two ranks that send to each other at once ("crossing" sends) deadlock unless the schedule
orders or batches each exchange; gloo's buffered sends hide this. A hang is reported as a failure."""
from __future__ import annotations

import math

from mtds.gpucheck.report import Section

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


def _train(case):
    from mtds.training import run

    from mtds.gpucheck.ds_configs import train_config
    workload, precision, device = case
    result = run(train_config(workload, precision, device, pp=2, pipeline_schedule="interleaved", virtual_stages=2))
    return {"losses": result.losses, "grad_norms": result.grad_norms}


def message_bytes(workload, precision: str) -> int:
    """One boundary activation (or its gradient): micro-batch x sequence x hidden x element size."""
    return workload.micro_batch * workload.seq * workload.model.hidden_size * DTYPE_BYTES[precision]


def check(machine, workload, precision: str, timeout: float) -> Section:
    from mtds.gpucheck.ranks import run_cases
    size = message_bytes(workload, precision)
    case = f"interleaved p=2 v=2 {precision}, {size / 2 ** 20:.3g} MiB per message"
    section = Section("p2p stress", f"{workload.describe()}; {workload.global_batch // workload.micro_batch} "
                      f"micro-batches per step; each crosses between the two ranks 3 times forward (virtual stages "
                      f"0>1>2>3) and 3 times backward. Bound: {timeout:.0f} s; a hang past it is a FAIL.")
    if machine.ranks < 2:
        section.skip(case, "needs 2 ranks (one per GPU)")
        return section
    outcome, _ = run_cases(machine, 2, _train, [(workload, precision, machine.device)], timeout=timeout)
    section.seconds = outcome.seconds
    if outcome.error:
        section.fail(case, outcome.error)
        return section
    ok, value = outcome.cases[0]
    if not ok:
        section.fail(case, value)
        return section
    finite = all(math.isfinite(x) for x in value["losses"] + value["grad_norms"])
    section.add(case, finite and len(value["losses"]) == workload.steps,
                f"{len(value['losses'])} steps in {outcome.seconds:.1f} s, losses "
                + ", ".join(f"{x:.4f}" for x in value["losses"]), "a non-finite loss or grad norm")
    return section
