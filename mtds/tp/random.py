"""Random-number streams for tensor parallelism, and recomputation that replays them.

Dropout on a *replicated* activation (after a row-parallel all-reduce) must drop the same elements
on every TP rank, so it uses the default generator, seeded identically on all TP ranks of a pipeline
stage. Dropout on a *sharded* activation (attention probabilities of this rank's heads, sequence
slices) must differ between ranks, so it runs inside ``tracker.fork()``, which swaps in a generator
seeded with ``seed + 100 * pp_rank + 2718 + tp_rank``. Each pipeline stage has its own seed
(``seed + 100 * pp_rank``), so stages never replay one another's masks.

The tracker is an object handed to the model, not a module global; :func:`checkpoint` captures its
states at forward time and restores them for the recomputation, so replayed dropout masks match.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.utils.checkpoint

MODEL_PARALLEL_RNG = "model-parallel-rng"
# Megatron's offset between the data-parallel seed and the tensor-parallel stream.
TP_SEED_OFFSET = 2718
# Megatron's offset between pipeline stages' seeds.
PP_SEED_OFFSET = 100


def _device_type(device: torch.device | str | None) -> str:
    return torch.device(device).type if device is not None else "cpu"


def get_rng_state(device_type: str) -> torch.Tensor:
    return torch.cuda.get_rng_state() if device_type == "cuda" else torch.get_rng_state()


def set_rng_state(state: torch.Tensor, device_type: str) -> None:
    if device_type == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


class RNGTracker:
    """Named RNG states that can be forked into, saved, restored."""

    def __init__(self, device: torch.device | str | None = None):
        self.device_type = _device_type(device)
        self._states: dict[str, torch.Tensor] = {}

    def add(self, name: str, seed: int) -> None:
        if name in self._states:
            raise ValueError(f"RNG state {name!r} already exists")
        saved = get_rng_state(self.device_type)
        if self.device_type == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        self._states[name] = get_rng_state(self.device_type)
        set_rng_state(saved, self.device_type)

    def get_states(self) -> dict[str, torch.Tensor]:
        return {name: state.clone() for name, state in self._states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._states = {name: state.clone() for name, state in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        """Run the block with the named stream, then put the default generator back untouched."""
        if name not in self._states:
            raise KeyError(f"RNG state {name!r} was never added (call model_parallel_seed first)")
        outside = get_rng_state(self.device_type)
        set_rng_state(self._states[name], self.device_type)
        try:
            yield
        finally:
            self._states[name] = get_rng_state(self.device_type)
            set_rng_state(outside, self.device_type)


def model_parallel_seed(seed: int, tp_rank: int, device: torch.device | str | None = None,
                        pp_rank: int = 0) -> RNGTracker:
    """Seed the default generator with ``seed + 100 * pp_rank`` (same on all TP ranks of a stage, so
    replicated regions drop alike; different per pipeline stage, so stages do not replay each other's
    masks) and return a tracker whose model-parallel stream is seeded with that + 2718 + ``tp_rank``
    (distinct per TP rank and per stage). Megatron's offsets (``_set_random_seed``,
    ``model_parallel_cuda_manual_seed``)."""
    device_type = _device_type(device)
    stage_seed = seed + PP_SEED_OFFSET * pp_rank
    torch.manual_seed(stage_seed)
    if device_type == "cuda":
        torch.cuda.manual_seed(stage_seed)
    tracker = RNGTracker(device)
    tracker.add(MODEL_PARALLEL_RNG, stage_seed + TP_SEED_OFFSET + tp_rank)
    return tracker


def seed_parallel_streams(seed: int, groups, device: torch.device | str | None = None) -> RNGTracker:
    """:func:`model_parallel_seed` for this rank's place in ``groups`` (a ``ParallelGroups``)."""
    return model_parallel_seed(seed, groups.tp_rank, device, pp_rank=groups.pp_rank)


def checkpoint(function: Callable[..., Any], tracker: RNGTracker | None, *args: Any) -> Any:
    """Activation recomputation (non-reentrant) that replays default *and* tracker RNG streams.

    torch saves and restores the default generator itself; ``context_fn`` adds the tracker states.
    """
    if tracker is None:
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)

    def context_fn():
        saved = tracker.get_states()

        @contextlib.contextmanager
        def replay():
            current = tracker.get_states()
            tracker.set_states(saved)
            try:
                yield
            finally:
                tracker.set_states(current)

        return contextlib.nullcontext(), replay()

    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, context_fn=context_fn)
