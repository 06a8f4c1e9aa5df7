"""Faults with real processes under a real launcher (torchrun), CI-sized: one kill -9 while a synchronous save is
written (``python -m lab.faults --tries 10`` runs more; kill -9 while training, with torchrun's own restart, is
tests/test_recovery.py's), SIGTERM + SIGINT with an exact restart, a NaN stop, a rendezvous that cannot complete
and a stale torch-extensions build lock."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from lab.faults.harness import (EXIT_BOUND_S, REPO, _command, _env, _logged_steps, _rank_pids, run_try,
                                 write_inputs)
from mtds.checkpoint.complete import find_complete
from lab.testing import free_port, needs_ranks, spawn
from tests.training_helpers import ds_config, train_config


def _resume(argv):
    """train.py's run of these flags on a pooled rank: (final step, steps trained)."""
    from mtds.training import run
    from mtds.training.cli import build_parser, config_from_args
    result = run(config_from_args(build_parser().parse_args(argv)))
    return result.final_step, len(result.losses)


def _pooled_restart(argv):
    """The restart after the kill on warm pooled ranks (torchrun's own restart with --load after a kill -9 with
    a write in flight is tests/test_recovery.py's first fault, its losses held to the uninterrupted run's; a
    second launch here added only its start-up): (ok, the step it resumed from)."""
    try:
        final_step, trained = spawn(_resume, 2, argv, timeout=240)[0]
    except Exception as err:          # a rank failed: the restart is not ok
        print(f"restart failed: {err}")
        return False, None
    return True, final_step - trained


@pytest.mark.parametrize("mode, seed", [("save", 1)])
def test_kill_9_of_one_rank(tmp_path, mode, seed):
    needs_ranks(2)      # a launcher starts 2 ranks: under MTDS_TEST_DEVICE=cuda, one GPU each
    r = run_try(str(tmp_path), seed, mode, restart=_pooled_restart)
    where = f"{mode} try: {r}; see {tmp_path}"
    assert r.exit_s < EXIT_BOUND_S, where
    assert r.launcher_named_rank, where
    assert not r.broken_visible, where            # no visible global_stepN folder is incomplete
    assert r.complete_after_kill, where           # saves every step: something was complete before the kill
    assert r.restart_ok and r.resumed_step == max(r.complete_after_kill), where
    assert not r.lost_complete, where
    # torchrun without --max-restarts has none: the survivor's one line says so, the job exits non-zero, no
    # rank's traceback (torchrun prints its own)
    out = (tmp_path / "first.out").read_text()
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert r.exit_code != 0, where
    assert len(errors) == 1 and "no restarts left (0 of torchrun's --max-restarts 0 used)" in errors[0], out[-3000:]
    assert "mtds/training" not in out, out[-3000:]


def _train(argv):
    """train.py's run of these flags, on a pooled rank."""
    from mtds.training import run
    from mtds.training.cli import build_parser, config_from_args
    run(config_from_args(build_parser().parse_args(argv)))


def _train_steps(path):
    with open(path) as f:
        return [json.loads(line) for line in f if '"kind": "train"' in line]


def test_sigterm_and_sigint_finish_the_step_save_exit_0_and_resume_exactly(tmp_path):
    needs_ranks(2)      # a launcher starts 2 ranks: under MTDS_TEST_DEVICE=cuda, one GPU each
    work = str(tmp_path)
    write_inputs(work)
    layout = ("--tp", "2")
    # no --save-interval: the only checkpoint is the one the signal asks for
    cmd = [a for a in _command(work, layout, 8) if a not in ("--save-interval", "1")]
    launcher = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
    try:
        while _logged_steps(work) < 2:
            assert launcher.poll() is None, launcher.stdout.read()[-3000:]
            time.sleep(0.02)
        pids = _rank_pids(launcher)
        os.kill(pids[0], signal.SIGTERM)     # a scheduler signals each process; here each its own
        os.kill(pids[1], signal.SIGINT)
        out, _ = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    assert launcher.returncode == 0, out[-3000:]
    stopped = _train_steps(os.path.join(work, "log.jsonl"))
    last = stopped[-1]["step"]
    assert 2 <= last < 8, last
    assert f"stopped after step {last} on SIG" in out and "Traceback" not in out, out[-3000:]
    assert os.path.basename(find_complete(os.path.join(work, "ck"))[0]) == f"global_step{last}"

    # The restart and the uninterrupted reference run the same flags on warm pooled ranks (torchrun's own
    # restart with --load is tests/test_recovery.py's; a pooled run of these flags gives a torchrun run's
    # losses bit for bit, which tests/test_recovery.py asserts).
    args = cmd[cmd.index(os.path.join(REPO, "train.py")) + 1:]
    spawn(_train, 2, args + ["--load", os.path.join(work, "ck")], timeout=300)
    os.rename(os.path.join(work, "log.jsonl"), os.path.join(work, "interrupted.jsonl"))
    spawn(_train, 2, [a if a != os.path.join(work, "ck") else os.path.join(work, "ref") for a in args], timeout=300)
    got = [(r["step"], r["loss"], r["grad_norm"]) for r in _train_steps(os.path.join(work, "interrupted.jsonl"))]
    want = [(r["step"], r["loss"], r["grad_norm"]) for r in _train_steps(os.path.join(work, "log.jsonl"))]
    assert got == want, (got, want)      # steps 1..last before the signal, last+1..8 after the restart


