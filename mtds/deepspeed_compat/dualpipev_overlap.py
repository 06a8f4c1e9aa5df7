"""DualPipeV with ``--overlap-moe-expert-parallel-comm``: one chunk's expert-parallel all-to-all hidden behind
the other chunk's compute.

In DualPipeV's steady state (DeepSpeed's ``DualPipeVSchedule``) a ``ForwardPass`` of one phase is followed,
with no instruction between them, by a ``BackwardPass`` of the other phase: two different micro-batches on two
different stages of this rank, with no data between them. Run one after the other, each waits on its own MoE
blocks' dispatch and combine all-to-alls with nothing to do meanwhile. Here such a pair runs at once: the
backward on a second thread, the forward on the main thread; while one waits on its exchange, the other
computes.

Why threads (design (a)) and not one thread cut into pieces at the dispatch and combine (Megatron-core's
combined 1F1B, design (b)): DeepSpeed's engine runs each pass as one opaque call (``DeepSpeedEngine.forward``
and ``backward``, with its hooks), and autograd runs a backward graph whole; cutting them into pieces means
re-implementing both passes outside DeepSpeed. Threads keep every pass DeepSpeed's own and cost three things,
each handled here:

* collective order. Every collective of the pair runs on a process group owned by its side: the forward's
  all-to-alls on the block's expert-parallel group, their backward on a duplicate group over the same ranks
  (``AllToAllDispatcher.backward_group``, stored in each exchange's autograd context, not read from a
  global). The two ranks of an expert group run the same instruction stream, so each group sees the same
  collective order on both. The pair holds no p2p: DeepSpeed's ``CommitP2P`` comes before it, the sends
  after it, all on the main thread. What else would put a collective inside a pass is refused by the
  rulebook (mtds.rules.experts.overlap_comm): tensor, sequence and context parallelism (their groups are not
  duplicated), recompute and dropout (the recomputed forward's collectives and the RNG state would be shared),
  ZeRO-2/3 on a pipeline (their reductions run inside the backward), 16-bit precision (not verified).
* engine state. The active phase (``is_last_stage`` reads it) is per thread here; the backward thread does not
  switch the module's exposed phase (a backward reads no ``forward_funcs``), so the forward's stays. The two
  passes of a pair are of different phases, so at most one is the loss stage's and ``self.loss`` has one
  writer; buffers are per micro-batch. The ZeRO optimizer's backward-hook bookkeeping is reset by every
  forward (``clear_backward_seen_flag``): that reset runs once before the pair, as it would run first when
  the two passes run in order, and is a no-op during it.
* the host. On CPU ranks (gloo) a thread waiting on an exchange releases the GIL and the other thread's
  kernels run on another core's worth of time: the overlap the timeline shows (``a2a`` spans of one phase
  inside the ``B`` span of the other). On NCCL GPUs both threads enqueue on the current CUDA stream and an
  all-to-all runs on NCCL's stream once the kernels enqueued before it finish: the thread hides the host's
  side (launches, the counts' host sync of the dispatch); kernel-level overlap would need the backward on a
  second stream, which is not built (not measured on a GPU either).

The values are those of the plain schedule: the same passes of the same micro-batches, each in its own
order; only their interleaving on the host moves. tests/test_moe_schedules.py holds losses and pre-clip
grad norms to the plain DualPipeV run's within 1e-6.
"""
from __future__ import annotations

import contextlib
import threading

import torch
from deepspeed.runtime.pipe import schedule as ds_schedule
from deepspeed.runtime.pipe.dualpipev import DualPipeVEngine


class _ThreadState(threading.local):
    phase = None            # the engine's active phase, as this thread sees it
    backward_only = False   # this thread runs a pair's backward: it leaves the module's exposed phase alone


class OverlappedDualPipeVEngine(DualPipeVEngine):
    """DeepSpeed's ``DualPipeVEngine`` whose adjacent ``ForwardPass``/``BackwardPass`` of the two phases run at
    once (see the module docstring). Made from a built engine by :func:`install_cross_chunk_overlap`."""

    @property
    def _active_phase(self):
        return self._mtds_thread_state.phase

    @_active_phase.setter
    def _active_phase(self, value):
        self._mtds_thread_state.phase = value

    @contextlib.contextmanager
    def _phase(self, phase):
        if not self._mtds_thread_state.backward_only:
            with super()._phase(phase):
                yield
        else:
            self._active_phase = phase
            try:
                yield
            finally:
                self._active_phase = None

    def _exec_schedule(self, pipe_schedule):
        # DeepSpeed's PipelineEngine._exec_schedule, with the pairs run at once
        self._reserve_pipe_buffers(pipe_schedule.num_pipe_buffers())
        self.fwd_outputs = []
        for step_cmds in pipe_schedule:
            k = 0
            while k < len(step_cmds):
                cmd = step_cmds[k]
                nxt = step_cmds[k + 1] if k + 1 < len(step_cmds) else None
                if _pair(cmd, nxt) and torch.is_grad_enabled():
                    self._exec_pair(cmd, nxt)
                    k += 2
                    continue
                self._handler(cmd)(self, **cmd.kwargs)
                k += 1

    def _handler(self, cmd):
        if type(cmd) not in self._INSTRUCTION_MAP:
            raise RuntimeError(f'{self.__class__.__name__} does not understand instruction {repr(cmd)}')
        return self._INSTRUCTION_MAP[type(cmd)]

    def _exec_pair(self, forward, backward) -> None:
        """``backward`` on a second thread while ``forward`` runs here (both through the instruction map, so
        the timeline's and ZeRO's wrappers run as for lone passes)."""
        run_forward, run_backward = self._handler(forward), self._handler(backward)
        optimizer = self.optimizer
        reset = getattr(optimizer, "clear_backward_seen_flag", None)
        if reset is not None:
            reset()     # the forward's, first, as in order; then a no-op for the forward below
            optimizer.clear_backward_seen_flag = _nothing
        failed = []

        def backward_side():
            self._mtds_thread_state.backward_only = True
            try:
                run_backward(self, **backward.kwargs)
            except BaseException as exc:     # re-raised on the main thread
                failed.append(exc)

        thread = threading.Thread(target=backward_side, name="dualpipev-backward", daemon=True)
        thread.start()
        try:
            run_forward(self, **forward.kwargs)
        finally:
            thread.join()
            if reset is not None:
                del optimizer.clear_backward_seen_flag
        if failed:
            raise failed[0]


def _nothing():
    return None


def _pair(cmd, nxt) -> bool:
    return isinstance(cmd, ds_schedule.ForwardPass) and isinstance(nxt, ds_schedule.BackwardPass) \
        and cmd.kwargs.get("phase") != nxt.kwargs.get("phase")


def overlap_pairs(engine) -> None:
    """Turn a built ``DualPipeVEngine`` into :class:`OverlappedDualPipeVEngine` (its active phase kept per
    thread from here on). The process groups and MoE blocks are prepared by
    :func:`mtds.pipe.dualpipev_overlap.install_cross_chunk_overlap`, which calls this last."""
    if not isinstance(engine, DualPipeVEngine):
        raise TypeError(f"the cross-chunk overlap runs on DeepSpeed's DualPipeVEngine, not {type(engine).__name__}")
    state = _ThreadState()
    state.phase = engine.__dict__.pop("_active_phase", None)
    engine._mtds_thread_state = state
    engine.__class__ = OverlappedDualPipeVEngine
