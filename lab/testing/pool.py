"""A pool of live ranks of one world size that runs test bodies one after another.

Starting a rank costs far more than most test bodies: it imports torch, DeepSpeed and transformers
and joins a process group (seconds each, times the world size, on two cores). A :class:`RankPool`
pays that once per world size for the whole session, like DeepSpeed's ``reuse_dist_env`` test
environment: its ranks start from a forkserver that has those imports done (``spawn`` on CUDA, see
:func:`mtds.local_ranks.rank_setup.start_context`), join one process group,
then loop -- take a body, run it, meet at a barrier, put the process back as a fresh one was
(:class:`lab.testing.reset.ProcessState`), report.

A body that raises, hangs past its timeout, or kills its process fails its call with one
:class:`~mtds.local_ranks.rank_setup.RankFailure` carrying every rank's traceback (ranks that did not report are
asked for their Python stacks with ``faulthandler`` first) and the tail of each rank's log; the pool
is then torn down and the next call starts a new one, so a failure never leaks into the next test.

Each rank's stdout/stderr go to a log file of its own (the pool outlives any one test's capture).
"""
from __future__ import annotations

import faulthandler
import gc
import os
import pickle
import queue
import shutil
import signal
import tempfile
import time
import traceback
from typing import Any, Callable

from mtds.local_ranks.rank_setup import PORT_IN_USE, RankFailure, free_port, join_group, leave, start_context

GROUP_TIMEOUT_S = 1800     # gloo's own limit; the caller's timeout (much shorter) kills a hung body first
START_TIMEOUT_S = 300
# A DeepSpeed engine registers gradient hooks on its parameters that refer back to the engine: a cycle
# through C++ that Python's gc cannot see. mtds.training.run takes them off at its end
# (mtds.training.job.release), and the reset empties what a body still left alive
# (lab.testing.reset._release_leaked_engines), so engines go with their bodies, and their process
# groups (gloo: three threads each) too. Should something else leak groups, the pool starts anew once a
# rank holds more threads than this (2-8 s; a fresh process would have had ~6).
RECYCLE_THREADS = 150
STACK_GRACE_S = 3.0        # after a failure: time for the other ranks to report before stacks are dumped


# DeepSpeed modules that its engine or ZeRO import only when first used (seen in the pool's logs,
# DeepSpeed 0.19.8): imported up front so that the reset state records them fresh.
DEEPSPEED_LAZY = ("deepspeed.ops.op_builder.all_ops", "deepspeed.comm.mori", "deepspeed.module_inject.auto_ep_presets",
                  "deepspeed.runtime.superoffload.superoffload_stage3", "deepspeed.runtime.zero.muon.muon_optimizer",
                  "deepspeed.checkpoint.autoep_universal")


def _import_everything() -> None:
    """Import every mtds module (and what it imports of DeepSpeed) before the reset state is taken."""
    import importlib
    import pkgutil

    import lab
    import mtds
    for package in (mtds, lab):
        for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
            if info.name.startswith("lab.testing") or info.name.endswith(".__main__"):    # scripts: they run
                continue
            importlib.import_module(info.name)
    for name in DEEPSPEED_LAZY:
        try:
            importlib.import_module(name)
        except ImportError:       # another DeepSpeed version: recorded after its first body instead
            pass


