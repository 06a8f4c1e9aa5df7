"""``ScheduledPipelineEngine``: DeepSpeed's ``PipelineEngine`` running mtds's own pipeline schedules.

DeepSpeed's engine runs only its plain 1F1B instruction stream. This subclass replaces ``train_batch``
and ``eval_batch`` by a walk over the per-rank compute order of ``mtds.pipe.schedules`` (interleaved 1F1B
over the chunks of a :class:`~mtds.deepspeed_compat.chunked_module.ChunkedPipelineModule`, or ZB-H1), with the p2p of
``mtds.pipe.p2p`` posted in the order and on the process groups of ``mtds.pipe.exchange.engine_program``
(sends posted as soon as computed and waited for only at the end of the step, receives posted one compute
early and waited for only when needed; deadlock-free under NCCL's semantics, ``lab.pipe_sim.nccl_sim``).
Everything else stays DeepSpeed's: forward through ``DeepSpeedEngine.forward`` (its backward hooks: loss
scaling, accumulation scaling on the loss stage, ZeRO-1 bookkeeping), the loss stage's backward through
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
from mtds.deepspeed_compat.zero1_reduce import reduce_early
from mtds.deepspeed_compat.zero2_reduce import micro_batch_done
from mtds.deepspeed_compat.zero3_params import gathered_per_pass, parameters_received, wait_for_prefetch
from mtds.pipe.exchange import ACT, Compute, engine_program, group_names
from mtds.pipe.p2p import StageP2P
from mtds.tp.weight_grad_store import WeightGradStore
from mtds.pipe.select import check_weight_pass_support
from mtds.pipe.schedules import check_microbatches, has_weight_pass


class ScheduledPipelineEngine(PipelineEngine):
    """Built like DeepSpeed builds a ``PipelineEngine`` (see :func:`build_scheduled_engine`), plus:
    ``schedule`` (a name in ``mtds.pipe.schedules.SCHEDULES``), ``groups`` (mtds ``ParallelGroups``),
    ``boundary_shape`` (activation shape between stages for one micro-batch), ``beside`` (the tensors that
    travel with it: ``mtds.pipe.p2p.StageP2P``)."""

    DEEPSPEED_OVERRIDES = ("train_batch", "eval_batch", "is_first_stage", "is_last_stage")

    def __init__(self, *args, schedule: str, groups, boundary_shape, beside: tuple = (), **kwargs):
        self._active_chunk = None   # None: DeepSpeed's own (rank) sense of first/last stage, used in __init__
        super().__init__(*args, **kwargs)
        self.schedule = schedule
        self.groups = groups
        self.chunks = getattr(self.module, "num_chunks", 1)
        check_microbatches(schedule, self.num_stages, self.chunks, self.micro_batches)
        # One flush per step; the engine scatters/gathers itself (DeepSpeed's PartitionedTensor path is
        # tied to its own buffers), so its flags only tell us whether to.
        scatter = ds.take_over_scatter_gather(self)
        # One process group per name of the p2p program (activations and gradients, by the sender's
        # colour: mtds.pipe.exchange), each over this rank's pipeline. Collective: every rank creates
        # every pipeline's groups, in the same order.
        self.p2p_groups = {}
        for ranks in groups.layout.pp_groups():
            for name in group_names(self.num_stages, self.chunks):
                group = dist.new_group(ranks)
                if groups.rank in ranks:
                    self.p2p_groups[name] = group
        dtype = torch.bfloat16 if self.bfloat16_enabled() else torch.half if self.fp16_enabled() else torch.float32
        self.p2p = StageP2P(self.grid, groups=self.p2p_groups, shape=boundary_shape, dtype=dtype, device=self.device,
                            tp_group=groups.tp_group, tp_size=groups.layout.tp, scatter_gather=scatter,
                            beside=beside)
        self.timeline = None       # a mtds.observe.timeline.TimelineRecorder, when the user asked for one
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

    # -- one step ----------------------------------------------------------------------------------------
    def train_batch(self, data_iter=None):
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch() needs gradients enabled; use eval_batch()")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        self.module.train()
        ds.begin_batch(self, training=True)
        self._run(engine_program(self.schedule, self.num_stages, self.chunks, self.micro_batches, self.stage_id),
                  after_computes=self._reduce_early)
        with self._span("tied"):
            ds.reduce_tied_gradients(self)
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
            self._run(engine_program(self.schedule, self.num_stages, self.chunks, micro_batches, self.stage_id,
                                     forward_only=True))
        finally:
            self.set_dataiterator(train_iterator)
            self.module.train()
        return ds.eval_output(self, reduce=reduce_output, micro_batches=micro_batches, broadcast=bcast_loss)

    def _reduce_early(self) -> None:
        """The data-parallel reduction of what this stage's last backward (or W) made final, while its
        last sends are in flight and the other stages finish their cool-down (the tied weights wait for
        the tied all-reduce, which waits for the other end of the pipeline)."""
        with self._span("reduce"):
            reduce_early(self)

    def _run(self, program, after_computes=None) -> None:
        """Walk a p2p program (``mtds.pipe.exchange.engine_program``): its computes and posts, in order;
        then ``after_computes()``, then wait for the sends."""
        self._inputs, self._outputs, self._losses, self._labels = {}, {}, {}, {}
        self._outbox = {}          # Message -> tensor a compute produced, until its post sends it
        handlers = {"F": self._forward_step, "B": self._backward_step, "W": self._weight_step}
        for item in program:
            if isinstance(item, Compute):
                if item.action.kind == "W":
                    handlers["W"](item)
                else:
                    with gathered_per_pass(self):     # ZeRO-3 at p > 1, micro-batch mode (no-op otherwise)
                        handlers[item.action.kind](item)
                continue
            transfer = item.transfers[0]
            with self._span(transfer.op, self._local_chunk(transfer), transfer.message.micro):
                self.p2p.post(item, self._outbox)
        if self.weight_grads is not None and self.weight_grads.pending():
            # DeepSpeed's gradient reduction follows: every weight gradient must be in param.grad by then.
            raise RuntimeError(f"{self.weight_grads.pending()} deferred weight gradients left after the schedule")
        if after_computes is not None:
            after_computes()
        with self._span("send"):
            self.p2p.wait_sends()

    def _local_chunk(self, transfer) -> int:
        """This rank's chunk that sends (or receives) ``transfer``: for the timeline."""
        message = transfer.message
        stage = message.stage if transfer.op == "send" else message.stage + (1 if message.kind == ACT else -1)
        return stage // self.num_stages

    # -- the three compute instructions ------------------------------------------------------------------
    def _forward_step(self, item: Compute) -> None:
        chunk, micro = item.action.chunk, item.action.micro
        with self._chunk(chunk):
            first, last = self.is_first_stage(), self.is_last_stage()
            if first:
                batch = ds.next_batch(self)
                inputs = batch[0].to(self.device)
            else:
                with self._span("recv", chunk, micro):
                    inputs = self.p2p.take(item.needs)
                parameters_received(self)     # ZeRO-3 micro-batch: its gather was issued before this wait
                if not torch.is_grad_enabled():
                    inputs = tuple(t.detach() for t in inputs) if isinstance(inputs, tuple) else inputs.detach()
            if last:
                self._labels[micro] = ds.next_batch(self)[1].to(self.device)
            wait_for_prefetch(self)
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
            self._outbox[item.makes] = outputs
            if torch.is_grad_enabled():
                self._outputs[chunk, micro] = outputs

    def _backward_step(self, item: Compute) -> None:
        if self.weight_grads is not None:
            self.weight_grads.key = (item.action.chunk, item.action.micro)
        try:
            self._input_backward(item)
        finally:
            if self.weight_grads is not None:
                self.weight_grads.key = None
        if self.weight_grads is None and item.action.chunk == 0:
            micro_batch_done(self)      # chunk 0's backward: a micro-batch's last on this rank (ZB-H1: its W)

    def _input_backward(self, item: Compute) -> None:
        chunk, micro = item.action.chunk, item.action.micro
        with self._chunk(chunk):
            first = self.is_first_stage()
            if self.is_last_stage():
                wait_for_prefetch(self)
                with self._span("B", chunk, micro):
                    ds.loss_backward(self, self._losses.pop(micro))
            else:
                with self._span("recv", chunk, micro):
                    grad = self.p2p.take(item.needs)
                parameters_received(self)
                wait_for_prefetch(self)     # ZeRO-3 micro-batch: the gather issued before the receive
                with self._span("B", chunk, micro):
                    ds.stage_backward(self, self._outputs.pop((chunk, micro)), grad)
            inputs = self._inputs.pop((chunk, micro), None)
            if not first:
                self._outbox[item.makes] = _input_grad(inputs)

    def _weight_step(self, item: Compute) -> None:
        """ZB-H1's W: the weight/bias GEMMs the TP linears queued during this micro-batch's B, in order,
        accumulated into ``param.grad``, then handed to the optimizer's gradient accumulation as a
        backward's would be (the loss scale, fp16, is already in the queued output gradients)."""
        chunk, micro = item.action.chunk, item.action.micro
        with self._span("W", chunk, micro):
            ds.fold_weight_gradients(self, lambda: self.weight_grads.run((chunk, micro)))
        micro_batch_done(self)      # ZeRO-2 at p > 1, per micro-batch (no-op otherwise)


def _input_grad(inputs):
    """What backward sends upstream: the input's gradient, or for a tuple input (tensors beside the
    activation, :mod:`mtds.pipe.p2p`) the gradients of its floating-point tensors."""
    if isinstance(inputs, tuple):
        return tuple(t.grad for t in inputs if t.is_floating_point())
    return inputs.grad


def build_scheduled_engine(model, *, config: dict, model_parameters, lr_scheduler, schedule: str, groups,
                           boundary_shape, beside: tuple = ()):
    """A :class:`ScheduledPipelineEngine`, built as ``deepspeed.initialize`` builds a ``PipelineEngine``."""
    return ds.build_pipeline_engine(ScheduledPipelineEngine, model, config=config, model_parameters=model_parameters,
                                    lr_scheduler=lr_scheduler, schedule=schedule, groups=groups,
                                    boundary_shape=boundary_shape, beside=beside)