class _PoisonGrad:
    """on_engine_ready hook: NaN gradients on global rank ``rank`` in optimizer step ``step`` (1-based)."""

    def __init__(self, step, rank):
        self.step, self.rank = step, rank

    def __call__(self, engine, groups):
        if groups.rank != self.rank:
            return
        param = next(p for p in engine.module.parameters() if p.requires_grad)
        param.register_hook(lambda g: g * float("nan") if engine.global_steps == self.step - 1 else g)


def _nan_worker(root):
    from mtds.safety.numerics import NonFiniteError
    from mtds.training import run
    out = []
    # bf16 as the shipped configs run it (BF16_Optimizer, fp32 accumulation: the non-finite sums are taken
    # on its flat 16-bit gradient buffers, mtds.deepspeed_compat.bf16_flat); fp32 ZeRO-0: one sum per
    # gradient (a hook); fp32 ZeRO-1: one sum per reduce-scatter bucket (mtds.deepspeed_compat.zero1_reduce)
    bf16 = ds_config(zero=1, precision="bf16", data_types={"grad_accum_dtype": "fp32"})
    for name, kw in (("bf16", dict(deepspeed_config=bf16)),
                     ("fp32", dict(deepspeed_config=ds_config(zero=0))),
                     ("fp32-zero1", dict(deepspeed_config=ds_config(zero=1))),
                     ("skip", dict(deepspeed_config=ds_config(zero=1), on_nan="skip"))):
        try:
            result = run(train_config(tp=2, steps=4, save=f"{root}/{name}", save_interval=1, **kw),
                         on_engine_ready=(_PoisonGrad(3, 1),))
            out.append((result.skipped, result.losses))
        except NonFiniteError as err:
            out.append(str(err))
    return out


def test_nan_stops_naming_step_and_rank_and_saves_nothing_poisoned(tmp_path):
    bf16, fp32, zero1, skip = spawn(_nan_worker, 2, str(tmp_path), timeout=300)[0]
    for message in (bf16, fp32, zero1):
        # The norm is global (every rank sees the NaN); only rank 1's own gradients were poisoned.
        assert isinstance(message, str) and message.startswith("step 3: gradient norm "), message
        assert "own gradients non-finite on rank 1 (of 2)" in message and "\n" not in message, message
    for name in ("bf16", "fp32", "fp32-zero1"):
        assert os.path.basename(find_complete(str(tmp_path / name))[0]) == "global_step2"
        assert not (tmp_path / name / "global_step3").exists()
    skipped, losses = skip          # ZeRO-1 declines the poisoned update; training goes on
    assert skipped == [False, False, True, False] and all(x == x for x in losses), skip


def _single(args, env=None, timeout=120):
    return subprocess.run([sys.executable, "train.py", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**_env(), **(env or {})})


def test_rendezvous_that_cannot_complete_is_one_line_in_bounded_time():
    start = time.monotonic()
    out = _single(["--deepspeed_config", "ds_configs/cpu_fp32.json", "--dist-timeout", "3"],
                  env={"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(free_port())})
    assert time.monotonic() - start < 60
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 2 and len(errors) == 1 and "did not all join the rendezvous" in errors[0], out.stderr
    assert "1/2" in errors[0] and "Traceback" not in out.stderr


def test_stale_build_lock_is_reported_with_the_fix(tmp_path):
    (tmp_path / "ext" / "fused_adam").mkdir(parents=True)
    lock = tmp_path / "ext" / "fused_adam" / "lock"
    lock.touch()
    config = tmp_path / "adam.json"    # DeepSpeed's own Adam: a JIT build of fused_adam, waiting on the lock
    config.write_text(json.dumps({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4,
                                  "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": False}}}))
    start = time.monotonic()
    out = _single(["--deepspeed_config", str(config), "--steps", "1", "--build-lock-timeout", "2"],
                  env={"TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")})
    assert time.monotonic() - start < 90
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 2 and len(errors) == 1, out.stderr[-3000:]
    assert str(lock) in errors[0] and f"rm {lock}" in errors[0]


class _OnRankAtStep:
    """on_engine_ready hook: global rank ``rank`` calls ``act()`` as optimizer step ``step`` starts."""

    def __init__(self, step, rank, act):
        self.step, self.rank, self.act = step, rank, act

    def __call__(self, engine, groups):
        if groups.rank == self.rank:
            def at_step(module, args):
                if engine.global_steps == self.step - 1:
                    self.act()
            engine.module.register_forward_pre_hook(at_step)


