"""``ScheduledPipelineEngine``: DeepSpeed's ``PipelineEngine`` running mtds's own pipeline schedules.

DeepSpeed's engine runs only its plain 1F1B instruction stream. This subclass replaces ``train_batch``
and ``eval_batch`` by a walk over the per-rank compute order of ``mtds.pipe.schedules`` (interleaved 1F1B
over the chunks of a :class:`~mtds.deepspeed_compat.chunked_module.ChunkedPipelineModule`, or ZB-H1), with the p2p of
``mtds.pipe.p2p`` (sends never block, receives block only when needed). Everything else stays
DeepSpeed's: forward through ``DeepSpeedEngine.forward`` (its backward hooks: loss scaling, accumulation
scaling on the loss stage, ZeRO-1 bookkeeping), the loss stage's backward through
``DeepSpeedEngine.backward``, and at the end of the step -- one flush -- its tied-gradient all-reduce,
gradient reduction (ZeRO-1 / BF16 optimizer / data parallel), clipping and optimizer step.

"Stage" in DeepSpeed's sense (``is_first_stage``/``is_last_stage``, gradient-accumulation scaling) is
the *virtual* stage of the chunk being run: rank p−1 runs the loss only in its last chunk.

Only public methods of ``PipelineEngine`` are overridden (``DEEPSPEED_OVERRIDES``); every use of its
private state goes through ``mtds.deepspeed_compat.pipeline``.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from deepspeed.runtime.pipe.engine import PipelineEngine

from mtds.deepspeed_compat import pipeline as ds
from .p2p import StageP2P
from ..tp.weight_grad_store import WeightGradStore
from .select import check_weight_pass_support
from .schedules import Action, check_microbatches, has_weight_pass, schedule_actions


class ScheduledPipelineEngine(PipelineEngine):
    """Built like DeepSpeed builds a ``PipelineEngine`` (see :func:`build_scheduled_engine`), plus:
    ``schedule`` (a name in ``mtds.pipe.schedules.SCHEDULES``), ``groups`` (mtds ``ParallelGroups``),
    ``boundary_shape`` (activation shape between stages for one micro-batch)."""

    DEEPSPEED_OVERRIDES = ("train_batch", "eval_batch", "is_first_stage", "is_last_stage")

    def __init__(self, *args, schedule: str, groups, boundary_shape, **kwargs):
        self._active_chunk = None   # None: DeepSpeed's own (rank) sense of first/last stage, used in __init__
        super().__init__(*args, **kwargs)
        self.schedule = schedule
        self.groups = groups
        self.chunks = getattr(self.module, "num_chunks", 1)
        check_microbatches(schedule, self.num_stages, self.chunks, self.micro_batches)
        # One flush per step; the engine scatters/gathers itself (DeepSpeed's PartitionedTensor path is
        # tied to its own buffers), so its flags only tell us whether to.
        scatter = ds.take_over_scatter_gather(self)
        grad_group = None
        for ranks in groups.layout.pp_groups():   # collective: every rank creates every group
            group = dist.new_group(ranks)
            if groups.rank in ranks:
                grad_group = group
        self.grad_group = grad_group
        dtype = torch.bfloat16 if self.bfloat16_enabled() else torch.half if self.fp16_enabled() else torch.float32
        self.p2p = StageP2P(self.grid, act_group=groups.pp_group, grad_group=grad_group, shape=boundary_shape,
                            dtype=dtype, device=self.device, tp_group=groups.tp_group, tp_size=groups.layout.tp,
                            scatter_gather=scatter)
        self.timeline = None       # a mtds.pipe.timeline.TimelineRecorder, when the user asked for one
        self.weight_grads = None   # ZB-H1: the TP linears' deferred weight gradients, run by W actions
        if has_weight_pass(schedule):
            check_weight_pass_support(bf16_immediate=ds.bf16_immediate_grad_update(self),
                                      overlap_comm=self.zero_optimization() and self.zero_overlap_comm())
            self.weight_grads = WeightGradStore()
            for module in self.module.modules():
                if hasattr(module, "weight_grad_store"):
                    module.weight_grad_store = self.weight_grads

    # -- DeepSpeed's notion of the stage, per chunk ------------------------------------------------------
    def _virtual_stage(self, chunk: int) -> int:
        return chunk * self.num_stages + self.stage_id

    def is_first_stage(self):
        if self._active_chunk is None:
            return super().is_first_stage()
        return self._virtual_stage(self._active_chunk) == 0

    def is_last_stage(self):
        if self._active_chunk is None:
            return super().is_last_stage()
        return self._virtual_stage(self._active_chunk) == self.num_stages * self.chunks - 1

    @contextlib.contextmanager
    def _chunk(self, chunk: int):
        self._active_chunk = chunk
        if self.chunks > 1:
            self.module.activate_chunk(chunk)
        try:
            yield
        finally:
            self._active_chunk = None

    def _span(self, kind: str, chunk=None, micro=None):
        if self.timeline is None:
            return contextlib.nullcontext()
        return self.timeline.record(kind, chunk=chunk, micro=micro)

    def _neighbour(self, chunk: int, step: int) -> int:
        """Pipeline rank of the virtual stage ``step`` (±1) away from ``chunk`` on this rank."""
        return (self.stage_id + step) % self.num_stages

    # -- one step ----------------------------------------------------------------------------------------
    def train_batch(self, data_iter=None):
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch() needs gradients enabled; use eval_batch()")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self.module.train()
        ds.begin_batch(self, training=True)
        self._run(schedule_actions(self.schedule, self.num_stages, self.chunks, self.micro_batches, self.stage_id))
        with self._span("reduce"):
            ds.reduce_gradients(self)
        with self._span("step"):
            ds.optimizer_step(self)
        with torch.no_grad():
            self.agg_train_loss = ds.aggregate_loss(self)
        return self.agg_train_loss

    @torch.no_grad()
    def eval_batch(self, data_iter, return_logits=False, compute_loss=True, reduce_output="avg", bcast_loss=True,
                   num_micro_batches=None):
        if return_logits or not compute_loss:
            raise NotImplementedError("mtds's pipeline schedules evaluate the loss only")
        micro_batches = self.micro_batches if num_micro_batches is None else num_micro_batches
        self.module.eval()
        train_iterator = self.data_iterator
        self.set_dataiterator(data_iter)
        ds.begin_batch(self, training=False)
        try:
            self._run(self._forward_order(micro_batches))
        finally:
            self.set_dataiterator(train_iterator)
            self.module.train()
        return ds.eval_output(self, reduce=reduce_output, micro_batches=micro_batches, broadcast=bcast_loss)

    def _forward_order(self, micro_batches: int) -> list[Action]:
        """Forward-only order: the training schedule's forwards (the same (chunk, micro) sequence on every
        rank, so blocking receives are always answered), or chunk by chunk per micro-batch where the
        schedule cannot take this micro-batch count."""
        try:
            actions = schedule_actions(self.schedule, self.num_stages, self.chunks, micro_batches, self.stage_id)
        except ValueError:
            return [Action("F", c, i) for i in range(micro_batches) for c in range(self.chunks)]
        return [a for a in actions if a.kind == "F"]

    def _run(self, actions) -> None:
        self._inputs, self._outputs, self._losses, self._labels = {}, {}, {}, {}
        for action in actions:
            handler = {"F": self._forward_step, "B": self._backward_step, "W": self._weight_step}[action.kind]
            handler(action.chunk, action.micro)
        with self._span("send"):
            self.p2p.wait_sends()
        if self.weight_grads is not None and self.weight_grads.pending():
            # DeepSpeed's gradient reduction follows: every weight gradient must be in param.grad by then.
            raise RuntimeError(f"{self.weight_grads.pending()} deferred weight gradients left after the schedule")

    # -- the three compute instructions ------------------------------------------------------------------
    def _forward_step(self, chunk: int, micro: int) -> None:
        with self._chunk(chunk):
            first, last = self.is_first_stage(), self.is_last_stage()
            if first:
                batch = ds.next_batch(self)
                inputs = batch[0].to(self.device)
            else:
                with self._span("recv", chunk, micro):
                    inputs = self.p2p.recv_forward(self._neighbour(chunk, -1))
                if not torch.is_grad_enabled():
                    inputs = inputs.detach()
            if last:
                self._labels[micro] = ds.next_batch(self)[1].to(self.device)
            with self._span("F", chunk, micro):
                outputs = ds.forward(self, inputs)
                if last:
                    loss = self.module.loss_fn(outputs, self._labels.pop(micro))
                    ds.record_loss(self, loss)
            if torch.is_grad_enabled() and not first:
                self._inputs[chunk, micro] = inputs      # its .grad is what backward sends upstream
            if last:
                if torch.is_grad_enabled():
                    self._losses[micro] = loss
                return
            with self._span("send", chunk, micro):
                self.p2p.send_forward(outputs, self._neighbour(chunk, +1))
            if torch.is_grad_enabled():
                self._outputs[chunk, micro] = outputs

    def _backward_step(self, chunk: int, micro: int) -> None:
        if self.weight_grads is not None:
            self.weight_grads.key = (chunk, micro)
        try:
            self._input_backward(chunk, micro)
        finally:
            if self.weight_grads is not None:
                self.weight_grads.key = None

    def _input_backward(self, chunk: int, micro: int) -> None:
        with self._chunk(chunk):
            first = self.is_first_stage()
            if self.is_last_stage():
                with self._span("B", chunk, micro):
                    ds.loss_backward(self, self._losses.pop(micro))
            else:
                with self._span("recv", chunk, micro):
                    grad = self.p2p.recv_backward(self._neighbour(chunk, +1))
                with self._span("B", chunk, micro):
                    ds.stage_backward(self, self._outputs.pop((chunk, micro)), grad)
            inputs = self._inputs.pop((chunk, micro), None)
            if not first:
                with self._span("send", chunk, micro):
                    self.p2p.send_backward(inputs.grad, self._neighbour(chunk, -1))

    def _weight_step(self, chunk: int, micro: int) -> None:
        """ZB-H1's W: the weight/bias GEMMs the TP linears queued during this micro-batch's B, in order,
        accumulated into ``param.grad``, then handed to the optimizer's gradient accumulation as a
        backward's would be (the loss scale, fp16, is already in the queued output gradients)."""
        with self._span("W", chunk, micro):
            ds.fold_weight_gradients(self, lambda: self.weight_grads.run((chunk, micro)))


def build_scheduled_engine(model, *, config: dict, model_parameters, lr_scheduler, schedule: str, groups,
                           boundary_shape):
    """A :class:`ScheduledPipelineEngine`, built as ``deepspeed.initialize`` builds a ``PipelineEngine``."""
    return ds.build_pipeline_engine(ScheduledPipelineEngine, model, config=config, model_parameters=model_parameters,
                                    lr_scheduler=lr_scheduler, schedule=schedule, groups=groups,
                                    boundary_shape=boundary_shape)
