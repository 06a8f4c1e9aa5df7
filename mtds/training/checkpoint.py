"""Save and resume training through DeepSpeed's checkpointing, plus what DeepSpeed does not keep:
the data-stream position, the RNG streams and a description of model and layout.

DeepSpeed writes ``DIR/global_stepN/`` (per-layer model states for pipelines, ZeRO optimizer
partitions) and ``DIR/latest``; mtds's extra state rides in ``client_state``.
"""
from __future__ import annotations

import os

import torch

from mtds.layout import ParallelGroups


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded; the message names the directory and what to do."""


def tag_for(step: int) -> str:
    return f"global_step{step}"


def save(engine, directory: str, step: int, extra: dict, groups: ParallelGroups) -> str:
    state = {
        "mtds_step": step,
        "mtds_layout": {"tp": groups.layout.tp, "pp": groups.layout.pp, "dp": groups.layout.dp},
        "mtds_rng": {"cpu": torch.get_rng_state(),
                     "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None},
        **extra,
    }
    engine.save_checkpoint(directory, tag=tag_for(step), client_state=state)
    return os.path.join(directory, tag_for(step))


def load(engine, directory: str, groups: ParallelGroups) -> tuple[int, dict]:
    """Resume ``engine`` from ``directory`` (the ``latest`` tag); return (step, client_state)."""
    if not os.path.isdir(directory):
        raise CheckpointError(f"checkpoint directory {directory!r} does not exist: check --load")
    if not os.path.isfile(os.path.join(directory, "latest")):
        raise CheckpointError(f"{directory!r} has no 'latest' file: pass the directory given to --save "
                              f"(it holds global_stepN/ folders and 'latest')")
    try:
        path, state = engine.load_checkpoint(directory, load_optimizer_states=True, load_lr_scheduler_states=True)
    except Exception as err:  # DeepSpeed raises many kinds; the user needs to know which file is bad
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise CheckpointError(f"cannot load checkpoint from {directory!r} ({type(err).__name__}: {first_line}); "
                              f"it may be partial or corrupt, or saved with a different model") from None
    if path is None or state is None:
        raise CheckpointError(f"no loadable checkpoint in {directory!r}: DeepSpeed found none for its 'latest' tag")
    saved = state.get("mtds_layout")
    if saved and (saved["tp"], saved["pp"]) != (groups.layout.tp, groups.layout.pp):
        raise CheckpointError(f"checkpoint was saved at tp={saved['tp']} pp={saved['pp']} but this run uses "
                              f"tp={groups.layout.tp} pp={groups.layout.pp}: convert it first (mtds-convert reshard)")
    rng = state.get("mtds_rng")
    if rng:
        torch.set_rng_state(rng["cpu"])
        if rng.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    return int(state.get("mtds_step", engine.global_steps)), state
