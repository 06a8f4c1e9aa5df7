"""``run(TrainConfig)``: a training run in four phases, each on every rank, in this order (first of all,
``deepspeed_compat.check_installed``: the DeepSpeed internals mtds relies on exist as expected).

  1. set up the world (``world.setup_world``): torch.distributed with the collective tracer (which must
     wrap functions before DeepSpeed caches them), heartbeat, layout checked against the world size and
     the model, process groups, RNG streams
  2. build the run (``build.build_run``): DeepSpeed config for the layout and the schedule's checks,
     logger, data (rank 0 tokenizes into the cache first), model, DeepSpeed engine and the gradient
     patches mtds installs on it (checked by ``deepspeed_compat.check_engine``), then the caller's
     probes; precision and ZeRO stage are decided here
  3. resume (``resume`` below): weights, optimizer, RNG and data position from ``--load`` (which
     ``load_or_start`` checked between phases 1 and 2: a missing or empty directory starts from scratch)
  4. train (``train_loop.train``): the step loop; logging, NaN/inf checks, replica checks, evaluation,
     checkpoints, signals, timeline and tracer are step hooks (``hooks.step_hooks``)

docs/training_loop.md walks the phases and hooks.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import torch.distributed as dist

from mtds.deepspeed_compat import check_installed
from mtds.safety.heartbeat import Heartbeat
from mtds.safety.signals import StopRequest
from mtds.safety.startup import BuildLockWatchdog

from mtds.checkpoint import lifecycle as ckpt
from mtds.training.build import BuiltRun, build_run
from mtds.training.config import TrainConfig
from mtds.training.result import RunResult
from mtds.training.train_loop import train
from mtds.training.world import World, setup_world

__all__ = ["RunResult", "run", "resume", "load_or_start"]


def run(cfg: TrainConfig, *, on_engine_ready: Sequence[Callable] = ()) -> RunResult:
    """Train as ``cfg`` says. ``on_engine_ready``: functions called as ``fn(engine, groups)`` on every rank
    once the engine and mtds's patches exist, before the first step (test probes, benchmark counters)."""
    # SIGTERM/SIGINT from here on end the run after the current step (with a checkpoint); a JIT build
    # lock left by a killed build ends start-up with an error instead of a silent hang.
    stop = StopRequest().install()
    heartbeat = Heartbeat(cfg.heartbeat_timeout_s)     # started once the process group exists
    error = None
    try:
        with BuildLockWatchdog(cfg.build_lock_timeout_s) as watchdog:
            check_installed()   # the DeepSpeed internals mtds relies on, before anything starts
            world = setup_world(cfg, heartbeat)
            cfg = load_or_start(cfg, world)    # --load: before data and model; missing/empty starts afresh
            built = build_run(cfg, world, watchdog, on_engine_ready)
            try:
                start_step = resume(built)
                return train(built, start_step, stop)
            finally:
                release(built)
    except BaseException as err:     # the peers must not take a failed rank for a finished one
        error = err
        raise
    finally:
        heartbeat.stop(error)
        stop.uninstall()


def release(built: BuiltRun) -> None:
    """Take off the gradient hooks the run put on its parameters (mtds's non-finite check, DeepSpeed's
    optimizer hooks): each refers back to the engine from inside autograd, a reference cycle through C++
    that Python's gc cannot see, so without this every engine -- with its process groups, their threads,
    and its tensors -- lives as long as the process (a benchmark or a test process runs many). Not every
    such cycle: DeepSpeed's hooks on the last stage's loss and on ZeRO-3's module outputs still keep their
    engine (the test pool empties those: lab/testing/reset.py)."""
    if built.nonfinite is not None:
        built.nonfinite.remove()
    destroy = getattr(built.engine, "destroy", None)
    if destroy is not None:
        destroy()
    if built.world.layout.ep > 1:
        from mtds.deepspeed_compat.expert_groups import release_expert_groups
        release_expert_groups(built.world.layout.ep)


def load_or_start(cfg: TrainConfig, world: World) -> TrainConfig:
    """``cfg`` as the run will go: with ``--load D`` where D does not exist or is empty (or holds only an
    unfinished first save) the run starts from scratch, saying so in one line, so that ``--save D --load D``
    is the command for the first launch and for every restart. A D that is not a checkpoint directory, or
    holds none complete, ends the run here, before the data and the model are set up. What D holds was read
    once, in :func:`mtds.training.world.setup_world` (``world.load``)."""
    plan = world.load
    if plan is None:
        return cfg
    if plan.error:
        raise ckpt.CheckpointError(plan.error)
    if plan.fresh_start is None:
        return cfg
    if dist.get_rank() == 0:
        print(plan.fresh_start, flush=True)
    return dataclasses.replace(cfg, load=None)


def resume(built: BuiltRun) -> int:
    """With ``--load``: restore the newest complete checkpoint into the engine, the RNG streams and the
    data position; the step to continue after (0 without ``--load``)."""
    cfg = built.cfg
    if not cfg.load:
        return 0
    start_step, state = ckpt.load(built.engine, cfg.load, built.world.groups, model_cfg=built.world.model_cfg,
                                  rng_tracker=built.world.rng, log=built.logger.info)
    if "data" in state:   # weights-only checkpoints (mtds-convert hf-to-mtds) start the data afresh
        built.stream.load_state_dict(state["data"])
    built.logger.start_at(start_step)
    built.logger.info(f"resumed from {cfg.load} at step {start_step} ({built.stream.consumed_samples} samples consumed)")
    return start_step
