"""The pipeline engine's internals that mtds's own schedules drive (``mtds.pipe.engine``), and the
instruction table ``--timeline`` wraps on DeepSpeed's engines.

mtds's ``ScheduledPipelineEngine`` subclasses DeepSpeed's ``PipelineEngine`` and overrides only public
methods (``train_batch``, ``eval_batch``, ``is_first_stage``, ``is_last_stage``); everything it needs
of the engine's private state goes through the functions here, one per operation.

Checked against DeepSpeed 0.19.8.
"""
from __future__ import annotations

from typing import Callable

import torch

from mtds.deepspeed_compat.capabilities import check_subclass
from mtds.deepspeed_compat.ledger import ledger


# -- building ------------------------------------------------------------------------------------------
def build_pipeline_engine(engine_cls, model, *, config: dict, model_parameters, lr_scheduler, **extra):
    """What ``deepspeed.initialize`` does for a ``PipelineModule`` (config class from the module's grid,
    optimizer flags, ZeRO-Init context shut around construction), constructing ``engine_cls`` (a
    ``PipelineEngine`` subclass taking ``extra`` keyword arguments)."""
    import deepspeed
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.pipe.engine import PipelineEngine
    from deepspeed.runtime.zero import partition_parameters

    check_subclass(engine_cls, PipelineEngine, overrides=engine_cls.DEEPSPEED_OVERRIDES)
    partition_parameters.shutdown_init_context()
    config_class = DeepSpeedConfig(config, model.mpu())
    deepspeed.set_optimizer_flags(config_class, model)
    engine = engine_cls(args=None, model=model, optimizer=None, model_parameters=model_parameters,
                        training_data=None, lr_scheduler=lr_scheduler, mpu=model.mpu(), dist_init_required=None,
                        collate_fn=None, config=config, config_class=config_class, **extra)
    partition_parameters.restore_init_context()
    engine._configure_python_gc()
    return engine


def take_over_scatter_gather(engine) -> bool:
    """Whether DeepSpeed would split stage outputs over the TP ranks (PTD-P §4.1); its own flags are
    switched off because mtds's p2p scatters and gathers itself."""
    scatter = engine.is_pipe_partitioned
    engine.is_pipe_partitioned = engine.is_grad_partitioned = False
    return scatter


def bf16_immediate_grad_update(engine) -> bool:
    return bool(engine.using_bf16_optimizer and engine._config.bfloat16_config.immediate_grad_update)


# -- one step ------------------------------------------------------------------------------------------
def begin_batch(engine, *, training: bool) -> None:
    """Clear the per-batch outputs (and, for training, the step's loss totals that
    :func:`aggregate_loss` reads)."""
    if training:
        engine.total_loss = None
        engine.total_additional_losses = None
    engine.fwd_outputs = []


def record_loss(engine, loss: torch.Tensor) -> None:
    """Add one micro-batch's loss (detached) to the step's totals, as DeepSpeed's forward pass does."""
    loss = loss.detach()
    engine.fwd_outputs.append(loss)
    engine.total_loss = loss.clone() if engine.total_loss is None else engine.total_loss + loss


def next_batch(engine):
    return engine._next_batch()


def forward(engine, inputs):
    """``DeepSpeedEngine.forward`` (its hooks: ZeRO bookkeeping, loss-scale and accumulation state),
    which ``PipelineEngine`` forbids outside its own schedule."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    return DeepSpeedEngine.forward(engine, inputs)


def loss_backward(engine, loss: torch.Tensor) -> None:
    """The loss stage's backward through ``DeepSpeedEngine.backward`` (loss scaling, accumulation
    scaling, ZeRO hooks)."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    DeepSpeedEngine.backward(engine, loss)


def stage_backward(engine, outputs, grad) -> None:
    """A non-loss stage's backward as DeepSpeed's ``PipelineEngine`` runs it: under the BF16 optimizer
    low-precision grads are cleared before and added to the fp32 ones after; the engine-backward flag
    tells DeepSpeed's hooks a backward is in flight. ``outputs`` a tuple: ``grad`` holds the gradients of
    its floating-point tensors, in order (as DeepSpeed's engine pairs them)."""
    if engine.using_bf16_optimizer:
        engine.optimizer.clear_lp_grads()
    engine._running_engine_backward = True
    try:
        if isinstance(outputs, tuple):
            torch.autograd.backward([t for t in outputs if t.is_floating_point()], grad_tensors=list(grad))
        else:
            outputs.backward(gradient=grad)
    finally:
        engine._running_engine_backward = False
    if engine.using_bf16_optimizer and not bf16_immediate_grad_update(engine):
        engine.optimizer.update_hp_grads(clear_lp_grads=False)


def fold_weight_gradients(engine, run: Callable[[], None]) -> None:
    """ZB-H1's W: ``run()`` accumulates deferred weight gradients into ``param.grad``; hand them to the
    optimizer's accumulation as a backward's epilogue would."""
    bf16 = engine.using_bf16_optimizer
    if bf16:
        # Every low-precision grad was folded into fp32 by the backward that produced it: zero them
        # so the fold below adds only this W's gradients (once).
        engine.optimizer.clear_lp_grads()
    run()
    if bf16:
        engine.optimizer.update_hp_grads(clear_lp_grads=False)
    elif getattr(engine.optimizer, "use_grad_accum_attribute", False):
        # ZeRO-1/2 accumulating 16-bit grads in fp32: moves param.grad into param.grad_accum.
        engine.optimizer.fill_grad_accum_attribute()


