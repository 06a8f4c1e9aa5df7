"""mtds on the peer work (benchmarks/peer_work.py), timed and optionally profiled as a whole loop iteration.

A step here is everything ``train_loop.train`` does for one step: the hooks before it, the optimizer step,
and the hooks after it (logging, the non-finite check, the signal check), as the peers' loops time theirs
(Megatron-core's and torchtitan's step times include their own clipping, logging and loss reads). Two
hooks are added around mtds's own list, first and last: nothing in mtds changes for the measurement.

:func:`train_mtds` runs the peer work; :func:`train_shape` a ``workloads.Shape`` at (1,1,1) (the host-time
benchmark, benchmarks/bench_host.py), optionally counting the ATen operators of one step.
"""
from __future__ import annotations

import time
from contextlib import contextmanager


class _Edge:
    """First (``start``) or last hook of the list: timestamps and, for one step, the profiler."""

    def __init__(self, box: dict, start: bool):
        self.box, self.start = box, start

    def before_step(self, step):
        if self.start:
            if step == self.box["profile_step"]:
                from torch.profiler import ProfilerActivity, profile
                self.box["prof"] = profile(activities=[ProfilerActivity.CPU], record_shapes=False)
                self.box["prof"].__enter__()
            if step == self.box.get("cpu_step"):
                from benchmarks.op_cpu import OpCpu
                self.box["cpu_ops"] = OpCpu()
                self.box["cpu_ops"].__enter__()
            if step == self.box.get("ops_step"):
                from lab.testing.op_counts import OpCounts
                self.box["ops"] = OpCounts()
                self.box["ops"].__enter__()
            self.box["t0"] = time.perf_counter()
            self.box["c0"] = time.thread_time()
            if step == 2 and self.box.get("cpu_step"):
                from benchmarks.op_cpu import thread_cpu_s
                self.box["threads_at_2"] = thread_cpu_s()

    def after_step(self, step, record):
        if not self.start:
            self.box["times"].append(time.perf_counter() - self.box["t0"])
            self.box.setdefault("thread_cpu", []).append(time.thread_time() - self.box["c0"])
            cpu_ops = self.box.pop("cpu_ops", None)
            if cpu_ops is not None:
                cpu_ops.__exit__(None, None, None)
                self.box["op_cpu"] = cpu_ops.rows()
            if step == self.box.get("cpu_step") - 1 and "threads_at_2" in self.box:   # steps 2 .. cpu_step - 1
                from benchmarks.op_cpu import thread_cpu_s
                before, n = self.box.pop("threads_at_2"), step - 1
                self.box["thread_cpu_per_step"] = {k: (v - before.get(k, 0.0)) / n for k, v in thread_cpu_s().items()}
            ops = self.box.pop("ops", None)
            if ops is not None:
                ops.__exit__(None, None, None)
                self.box["op_counts"] = dict(ops.counts)
            prof = self.box.pop("prof", None)
            if prof is not None:
                prof.__exit__(None, None, None)
                self.box["profile"] = profile_tables(prof)
        return None

    def at_end(self, step, completed):
        pass


def profile_tables(prof, n: int = 25) -> dict:
    """{'ranges': mtds's record_function ranges, 'ops': top operators by self time} in ms."""
    ranges, ops = [], []
    for e in prof.key_averages():
        row = {"name": e.key, "total_ms": e.cpu_time_total / 1e3, "self_ms": e.self_cpu_time_total / 1e3,
               "calls": e.count}
        (ranges if e.key.startswith(("mtds.", "peer.")) else ops).append(row)
    ranges.sort(key=lambda r: r["total_ms"], reverse=True)
    ops.sort(key=lambda r: r["self_ms"], reverse=True)
    return {"ranges": ranges, "ops": ops[:n]}


@contextmanager
def edge_hooks(box: dict):
    """While open, every run's hook list starts and ends with an :class:`_Edge` writing into ``box``."""
    from mtds.training import train_loop
    step_hooks = train_loop.step_hooks

    def edged(*args, **kwargs):
        return [_Edge(box, True)] + step_hooks(*args, **kwargs) + [_Edge(box, False)]

    train_loop.step_hooks = edged
    try:
        yield box
    finally:
        train_loop.step_hooks = step_hooks


def train_mtds(model: str, tp: int, pp: int, microbatches: int, steps: int, warmup: int,
               profile_step: int | None, workdir: str, overrides: dict | None = None,
               cpu_step: int | None = None) -> dict:
    import torch.distributed as dist

    from benchmarks import peer_work
    from mtds.training import TrainConfig, job

    box = {"times": [], "profile_step": profile_step, "cpu_step": cpu_step}
    with edge_hooks(box):
        cfg = TrainConfig(deepspeed_config=peer_work.ds_config(microbatches),
                          model=peer_work.write_model_config(model, workdir), tp=tp, pp=pp,
                          seq_length=peer_work.SEQ, steps=steps, eval_split=0.0, progress=False,
                          lr_decay="constant", model_overrides={"hidden_dropout": 0.0, "attention_dropout": 0.0},
                          **(overrides or {}))
        result = job.run(cfg)
    times = box["times"]
    measured = sorted(times[warmup:])
    return {"side": "mtds", "rank": dist.get_rank(), "times": times, "losses": result.losses,
            "median_step_s": measured[len(measured) // 2] if measured else float("nan"),
            "profile": box.get("profile"), "thread_cpu": box.get("thread_cpu"), "op_cpu": box.get("op_cpu"),
            "threads": box.get("thread_cpu_per_step")}


def train_shape(shape_fields: dict, steps: int, seed: int, ops_step: int | None = None) -> dict:
    """mtds at (1,1,1) on ``Shape(**shape_fields)`` (benchmarks/workloads.py: GPT-2, fp32, no dropout, the
    DeepSpeed config of ds_configs/cpu_fp32.json, whose AdamW mtds runs as torch's fused kernel on CPU),
    ``steps`` whole loop iterations; 'times' of every step, 'op_counts' of step ``ops_step``."""
    from benchmarks.workloads import Shape, ds_config
    from mtds.training import TrainConfig, job

    shape = Shape(**shape_fields)
    box = {"times": [], "profile_step": None, "ops_step": ops_step}
    with edge_hooks(box):
        cfg = TrainConfig(deepspeed_config=ds_config(shape.micro_batch, shape.micro_batch), model=shape.model_config(),
                          seq_length=shape.seq, steps=steps, seed=seed, eval_split=0.0, progress=False,
                          lr_decay="constant")
        result = job.run(cfg)
    return {"side": "mtds", "times": box["times"], "losses": result.losses, "parameters": result.params,
            "op_counts": box.get("op_counts")}
