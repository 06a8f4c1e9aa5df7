"""What a checkpoint costs the training loop: synchronous save vs --async-save (one process, CPU).

Four runs of the same job (gpt2-small, fp32, Adam, 12 steps): no save; a synchronous save at step 6; an
asynchronous one at step 6 with the writer process, and with a writer thread. A probe hook, last in the step's hooks, stamps the end of every step (after the
save hook), so an iteration's time includes its save. The save's cost to training is the sum of iterations 1-11
minus the no-save run's, counted over steps 6-11 (the save's step and the steps its background write overlaps;
step 12's save and the last write at exit are not counted); each mode runs ``--repeat`` times, alternating, and
each iteration's fastest time is kept (the machine is shared). Also: the step time while the background write
runs (steps 7-11), against the same steps without a save.

    python -m benchmarks.bench_async_save [--model gpt2-small] [--steps 12]
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time


MODES = ("none", "sync", "async", "async-thread")     # async: the writer process (CPU's); async-thread: a thread


class _Stamps:
    def __init__(self):
        self.ends: list[float] = []

    def before_step(self, step):
        if not self.ends:
            self.ends.append(time.perf_counter())

    def after_step(self, step, record):
        self.ends.append(time.perf_counter())

    def at_end(self, step, completed):
        pass


def _run(model: str, steps: int, mode: str, root: str, seq: int) -> dict:
    from mtds.training import TrainConfig, hooks, run
    stamps = _Stamps()
    original = hooks.step_hooks
    hooks_module = __import__("mtds.training.train_loop", fromlist=["step_hooks"])
    hooks_module.step_hooks = lambda *a, **k: original(*a, **k) + [stamps]
    ds = {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "gradient_clipping": 1.0,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}, "zero_optimization": {"stage": 0}}
    kw = {} if mode == "none" else dict(save=f"{root}/{mode}", save_interval=steps // 2,
                                        async_save=mode.startswith("async"))
    from mtds.checkpoint.async_save import AsyncSaver
    AsyncSaver.writer = "thread" if mode == "async-thread" else "process"
    try:
        start = time.perf_counter()
        run(TrainConfig(deepspeed_config=ds, model=model, steps=steps, seq_length=seq, eval_split=0.0,
                        progress=False, trace_comm=False, **kw))
        total = time.perf_counter() - start
    finally:
        hooks_module.step_hooks = original
        AsyncSaver.writer = "process"
    iters = [b - a for a, b in zip(stamps.ends, stamps.ends[1:])]
    return {"mode": mode, "iters": iters, "total_s": total}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="gpt2-small")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--repeat", type=int, default=2)
    args = p.parse_args(argv)
    root = tempfile.mkdtemp(prefix="bench-async-save-")
    runs: dict = {}
    try:
        for _ in range(args.repeat):
            for m in MODES:
                shutil.rmtree(f"{root}/{m}", ignore_errors=True)
                iters = _run(args.model, args.steps, m, root, args.seq)["iters"]
                runs[m] = {"iters": [min(a, b) for a, b in zip(runs[m]["iters"], iters)] if m in runs else iters}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    half = args.steps // 2
    window = slice(half - 1, args.steps - 1)
    base = sum(runs["none"]["iters"][window])
    out = {"model": args.model, "steps": args.steps, "save_at": half, "repeat": args.repeat}
    for m in MODES[1:]:
        out[f"{m}_cost_s"] = sum(runs[m]["iters"][window]) - base
    out["save_step_sync_s"] = runs["sync"]["iters"][half - 1]
    out["save_step_async_s"] = runs["async"]["iters"][half - 1]
    out["step_s_no_save"] = runs["none"]["iters"][half - 1]
    for m in ("async", "async-thread"):
        out[f"{m}_fraction_of_sync"] = out[f"{m}_cost_s"] / out["sync_cost_s"] if out["sync_cost_s"] > 0 else None
    during = slice(half, args.steps - 1)
    out["steps_during_write_s"] = [round(x, 3) for x in runs["async"]["iters"][during]]
    out["steps_during_write_thread_s"] = [round(x, 3) for x in runs["async-thread"]["iters"][during]]
    out["same_steps_no_save_s"] = [round(x, 3) for x in runs["none"]["iters"][during]]
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}, indent=1))


if __name__ == "__main__":
    main()
