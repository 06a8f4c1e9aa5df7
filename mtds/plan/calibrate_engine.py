"""Measure what DeepSpeed's engine adds per micro-batch on this host, for the planner's host costs.

The engine wraps each micro-batch's forward and backward in its own work: ZeRO-3 runs a pre- and
post-hook on every module in both passes (fetch, release, trace bookkeeping) and a hook per parameter
gradient; ZeRO-1/2 a hook per parameter gradient and its bucketing. None of it is FLOPs or bytes.
Measured directly: the same stack of M small linear layers (every weight under ZeRO-3's persistence
threshold, so nothing is gathered: what remains is the hooks, not the traffic the planner counts
already), one step of m micro-batches, once as plain torch (forward, backward, AdamW) and once under
``deepspeed.initialize`` with the ZeRO stage; the difference per micro-batch, at two sizes M, fitted to

    overhead(M) = c0 + c1 * M        (c0 s per micro-batch, c1 s per module per micro-batch)

``host_costs.engine_overhead`` applies it with the model's module count. Runs inside the calibration's
process group (every rank at once, as the run's ranks contend).
"""
from __future__ import annotations

import time

import torch

WIDTH = 64                      # 4,096-element weights: all persistent under ZeRO-3 (threshold 1e5)
MODULE_COUNTS = (4, 16)


def _stack(modules: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(modules)])


def _step_time(step, steps: int = 3) -> float:
    step()                                       # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return (time.perf_counter() - start) / steps


def _plain(modules: int, micro: int, x: torch.Tensor) -> float:
    model = _stack(modules)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step():
        for _ in range(micro):
            model(x).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return _step_time(step)


def _engine(modules: int, micro: int, x: torch.Tensor, stage: int, world: int) -> float:
    import os

    import deepspeed
    import torch.distributed as dist
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False   # no JIT build of an unused op
    # the calibration's ranks are one host's processes, started without a launcher
    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank() if dist.is_initialized() else 0))
    config = {"train_batch_size": x.shape[0] * micro * world, "train_micro_batch_size_per_gpu": x.shape[0],
              "gradient_accumulation_steps": micro, "gradient_clipping": 1.0, "steps_per_print": 10 ** 9,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": stage}}
    engine, *_ = deepspeed.initialize(model=_stack(modules), config=config)

    def step():
        for _ in range(micro):
            loss = engine(x).pow(2).mean()
            engine.backward(loss)
            engine.step()
    try:
        return _step_time(step)
    finally:
        engine.destroy() if hasattr(engine, "destroy") else None


def measure_engine_overhead(stage: int, micro: int = 4, sync=None) -> tuple[float, float]:
    """(c0 s per micro-batch, c1 s per module per micro-batch) DeepSpeed's engine at ZeRO ``stage`` adds
    to plain torch on this host (each clamped at 0)."""
    import torch.distributed as dist
    world = dist.get_world_size() if dist.is_initialized() else 1
    x = torch.randn(4, WIDTH)
    extra = {}
    for modules in MODULE_COUNTS:
        if sync is not None:
            sync()
        plain = _plain(modules, micro, x)
        if sync is not None:
            sync()
        extra[modules] = max(0.0, _engine(modules, micro, x, stage, world) - plain) / micro
    (m1, e1), (m2, e2) = extra.items()
    c1 = max(0.0, (e2 - e1) / (m2 - m1))
    return max(0.0, e1 - c1 * m1), c1
