"""Faults in one run under ``torchrun --max-restarts N``: kill -9 or SIGSTOP a random rank at random steps,
several times; the agent restarts the group, the run resumes from its newest complete checkpoint, and in the
end its losses are compared with an uninterrupted run's. Each fault's time to the next trained step is split
into its parts from timestamped output:

  detect   fault -> the first surviving rank's ``error:`` line (a collective's failure, or the heartbeat)
  restart  -> the agent's new worker processes exist (survivors exit, the agent stops and starts the group)
  init     -> the new attempt's process group exists (its "mtds: layout" line: mostly importing torch and DeepSpeed)
  start    -> it has loaded its checkpoint ("resumed from" line: data, model, engine, checkpoint load)
  step     -> its first trained step is logged
(each measured from the fault). ``named``: for a kill -9, torchrun's log names the rank and exit code -9 (only
when it sees that death before the survivor's exit: it logs the first failure of a round).
"""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field

from lab.faults.harness import REPO, _command, _env, _rank_pids, write_inputs

KINDS = ("kill", "kill-save", "stop")      # kill -9 in training, kill -9 during a (background) write, SIGSTOP


@dataclass
class Fault:
    kind: str
    rank: int
    after_step: int                  # the newest step in the log when it struck
    at: float                        # time.monotonic() of the fault
    parts: dict = field(default_factory=dict)      # detect / restart / init / start / step: seconds since the fault
    named: bool = False


@dataclass
class RestartRun:
    returncode: int
    faults: list[Fault]
    steps: dict[int, tuple]          # step -> (loss, grad_norm) of the last attempt that trained it
    output: str
    error_lines: list[str]
    wall_s: float


class _Lines:
    """The launcher's output, each line with its arrival time (a reader thread)."""

    def __init__(self, stream):
        self.lines: list[tuple[float, str]] = []
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream):
        for line in stream:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def first_after(self, t: float, needle: str, before: float = float("inf")) -> float | None:
        return next((when for when, line in list(self.lines) if t <= when < before and needle in line), None)

    def text(self) -> str:
        self._thread.join(timeout=5)
        return "\n".join(line for _, line in self.lines)


def _records(log: str) -> list[dict]:
    try:
        with open(log) as f:
            return [json.loads(line) for line in f if '"kind": "train"' in line]
    except (FileNotFoundError, json.JSONDecodeError):
        return []


def last_per_step(log: str) -> dict[int, tuple]:
    """step -> (loss, grad_norm), the last record of each step (a restarted attempt re-trains steps)."""
    return {r["step"]: (r["loss"], r["grad_norm"]) for r in _records(log)}


def launch(work: str, steps: int, *, max_restarts: int, extra=(), ck="ck", log="log.jsonl"):
    cmd = _command(work, ("--tp", "2"), steps, ["--load", os.path.join(work, ck), *extra])
    cmd = [a if a != os.path.join(work, "ck") else os.path.join(work, ck) for a in cmd]
    cmd = [a if a != os.path.join(work, "log.jsonl") else os.path.join(work, log) for a in cmd]
    cmd.insert(1, "--max-restarts")
    cmd.insert(2, str(max_restarts))
    cmd.insert(3, "--monitor-interval")
    cmd.insert(4, "0.1")
    return subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _wait(cond, launcher, deadline, what):
    while not cond():
        if launcher.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{what}: the launcher ended or stalled (rc {launcher.poll()})")
        time.sleep(0.01)


def run_with_faults(work: str, seed: int, kinds: list[str], *, steps: int = 14, max_restarts: int = 3,
                    heartbeat_s: float = 8.0, extra=(), timeout: float = 400.0) -> RestartRun:
    """One torchrun job of ``steps`` steps with the faults ``kinds`` (in order, each at a random step after the
    previous attempt trained at least one step, on a random rank)."""
    rng = random.Random(seed)
    write_inputs(work)
    log = os.path.join(work, "log.jsonl")
    extra = ["--heartbeat-timeout", str(heartbeat_s), "--async-save", *extra]
    start = time.monotonic()
    launcher = launch(work, steps, max_restarts=max_restarts, extra=extra)
    out = _Lines(launcher.stdout)
    deadline = start + timeout
    faults: list[Fault] = []
    try:
        for kind in kinds:
            # this attempt trains 1-3 steps first (a fresh one: steps after its resume)
            base = len(_records(log))
            _wait(lambda: len(_records(log)) >= base + rng.randint(1, 3), launcher, deadline, f"before {kind}")
            ck = os.path.join(work, "ck")
            if kind == "kill-save":
                seen = {d for d in os.listdir(ck) if d.endswith(".partial")} if os.path.isdir(ck) else set()
                _wait(lambda: os.path.isdir(ck) and {d for d in os.listdir(ck) if d.endswith(".partial")} - seen,
                      launcher, deadline, "no save started")
            pids = _rank_pids(launcher)
            victim = rng.randrange(len(pids))
            records = _records(log)
            os.kill(pids[victim], signal.SIGSTOP if kind == "stop" else signal.SIGKILL)
            fault = Fault(kind, victim, records[-1]["step"] if records else 0, time.monotonic())
            faults.append(fault)
            old = set(pids.values())
            _wait(lambda: len(set(_rank_pids(launcher).values()) - old) == len(pids), launcher, deadline,
                  f"no restart after {kind}")
            fault.parts["restart"] = time.monotonic() - fault.at
            n = len(_records(log))
            _wait(lambda: len(_records(log)) > n, launcher, deadline, f"no step after {kind}")
            fault.parts["step"] = time.monotonic() - fault.at
        launcher.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
        text = out.text()
        with open(os.path.join(work, "out.txt"), "w") as f:     # each line with its time since the launch
            f.write("\n".join(f"{when - start:8.2f} {line}" for when, line in out.lines))
    for fault, after in zip(faults, [f.at for f in faults[1:]] + [float("inf")]):
        detect = out.first_after(fault.at, "error:", after)
        # no complete checkpoint yet: the attempt starts from scratch ("start" is then its first step's start)
        loaded = out.first_after(fault.at, "resumed from", after)
        init = out.first_after(fault.at + fault.parts.get("restart", 0.0), "mtds: layout", after)
        if detect is not None:
            fault.parts["detect"] = detect - fault.at
        if init is not None:
            fault.parts["init"] = init - fault.at
        if loaded is not None:
            fault.parts["start"] = loaded - fault.at
        fault.named = fault.kind == "stop" or out.first_after(
            fault.at, f"failed (exitcode: -9) local_rank: {fault.rank} ") is not None
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    return RestartRun(launcher.returncode, faults, last_per_step(log), text, errors, time.monotonic() - start)


def reference(work: str, steps: int, extra=()) -> dict[int, tuple]:
    """The same job uninterrupted (its own checkpoint folder and log)."""
    launcher = launch(work, steps, max_restarts=0, ck="ref_ck", log="ref.jsonl",
                      extra=["--async-save", *extra])
    out, _ = launcher.communicate(timeout=300)
    if launcher.returncode != 0:
        raise RuntimeError(f"reference run failed: {out[-2000:]}")
    return last_per_step(os.path.join(work, "ref.jsonl"))