def reduce_tied_gradients(engine) -> None:
    """End of the step: the tied weights' gradients summed across the stages holding them."""
    engine._exec_reduce_tied_grads()


def reduce_gradients(engine) -> None:
    """End of the step, after :func:`reduce_tied_gradients`: the data-parallel reduction (ZeRO-1 / BF16
    optimizer / plain data parallel)."""
    engine._exec_reduce_grads()


def tied_parameters(module) -> list:
    """The pipeline module's tied weights on this stage (their gradients are summed across stages at the
    end of the step); none for a module without tied layers."""
    tied = getattr(module, "get_tied_weights_and_groups", None)
    return [weight for weight, _ in tied()] if tied is not None else []


def optimizer_step(engine) -> None:
    """Clipping, the optimizer step and the learning-rate schedule (DeepSpeed's OptimizerStep)."""
    engine._exec_optimizer_step()


def aggregate_loss(engine):
    """The step's mean loss, averaged over data parallelism and broadcast from the last stage."""
    return engine._aggregate_total_loss()


def eval_output(engine, *, reduce: str, micro_batches: int, broadcast: bool):
    output = None
    if engine.is_last_stage():
        output = engine._reduce_outputs(engine.fwd_outputs, reduce=reduce, micro_batches=micro_batches)
    if broadcast:
        output = engine._bcast_pipe_scalar(output)
    return output


# -- DeepSpeed's own engines ---------------------------------------------------------------------------
def wrap_instruction_handlers(engine, wrap: Callable) -> None:
    """DeepSpeed's pipeline engines (``PipelineEngine``, ``DualPipeVEngine``) look each instruction's
    handler up in the class's ``_INSTRUCTION_MAP``; an instance attribute of the same name shadows it for
    this engine only. ``wrap(instruction_class, handler)`` returns the replacement handler."""
    name = "PipelineEngine._INSTRUCTION_MAP"
    book = ledger(engine)
    book.expect(name)

    def marked(handler):
        def run(self, **kwargs):
            book.mark(name)
            return handler(self, **kwargs)
        return run

    current = engine.__dict__.get("_INSTRUCTION_MAP", type(engine)._INSTRUCTION_MAP)   # wraps compose
    engine._INSTRUCTION_MAP = {cls: marked(wrap(cls, fn)) for cls, fn in current.items()}


def before_tied_reduction(engine, hook: Callable[[], None]) -> None:
    """On DeepSpeed's pipeline engines: run ``hook`` when a stage reaches its ReduceTiedGrads instruction,
    the first one after its last backward of the step (1F1B: after the last backward's SendGrad;
    DualPipeV likewise), before the tied-weight all-reduce waits for the other end of the pipeline."""
    def wrap(instruction, handler):
        if instruction.__name__ != "ReduceTiedGrads":
            return handler

        def run(self, **kwargs):
            hook()
            return handler(self, **kwargs)
        return run

    wrap_instruction_handlers(engine, wrap)


def after_backward(engine, hook: Callable[[dict], None]) -> None:
    """On DeepSpeed's pipeline engines: run ``hook(kwargs)`` after each BackwardPass instruction (a
    micro-batch's backward on this stage; DualPipeV's kwargs name the ``phase``, the chunk)."""
    def wrap(instruction, handler):
        if instruction.__name__ != "BackwardPass":
            return handler

        def run(self, **kwargs):
            out = handler(self, **kwargs)
            hook(kwargs)
            return out
        return run

    wrap_instruction_handlers(engine, wrap)


def around_passes(engine, before: Callable[[], None], after: Callable[[], None],
                  before_receive: Callable[[], None] | None = None,
                  received: Callable[[], None] | None = None) -> None:
    """On DeepSpeed's pipeline engines: run ``before()`` and ``after()`` around each ForwardPass and
    BackwardPass instruction (ZeRO-3's per-micro-batch parameter gather and free), and ``before_receive()`` and
    ``received()`` around each RecvActivation and RecvGrad (the receive of the next pass's input: 1F1B and
    DualPipeV schedule it before that pass; ZeRO-3 issues the pass's gather there)."""
    def wrap(instruction, handler):
        name = instruction.__name__
        if name in ("RecvActivation", "RecvGrad") and before_receive is not None:
            def receive(self, **kwargs):
                before_receive()
                try:
                    return handler(self, **kwargs)
                finally:
                    if received is not None:
                        received()
            return receive
        if name not in ("ForwardPass", "BackwardPass"):
            return handler

        def run(self, **kwargs):
            before()
            try:
                return handler(self, **kwargs)
            finally:
                after()
        return run

    wrap_instruction_handlers(engine, wrap)


def engine_groups(engine) -> list[tuple[object, str]]:
    """(process group, axis) for the groups DeepSpeed made itself: a pipeline engine's grid (data, pipe,
    tensor-slice, model), the p2p groups (only when send/recv go by broadcast), the pipeline module's
    tied-weight groups."""
    found = []
    grid = getattr(engine, "grid", None)
    if grid is not None:
        for attr, axis in (("dp_proc_group", "dp"), ("pp_proc_group", "pp"), ("slice_proc_group", "tp"),
                           ("ds_model_proc_group", "mp")):
            found.append((getattr(grid, attr, None), axis))
        from deepspeed.runtime.pipe import p2p
        found += [(group, "pp") for group in getattr(p2p, "_groups", None) or ()]
    found += [(comm.get("group"), "tied") for comm in getattr(engine.module, "tied_comms", {}).values()]
    return found