def threads_per_rank(world: int) -> int:
    """The machine's cores shared out: a world of one gets them all (it would leave a core idle with one
    thread), a world larger than the cores one thread per rank."""
    return max(1, len(os.sched_getaffinity(0)) // world)


def _rank_main(rank: int, world: int, port: int, device: str, log_path: str, tasks, results) -> None:
    """Body of one pooled rank: start, then run bodies until told to stop (``None``)."""
    log = open(log_path, "a", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    faulthandler.register(signal.SIGUSR1, file=log, all_threads=True)
    code = 0
    try:
        join_group(rank, world, port, device, GROUP_TIMEOUT_S, threads=threads_per_rank(world))
        import torch.distributed as dist
        _import_everything()
        from lab.testing.reset import ProcessState
        state = ProcessState()
        # The ~1M objects of torch, DeepSpeed and transformers live as long as the rank: out of gc's sight,
        # the reset's gc.collect and its scan for leaked engines (gc.get_objects) take ~25 ms, not ~1 s, per
        # body (and the bodies' own full collections shrink alike). Only objects alive now are frozen: what
        # a body makes is collected, and scanned for, as before.
        gc.collect()
        gc.freeze()
        results.put((rank, 0, True, b"ready"))
        while True:
            task = tasks.get()
            if task is None:
                break
            seq, payload = task
            try:
                fn, args, env = pickle.loads(payload)
                os.environ.update(env)
                value = pickle.dumps(fn(*args))
                dist.barrier()
                new_modules, problems = state.restore()
                leaked = state.leaked_threads()
                if problems or leaked:
                    raise RuntimeError(f"rank {rank} could not be reset after the body: attributes {problems}, "
                                       f"threads left running {leaked}")
                if new_modules:
                    print(f"[pool] body {seq} imported {len(new_modules)} tracked modules first: "
                          f"{new_modules[:8]}", flush=True)
            except BaseException:
                results.put((rank, seq, False, traceback.format_exc()))
                code = 1
                break
            results.put((rank, seq, True, (value, len(os.listdir("/proc/self/task")))))
        if code == 0:
            dist.destroy_process_group()
    except BaseException:
        results.put((rank, -1, False, traceback.format_exc()))
        code = 1
    finally:
        leave(results, code)


class RankPool:
    """``world`` live ranks; :meth:`run` sends them one body (see the module docstring)."""

    def __init__(self, world: int, device: str = "cpu"):
        self.world = world
        self.device = device
        self.procs: list = []
        self.bodies = 0
        self.starts = 0
        self._seq = 0
        self._logdir = tempfile.mkdtemp(prefix=f"mtds-pool{world}-")

    @property
    def alive(self) -> bool:
        return bool(self.procs) and all(p.is_alive() for p in self.procs)

    def remove_logs(self) -> None:
        shutil.rmtree(self._logdir, ignore_errors=True)

    def log_path(self, rank: int) -> str:
        return os.path.join(self._logdir, f"rank{rank}.log")

    def _start(self) -> None:
        for attempt in range(3):
            try:
                return self._start_once(free_port())
            except RankFailure as failure:
                self.close(kill=True)
                if PORT_IN_USE not in str(failure) or attempt == 2:
                    raise

    def _start_once(self, port: int) -> None:
        ctx = start_context(self.device)
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(self.world)]
        self.procs = [ctx.Process(target=_rank_main, daemon=True,
                                  args=(r, self.world, port, self.device, self.log_path(r), self.tasks[r],
                                        self.results)) for r in range(self.world)]
        for p in self.procs:
            p.start()
        self.starts += 1
        self._offsets = [0] * self.world
        self._collect(0, START_TIMEOUT_S, "start")

    def run(self, fn: Callable, args: tuple, timeout: float, env: dict[str, str] | None = None) -> list[Any]:
        """Run ``fn(*args)`` on every rank; per-rank results in rank order, or RankFailure."""
        if not self.alive:
            self.close()
            self._start()
        payload = pickle.dumps((fn, args, dict(env or {})))
        self._seq += 1
        self._offsets = [_size(self.log_path(r)) for r in range(self.world)]
        for q in self.tasks:
            q.put((self._seq, payload))
        values = self._collect(self._seq, timeout, "body")
        self.bodies += 1
        if max(threads for _, threads in values.values()) > RECYCLE_THREADS:
            self.close()          # a new pool for the next body: see RECYCLE_THREADS
        return [pickle.loads(values[r][0]) for r in range(self.world)]

    def _collect(self, seq: int, timeout: float, what: str) -> dict[int, Any]:
        deadline = time.monotonic() + timeout
        values: dict[int, Any] = {}
        failures: dict[int, str] = {}
        while len(values) + len(failures) < self.world and time.monotonic() < deadline:
            try:
                rank, got_seq, ok, value = self.results.get(timeout=min(1.0, max(0.01, deadline - time.monotonic())))
            except queue.Empty:
                for r, p in enumerate(self.procs):
                    if p.exitcode is not None and r not in values and r not in failures:
                        failures[r] = f"exited with code {p.exitcode} before reporting"
                if failures:
                    break
                continue
            if got_seq not in (seq, -1):
                continue
            (values if ok else failures)[rank] = value
        if failures and len(values) + len(failures) < self.world:
            # The others are most likely waiting in a collective for the failed rank: give them a moment
            # to fail on their own, then take their stacks.
            grace = time.monotonic() + STACK_GRACE_S
            while len(values) + len(failures) < self.world and time.monotonic() < grace:
                try:
                    rank, got_seq, ok, value = self.results.get(timeout=0.2)
                    if got_seq in (seq, -1):
                        (values if ok else failures)[rank] = value
                except queue.Empty:
                    pass
        if not failures and len(values) == self.world:
            return values
        missing = [r for r in range(self.world) if r not in values and r not in failures]
        stacks = self._stacks(missing)
        self.close(kill=True)
        if failures:
            first = next(iter(failures))
            detail = "\n".join(f"--- rank {r} ---\n{failures[r]}" for r in sorted(failures))
            raise RankFailure(f"rank {first} failed ({len(failures)} of {self.world} ranks) in the pool's {what}\n"
                              f"{detail}{stacks}")
        raise RankFailure(f"ranks {missing} did not finish within {timeout:.0f} s (hang or deadlock){stacks}")

    def _stacks(self, ranks: list[int]) -> str:
        """Python stacks of ranks that did not report (faulthandler, SIGUSR1), and their log tails."""
        for r in ranks:
            if self.procs[r].is_alive():
                os.kill(self.procs[r].pid, signal.SIGUSR1)
        time.sleep(0.5 if ranks else 0)
        parts = []
        for r in range(self.world):
            tail = _tail(self.log_path(r), self._offsets[r] if r < len(self._offsets) else 0)
            if tail.strip():
                parts.append(f"--- rank {r} output{' and stack (did not report)' if r in ranks else ''} ---\n{tail}")
        return ("\n" + "\n".join(parts)) if parts else ""

    def close(self, kill: bool = False) -> None:
        """Stop the ranks: asked to leave when idle, killed after a failure (they may be stuck)."""
        procs, self.procs = self.procs, []
        if not procs:
            return
        if not kill and all(p.is_alive() for p in procs):
            for q in self.tasks:
                q.put(None)
            deadline = time.monotonic() + 10
            for p in procs:
                p.join(timeout=max(0.1, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _tail(path: str, offset: int, limit: int = 6000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(max(offset, _size(path) - limit))
            return f.read().decode(errors="replace")
    except OSError:
        return ""
