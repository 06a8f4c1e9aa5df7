"""mtds on the peer work (benchmarks/peer_work.py), timed and optionally profiled as a whole loop iteration.

A step here is everything ``train_loop.train`` does for one step: the hooks before it, the optimizer step,
and the hooks after it (logging, the non-finite check, the signal check), as the peers' loops time theirs
(Megatron-core's and torchtitan's step times include their own clipping, logging and loss reads). Two
hooks are added around mtds's own list, first and last: nothing in mtds changes for the measurement.
"""
from __future__ import annotations

import time


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
            self.box["t0"] = time.perf_counter()

    def after_step(self, step, record):
        if not self.start:
            self.box["times"].append(time.perf_counter() - self.box["t0"])
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


def train_mtds(model: str, tp: int, pp: int, microbatches: int, steps: int, warmup: int,
               profile_step: int | None, workdir: str, overrides: dict | None = None) -> dict:
    import torch.distributed as dist

    from benchmarks import peer_work
    from mtds.training import TrainConfig, job, train_loop

    box = {"times": [], "profile_step": profile_step}
    step_hooks = train_loop.step_hooks

    def edged(*args, **kwargs):
        return [_Edge(box, True)] + step_hooks(*args, **kwargs) + [_Edge(box, False)]

    train_loop.step_hooks = edged
    try:
        cfg = TrainConfig(deepspeed_config=peer_work.ds_config(microbatches),
                          model=peer_work.write_model_config(model, workdir), tp=tp, pp=pp,
                          seq_length=peer_work.SEQ, steps=steps, eval_split=0.0, progress=False,
                          lr_decay="constant", model_overrides={"hidden_dropout": 0.0, "attention_dropout": 0.0},
                          **(overrides or {}))
        result = job.run(cfg)
    finally:
        train_loop.step_hooks = step_hooks
    times = box["times"]
    measured = sorted(times[warmup:])
    return {"side": "mtds", "rank": dist.get_rank(), "times": times, "losses": result.losses,
            "median_step_s": measured[len(measured) // 2] if measured else float("nan"),
            "profile": box.get("profile")}
