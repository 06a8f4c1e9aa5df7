"""Random-number streams for tensor parallelism, and recomputation that replays them.

Dropout on a *replicated* activation (after a row-parallel all-reduce) must drop the same elements
on every TP rank, so it uses the default generator, seeded identically on all TP ranks. Dropout on a
*sharded* activation (attention probabilities of this rank's heads, sequence slices) must differ
between ranks, so it runs inside ``tracker.fork()``, which swaps in the tracker's model-parallel stream.

Where the streams start. Training keys them per layer forward (:meth:`RNGTracker.key_dropout`): on
entering ``tracker.layer(i)`` both streams are set from a hash of (seed, step, data-parallel rank,
micro-batch, global layer i), the sharded one also of the TP rank. A layer's masks then depend on what it
computes, not on where or when it runs: every pipeline schedule (1F1B, interleaved, ZB-H1, DualPipeV)
and every pipeline depth draws the same masks, a resumed run draws the uninterrupted run's masks, and no
two layers or stages share one. The micro-batch is this layer's forward count within the step: every
schedule runs a chunk's forwards in micro-batch order. Unkeyed (a tracker built by hand),
``layer()`` does nothing and the streams run on from their seeds: Megatron's scheme (stage seed
``seed + 100 * pp_rank``, model-parallel stream ``+ 2718 + tp_rank``), which ties masks to execution order.

Inside a keyed layer nothing swaps generator states per dropout (``--compile`` cannot trace a swap: each
was a graph break, four graphs per GPT-2 layer with dropout): the layer draws its replicated masks first
(:meth:`RNGTracker.replicated_masks`, the masks ``nn.Dropout`` would draw, in the same order), then runs
its whole forward with the sharded stream in the default generator (:meth:`RNGTracker.sharded`), so
attention dropout and sequence-parallel dropout draw from it directly. The masks are the ones the
per-dropout swaps drew. Unkeyed, every sharded dropout runs inside ``fork()``.

The tracker is an object handed to the model, not a module global; :func:`checkpoint` captures its
states (and the forward counts) at forward time and restores them for the recomputation, so replayed
dropout masks match.
"""
from __future__ import annotations

import contextlib
import hashlib
import struct
from typing import Any, Callable

import torch
import torch.utils.checkpoint

MODEL_PARALLEL_RNG = "model-parallel-rng"
# Megatron's offset between the data-parallel seed and the tensor-parallel stream.
TP_SEED_OFFSET = 2718
# Megatron's offset between pipeline stages' seeds.
PP_SEED_OFFSET = 100
# The replicated stream's place in the key where the sharded stream puts its TP rank.
REPLICATED_STREAM = -1


