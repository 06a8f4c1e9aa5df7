"""One fault-injection try: launch ``train.py`` on 2 ranks under torchrun, kill -9 one rank at a seeded
random moment (during training, or while a checkpoint is being written), then restart with --load."""
from __future__ import annotations

import glob
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

from mtds.checkpoint.complete import IncompleteCheckpoint, check_complete, find_complete, tags_newest_first

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY_MODEL = {"model_type": "gpt2", "n_embd": 32, "n_head": 2, "n_layer": 2, "vocab_size": 8192, "n_positions": 64}
TINY_DS = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
           "zero_optimization": {"stage": 1}}
LAYOUTS = (("--tp", "2"), ("--pp", "2"))
EXIT_BOUND_S = 60.0


@dataclass
class FaultResult:
    mode: str                       # "train" or "save"
    layout: str
    killed_rank: int
    killed_at_step: int             # last step logged before the kill
    exit_s: float                   # kill -> launcher gone
    launcher_named_rank: bool
    complete_after_kill: list[int] = field(default_factory=list)
    broken_visible: list[str] = field(default_factory=list)     # global_stepN folders that are not complete
    resumed_step: int | None = None
    restart_ok: bool = False
    lost_complete: list[int] = field(default_factory=list)
    exit_code: int | None = None    # the killed launch's (torchrun's default --max-restarts 0: no restart)

    @property
    def corrupt_load(self) -> bool:
        newest = max(self.complete_after_kill, default=None)
        return not self.restart_ok or self.resumed_step != (newest or 0) or bool(self.broken_visible)

    @property
    def ok(self) -> bool:
        return (self.exit_s < EXIT_BOUND_S and self.launcher_named_rank and not self.corrupt_load
                and not self.lost_complete)


def _port() -> int:
    from lab.testing import free_port
    return free_port()


def _command(work: str, layout, steps: int, extra=()) -> list[str]:
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    return [torchrun, "--nproc_per_node", "2", "--master_port", str(_port()), os.path.join(REPO, "train.py"),
            "--deepspeed_config", os.path.join(work, "ds.json"), "--model", os.path.join(work, "config.json"),
            *layout, "--seq-length", "32", "--eval-split", "0", "--steps", str(steps), "--no-progress",
            "--save", os.path.join(work, "ck"), "--save-interval", "1", "--dist-timeout", "30",
            "--log-jsonl", os.path.join(work, "log.jsonl"), *extra]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}


def _logged_steps(work: str) -> int:
    try:
        with open(os.path.join(work, "log.jsonl")) as f:
            return sum(1 for line in f if '"kind": "train"' in line)
    except FileNotFoundError:
        return 0


def _rank_pids(launcher: subprocess.Popen) -> dict[int, int]:
    """{rank: pid} of the launcher's worker processes (from /proc: their RANK environment variable)."""
    pids = {}
    for status in glob.glob("/proc/[0-9]*/status"):
        pid = int(status.split("/")[2])
        try:
            with open(status) as f:
                ppid = int(next(line for line in f if line.startswith("PPid:")).split()[1])
            if ppid != launcher.pid:
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
            pids[int(env[b"RANK"])] = pid
        except (OSError, StopIteration, KeyError, ValueError):
            continue
    return pids


def _complete_steps(ck: str) -> tuple[list[int], list[str]]:
    complete, broken = [], []
    if not os.path.isdir(ck):
        return complete, broken
    for step, name in tags_newest_first(ck):
        try:
            check_complete(os.path.join(ck, name))
            complete.append(step)
        except IncompleteCheckpoint as err:
            broken.append(f"{name}: {err}")
    return sorted(complete), broken


def write_inputs(work: str) -> None:
    os.makedirs(work, exist_ok=True)
    for name, content in (("config.json", TINY_MODEL), ("ds.json", TINY_DS)):
        with open(os.path.join(work, name), "w") as f:
            json.dump(content, f)


def run_try(work: str, seed: int, mode: str, *, steps: int = 40, timeout: float = 240.0,
            restart=None) -> FaultResult:
    """``mode`` "train": kill after a random number of logged steps; "save": kill at a random moment
    after a checkpoint's staging folder appears (so most kills land inside a save). ``restart``: runs
    the restart's train.py flags itself and returns (ok, resumed step) -- the suite's warm pooled ranks;
    by default a second torchrun launch."""
    rng = random.Random(seed)
    write_inputs(work)
    layout = LAYOUTS[rng.randrange(len(LAYOUTS))]
    victim = rng.randrange(2)
    out_path = os.path.join(work, "first.out")
    with open(out_path, "w") as out:
        launcher = subprocess.Popen(_command(work, layout, steps), cwd=REPO, env=_env(), stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
    try:
        kill_after_steps = rng.randint(1, 6)
        deadline = time.monotonic() + timeout
        while _logged_steps(work) < kill_after_steps:
            if launcher.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the first launch ended or stalled before step {kill_after_steps}; see {out_path}")
            time.sleep(0.02)
        if mode == "save":
            seen = set(glob.glob(os.path.join(work, "ck", "*.partial")))
            while not set(glob.glob(os.path.join(work, "ck", "*.partial"))) - seen:
                if launcher.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"no save started; see {out_path}")
                time.sleep(0.002)
            time.sleep(rng.uniform(0.0, 0.15))
        else:
            time.sleep(rng.uniform(0.0, 0.3))
        step = _logged_steps(work)
        pid = _rank_pids(launcher)[victim]
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        launcher.wait(timeout=EXIT_BOUND_S * 3)
        exit_s = time.monotonic() - killed
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
    with open(out_path) as f:
        text = f.read()
    named = bool(re.search(rf"rank\s*:\s*{victim} \(local_rank: {victim}\)\s*\n\s*exitcode\s*:\s*-9", text))
    complete, broken = _complete_steps(os.path.join(work, "ck"))
    result = FaultResult(mode=mode, layout=" ".join(layout), killed_rank=victim, killed_at_step=step, exit_s=exit_s,
                         launcher_named_rank=named, complete_after_kill=complete, broken_visible=broken,
                         exit_code=launcher.returncode)
    if complete:
        find_complete(os.path.join(work, "ck"))        # what --load will pick must be loadable
    command = _command(work, layout, max(complete, default=0) + 1,
                       ["--load", os.path.join(work, "ck")] if complete else [])
    if restart is not None:
        result.restart_ok, result.resumed_step = restart(command[command.index(os.path.join(REPO, "train.py")) + 1:])
    else:
        restarted = subprocess.run(command, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout)
        with open(os.path.join(work, "restart.out"), "w") as f:
            f.write(restarted.stdout + restarted.stderr)
        result.restart_ok = restarted.returncode == 0
        m = re.search(r"resumed from \S+ at step (\d+)", restarted.stdout + restarted.stderr)
        result.resumed_step = int(m.group(1)) if m else (0 if not complete and result.restart_ok else None)
    after, _ = _complete_steps(os.path.join(work, "ck"))
    result.lost_complete = sorted(set(complete) - set(after))
    return result
