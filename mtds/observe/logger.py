"""One record per optimizer step, written where users look: a console line, a JSON line, TensorBoard
scalars, and a progress bar when the console is a terminal. Only the reporting rank writes."""
from __future__ import annotations

import json
import math
import os
import sys
from typing import Any

_CONSOLE_FIELDS = (
    ("loss", "loss {:.4f}"), ("eval_loss", "eval {:.4f}"), ("lr", "lr {:.2e}"), ("grad_norm", "gnorm {:.3f}"),
    ("loss_scale", "scale {:g}"), ("tokens_per_s", "{:,.0f} tok/s"), ("tflops_model", "{:.3f} TFLOP/s"),
    ("tflops_hw", "hw {:.3f} TFLOP/s"), ("mfu", "mfu {:.1%}"), ("peak_mem_gib", "mem {:.2f} GiB"),
    ("peak_reserved_gib", "reserved {:.2f} GiB"),
    ("step_time_s", "{:.2f} s"), ("bubble", "bubble {:.1%}"), ("expert_imbalance", "experts max/mean {:.2f}"),
    ("moe_z_loss", "z-loss {:.4g}"),
)


def format_step(record: dict[str, Any], total_steps: int) -> str:
    parts = [f"step {record['step']}/{total_steps}"]
    for key, fmt in _CONSOLE_FIELDS:
        value = record.get(key)
        if value is not None and not (isinstance(value, float) and math.isnan(value)):
            parts.append(fmt.format(value))
    if record.get("skipped"):
        parts.append("SKIPPED (overflow)")
    return " | ".join(parts)


class StepLogger:
    def __init__(self, *, enabled: bool, total_steps: int, append: bool = False, jsonl_path: str | None = None,
                 tensorboard_dir: str | None = None, progress: bool | None = None):
        self.enabled = enabled
        self.total_steps = total_steps
        self.records: list[dict[str, Any]] = []   # kept for the end-of-run plot
        self._jsonl = self._tb = self._bar = None
        if not enabled:
            return
        if jsonl_path:
            os.makedirs(os.path.dirname(os.path.abspath(jsonl_path)), exist_ok=True)
            # A resumed run continues the log of the run it resumes.
            self._jsonl = open(jsonl_path, "a" if append else "w")
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter
            self._tb = SummaryWriter(tensorboard_dir)
        if progress is None:
            progress = sys.stdout.isatty()
        if progress:
            from tqdm import tqdm
            self._bar = tqdm(total=total_steps, unit="step", dynamic_ncols=True)

    def start_at(self, step: int) -> None:
        """Resumed runs start the progress bar at the step they resume from."""
        if self._bar is not None:
            self._bar.update(step - self._bar.n)

    def info(self, message: str) -> None:
        if self.enabled:
            self._write(message)

    def _write(self, line: str) -> None:
        if self._bar is not None:
            self._bar.write(line)
        else:
            print(line, flush=True)

    def log(self, record: dict[str, Any], *, kind: str = "train") -> None:
        if not self.enabled:
            return
        self.records.append({"kind": kind, **record})
        if kind == "train":
            self._write(format_step(record, self.total_steps))
        else:
            self._write(f"eval at step {record['step']} | loss {record['eval_loss']:.4f} | ppl {record['eval_ppl']:.2f}")
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"kind": kind, **record}) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for key, value in record.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
                    self._tb.add_scalar(f"{kind}/{key}", value, record["step"])
        if self._bar is not None and kind == "train":
            self._bar.update(1)
            self._bar.set_postfix(loss=f"{record['loss']:.4f}")

    def close(self, plot_path: str | None = None, title: str = "") -> None:
        if self.enabled and plot_path and self.records:
            from mtds.observe.plot import plot_run
            self._write(f"plot: {plot_run(self.records, plot_path, title)}")
        for handle in (self._jsonl, self._tb, self._bar):
            if handle is not None:
                handle.close()