def stream_seed(*key: int) -> int:
    """A 63-bit seed from integers: any change in any of them gives an unrelated stream."""
    digest = hashlib.blake2b(struct.pack(f"<{len(key)}q", *key), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def seeded_state(seed: int, device_type: str) -> torch.Tensor:
    """A generator state for ``seed`` on the device, without touching any global generator."""
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else "cpu"
    return torch.Generator(device=device).manual_seed(seed).get_state()


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
        self._key: tuple[int, int, int] | None = None     # (seed, tp rank, dp rank) once keyed
        self._step = 0
        self._forwards: dict[int, int] = {}                # global layer -> forwards so far this step
        self.replaying = False      # inside a recomputation's replay of a forward (checkpoint below)
        # the default generator holds the sharded stream (sharded()): sharded dropout draws without fork()
        self.in_sharded_stream = False

    def key_dropout(self, seed: int, *, tp_rank: int, dp_rank: int) -> None:
        """From now on :meth:`layer` sets both streams from (seed, step, ``dp_rank``, micro-batch,
        layer[, ``tp_rank``]). Needs the model-parallel stream added (it is overwritten per layer)."""
        if MODEL_PARALLEL_RNG not in self._states:
            raise KeyError(f"RNG state {MODEL_PARALLEL_RNG!r} was never added (call model_parallel_seed first)")
        self._key = (seed, tp_rank, dp_rank)

    def begin_step(self, step: int) -> None:
        """Call before each training step's first forward: micro-batches count from 0 again."""
        self._step = step
        self._forwards = {}

    @contextlib.contextmanager
    def layer(self, index: int):
        """Run global layer ``index``'s forward for the next micro-batch on its own keyed streams (a
        no-op when unkeyed); yields whether it keyed them. The default generator is put back afterwards,
        so code outside layers never sees the reseeding."""
        if self._key is None:
            yield False
            return
        seed, tp_rank, dp_rank = self._key
        micro_batch = self._forwards.get(index, 0)
        self._forwards[index] = micro_batch + 1
        key = (seed, self._step, dp_rank, micro_batch, index)
        outside = get_rng_state(self.device_type)
        set_rng_state(seeded_state(stream_seed(*key, REPLICATED_STREAM), self.device_type), self.device_type)
        self._states[MODEL_PARALLEL_RNG] = seeded_state(stream_seed(*key, tp_rank), self.device_type)
        try:
            yield True
        finally:
            set_rng_state(outside, self.device_type)

    @staticmethod
    def replicated_masks(like: torch.Tensor, p: float, count: int, context=None) -> tuple[torch.Tensor, ...]:
        """``count`` dropout masks of ``like``'s shape, dtype and device from the default generator, scaled
        by 1/(1-p): the masks ``nn.Dropout`` would draw in turn (``bernoulli_(1-p)`` then ``div_(1-p)``),
        so ``x * mask`` equals its output bit for bit. Drawn before a compiled forward, which then only
        multiplies.

        ``context`` (a :class:`mtds.cp.context.ContextParallel`): ``like`` [b, s/c, ...] holds this rank's
        tokens of a whole sequence; each mask is drawn for the whole sequence, as at c = 1 (the c ranks of a
        group share the stream), and the rows of this rank's positions kept: the masks of any c are those
        of c = 1. The cost: each rank draws c times its share (one whole-sequence mask at a time)."""
        if context is None:
            return tuple(torch.empty_like(like).bernoulli_(1 - p).div_(1 - p) for _ in range(count))
        seq = like.shape[1] * context.size
        index = context.positions(seq, like.device)
        whole = (like.shape[0], seq, *like.shape[2:])
        return tuple(torch.empty(whole, dtype=like.dtype, device=like.device).bernoulli_(1 - p)
                     .index_select(1, index).div_(1 - p) for _ in range(count))

    @contextlib.contextmanager
    def sharded(self):
        """Put the sharded (model-parallel) stream in the default generator for the block, flagged so
        sharded dropout draws from it without ``fork()``; its state is kept on exit, as ``fork()`` keeps it."""
        if self.in_sharded_stream:
            yield
            return
        outside = get_rng_state(self.device_type)
        set_rng_state(self._states[MODEL_PARALLEL_RNG], self.device_type)
        self.in_sharded_stream = True
        try:
            yield
        finally:
            self.in_sharded_stream = False
            self._states[MODEL_PARALLEL_RNG] = get_rng_state(self.device_type)
            set_rng_state(outside, self.device_type)

    def sharded_dropout(self):
        """The context for dropout on a sharded activation: ``fork()``, or nothing while :meth:`sharded`
        already holds the stream (what lets ``--compile`` trace the layer)."""
        return contextlib.nullcontext() if self.in_sharded_stream else self.fork()

    def snapshot(self) -> tuple:
        """Everything a recomputation must see as the forward saw it: the states, forward counts, and
        whether the sharded stream was in the default generator (then torch's checkpoint restores it, and
        a replay must not fork; today the attention core is a layer's first sharded draw, where the fork's
        state and the restored one coincide, but nothing should rest on that order)."""
        return self.get_states(), dict(self._forwards), self._step, self.in_sharded_stream

    def restore(self, snapshot: tuple) -> None:
        states, forwards, self._step, self.in_sharded_stream = snapshot
        self.set_states(states)
        self._forwards = dict(forwards)

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

    def accepts(self, states: dict[str, torch.Tensor]) -> bool:
        """Whether ``states`` are generator states of this tracker's device type (a CPU generator's state
        is 5,056 bytes, a CUDA one's 16: one saved on the other kind cannot be set here)."""
        size = get_rng_state(self.device_type).numel()
        return all(state.numel() == size for state in states.values())

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
    """:func:`model_parallel_seed` for this rank's place in ``groups`` (a ``ParallelGroups``), with
    dropout keyed per layer forward (:meth:`RNGTracker.key_dropout`): what training uses."""
    tracker = model_parallel_seed(seed, groups.tp_rank, device, pp_rank=groups.pp_rank)
    tracker.key_dropout(seed, tp_rank=groups.tp_rank, dp_rank=groups.dp_rank)
    return tracker


def checkpoint(function: Callable[..., Any], tracker: RNGTracker | None, *args: Any) -> Any:
    """Activation recomputation (non-reentrant) that replays default *and* tracker RNG streams.

    torch saves and restores the default generator itself; ``context_fn`` adds the tracker's states
    and forward counts (a keyed layer inside the recomputed block must see its own micro-batch again).
    """
    if tracker is None or (tracker.in_sharded_stream and torch.compiler.is_compiling()):
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)
    return _tracked_checkpoint(function, tracker, *args)


class _Replay:
    """The recomputation's context: the tracker as the forward left it, then back. A class, not a generator
    context, because one checkpoint can be recomputed more than once: DeepSpeed's pipeline runs backward
    once per floating-point output of a stage (an MoE pipeline's (hidden, probs)), each recomputing."""

    def __init__(self, tracker: "RNGTracker", saved: tuple):
        self.tracker, self.saved, self.current = tracker, saved, None

    def __enter__(self):
        self.current = self.tracker.snapshot()
        self.tracker.restore(self.saved)
        self.tracker.replaying = True

    def __exit__(self, *exc):
        self.tracker.replaying = False
        self.tracker.restore(self.current)


@torch.compiler.disable
def _tracked_checkpoint(function: Callable[..., Any], tracker: RNGTracker, *args: Any) -> Any:
    """Dynamo cannot trace a checkpoint with a ``context_fn`` ("checkpoint not implemented for ...
    context_fn"), so under ``--compile`` the recomputed block runs eagerly: the compiled layer is split
    there (its parts before and after stay compiled) and the tracker's streams replay as without compile."""
    def context_fn():
        return contextlib.nullcontext(), _Replay(tracker, tracker.snapshot())

    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, context_fn=context_fn)