def _mark(path):
    """The fault's moment on the host's clock: the test times the others' reaction from it, not from
    spawn (fresh ranks start and train two steps first, which takes what the machine's load makes it)."""
    with open(path, "w") as f:
        f.write(repr(time.time()))


def _stop_self(mark):
    _mark(mark)
    os.kill(os.getpid(), signal.SIGSTOP)


def _freeze_worker(mark):
    from mtds.training import run
    run(train_config(tp=2, steps=6, dist_timeout_s=300, heartbeat_timeout_s=5),
        on_engine_ready=(_OnRankAtStep(3, 1, lambda: _stop_self(mark)),))


def test_a_frozen_rank_is_named_and_the_others_stop_within_the_heartbeat_timeout(capfd, tmp_path):
    from lab.testing import RankFailure
    mark = tmp_path / "fault_at"
    with pytest.raises(RankFailure) as failure:
        # its own processes (one is stopped); gloo alone would wait for the 300 s collective timeout
        spawn(_freeze_worker, 2, str(mark), timeout=120, fresh=True)
    elapsed = time.time() - float(mark.read_text())
    err = capfd.readouterr().err
    assert "rank 0 failed" in str(failure.value) and "exited with code 1" in str(failure.value), failure.value
    assert "error: rank 1 has not been heard from for" in err, err[-3000:]
    assert elapsed < 60, elapsed


class _Injected(RuntimeError):
    pass


def _raise_injected(mark):
    _mark(mark)
    raise _Injected("injected")


def _failing_rank_worker(mark):
    from mtds.training import run
    try:
        run(train_config(tp=2, steps=6, dist_timeout_s=300, heartbeat_timeout_s=30),
            on_engine_ready=(_OnRankAtStep(3, 1, lambda: _raise_injected(mark)),))
    except _Injected:
        time.sleep(60)     # a caller that catches the error: the process, and its sockets, live on


def test_a_rank_that_fails_is_reported_as_failed_not_done(capfd, tmp_path):
    """Rank 1 leaves run() with an error but its process stays: rank 0, waiting in a TP all-reduce that rank 1
    will never join, must stop within the heartbeat's grace (5 s), not after gloo's 300 s or when rank 1 exits
    (60 s after its error)."""
    from lab.testing import RankFailure
    mark = tmp_path / "fault_at"
    with pytest.raises(RankFailure) as failure:
        spawn(_failing_rank_worker, 2, str(mark), timeout=120, fresh=True)   # its own processes: one exits, one lingers
    elapsed = time.time() - float(mark.read_text())
    err = capfd.readouterr().err
    assert "rank 0 failed" in str(failure.value) and "exited with code 1" in str(failure.value), failure.value
    assert "error: rank 1 left training with an error (_Injected" in err, err[-3000:]
    assert elapsed < 50, elapsed



def _reports_while_waiting(lock, limit_s, build_dir, build_for_s):
    """A thread in torch's real ``FileBaton.wait`` on ``lock`` under a watchdog of ``limit_s``, while a
    "build" writes into ``build_dir`` for ``build_for_s`` seconds: (seconds since start, message) of
    each report."""
    import threading

    from torch.utils.file_baton import FileBaton

    from mtds.safety.startup import BuildLockWatchdog
    reports, stuck = [], threading.Event()

    def on_stuck(message):
        reports.append((time.monotonic() - start, message))
        stuck.set()

    def waiter():
        with BuildLockWatchdog(limit_s, poll_s=0.1, on_stuck=on_stuck):
            FileBaton(str(lock), wait_seconds=0.05).wait()    # returns once the lock is removed

    start = time.monotonic()
    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    last_write = 0.0
    while time.monotonic() - start < build_for_s:
        (build_dir / ".ninja_log").write_text(str(time.monotonic()))
        last_write = time.monotonic() - start
        time.sleep(0.2)
    stuck.wait(timeout=limit_s * 4 + 5)
    os.remove(lock)
    thread.join(timeout=10)
    return reports, last_write


@pytest.mark.parametrize("build_for_s", [0.0, 3.0])
def test_a_build_in_progress_is_waited_for_a_stale_lock_is_not(tmp_path, build_for_s):
    """Another rank's JIT build (its folder changing) may take any time: no report while it runs; a lock
    with nothing changing beside it is reported once the limit has passed."""
    lock = tmp_path / "lock"
    lock.touch()
    reports, last_write = _reports_while_waiting(lock, 1.0, tmp_path, build_for_s)
    assert len(reports) == 1, reports
    after, message = reports[0]
    # the limit (1 s) counts from the build's last write; 0.2 s of slack for the 0.1 s poll and mtime
    assert after >= last_write + 0.8, f"reported after {after:.1f} s, {last_write:.1f} s into the build's writing"
    assert f"rm {lock}" in message and "no build activity" in message
