"""What mtds needs from DeepSpeed beyond its documented API, and the check that the installed DeepSpeed
still has it.

Each :class:`Capability` names one thing mtds does with DeepSpeed's internals ("flush a pipeline step",
"replace fp32 clipping", ...) and the private or undocumented names it rests on, with the parameters mtds
passes. :func:`check_installed` runs at start-up, before any engine exists: every class-level name must
exist with those parameters. :func:`check_engine` runs on the built engine, before the first step:
attributes DeepSpeed creates in ``__init__`` (mtds reads or sets them; assigning a renamed one would
succeed silently). The patch ledger (``ledger.py``) then checks, after the first step, that every patch
mtds installed actually ran.

Checked against DeepSpeed 0.19.8 (the newest release on PyPI on 2026-11-24); ``TESTED`` is the range
CI runs, the same as ``pyproject.toml``'s (a test holds them equal).
"""
from __future__ import annotations

import functools
import importlib
import inspect
from dataclasses import dataclass

TESTED = ((0, 19, 8), (0, 20, 0))    # [low, high)
TESTED_SPEC = "deepspeed>=0.19.8,<0.20"


class DeepSpeedMismatch(ValueError):
    """The installed DeepSpeed lacks something mtds relies on (a user error: install the tested range)."""


@dataclass(frozen=True)
class Target:
    """``owner`` ("module.path:Class" or "module.path") and its ``attr`` (dotted for nested attributes).
    ``params``: a callable taking these parameter names (``self`` excluded); None: any attribute.
    ``instance``: created by ``__init__``, so checked on the built engine (or its optimizer)."""

    owner: str
    attr: str
    params: tuple[str, ...] | None = None
    instance: bool = False

    def label(self) -> str:
        return f"{self.owner.rpartition(':')[2] or self.owner}.{self.attr}"


@dataclass(frozen=True)
class Capability:
    name: str
    targets: tuple[Target, ...]


PIPE_ENGINE = "deepspeed.runtime.pipe.engine:PipelineEngine"
ENGINE = "deepspeed.runtime.engine:DeepSpeedEngine"
PIPE_MODULE = "deepspeed.runtime.pipe.module:PipelineModule"
BF16 = "deepspeed.runtime.bf16_optimizer:BF16_Optimizer"
ZERO12 = "deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer"
M, A = (), None   # a method without arguments; an attribute

CAPABILITIES = (
    Capability("build a pipeline engine as deepspeed.initialize does", (
        Target("deepspeed.runtime.zero.partition_parameters", "shutdown_init_context", M),
        Target("deepspeed.runtime.zero.partition_parameters", "restore_init_context", M),
        Target("deepspeed", "set_optimizer_flags", ("config_class", "model")),
        Target("deepspeed.runtime.config:DeepSpeedConfig", "__init__", ("config", "mpu")),
        Target(ENGINE, "__init__", ("args", "model", "optimizer", "model_parameters", "training_data",
                                    "lr_scheduler", "mpu", "dist_init_required", "collate_fn", "config",
                                    "config_class")),
        Target(ENGINE, "_configure_python_gc", M))),
    Capability("flush a pipeline step (tied grads, grad reduction, optimizer step)", (
        Target(PIPE_ENGINE, "_exec_reduce_tied_grads", M),
        Target(PIPE_ENGINE, "_exec_reduce_grads", M),
        Target(PIPE_ENGINE, "_exec_optimizer_step", ("lr_kwargs",)))),
    Capability("the step's loss, averaged and broadcast over the pipeline", (
        Target(PIPE_ENGINE, "_aggregate_total_loss", M),
        Target(PIPE_ENGINE, "_bcast_pipe_scalar", ("data",)),
        Target(PIPE_ENGINE, "_reduce_outputs", ("outputs", "reduce", "micro_batches")),
        Target(PIPE_ENGINE, "total_loss", A, instance=True))),
    Capability("the pipeline engine's next micro-batch", (Target(PIPE_ENGINE, "_next_batch", M),)),
    Capability("a non-loss stage's backward as the pipeline engine runs it", (
        Target(ENGINE, "_running_engine_backward", A, instance=True),
        Target(ENGINE, "_config.bfloat16_config.immediate_grad_update", A, instance=True),
        Target(BF16, "clear_lp_grads", M),
        Target(BF16, "update_hp_grads", ("clear_lp_grads",)))),
    Capability("release BF16_Optimizer's gradient buffers and bf16 weights (bf16 ZeRO-2/3 on a pipeline)", (
        Target(BF16, "clear_hp_grads", M),
        Target(BF16, "update_lp_params", M),
        Target(BF16, "fp32_groups_gradient_flat_partition", A, instance=True),
        Target(BF16, "fp32_groups_flat_partition", A, instance=True))),
    # zero3_params.py / pipeline.around_passes: the instruction classes are matched by name; renamed, the gather
    # would silently stop being prefetched (still gathered at the pass)
    Capability("prefetch ZeRO-3's per-pass parameter gather at the pipeline's receives (ZeRO-3 on a pipeline)", (
        *(Target("deepspeed.runtime.pipe.schedule", name, A) for name in (
            "RecvActivation", "RecvGrad", "ForwardPass", "BackwardPass")),
        Target(PIPE_ENGINE, "_INSTRUCTION_MAP", A))),
    Capability("fold deferred weight gradients into ZeRO's fp32 accumulation", (
        Target(ZERO12, "fill_grad_accum_attribute", M),
        Target(ZERO12, "use_grad_accum_attribute", A, instance=True))),
    Capability("stage outputs scatter/gather flags", (
        Target(PIPE_ENGINE, "is_pipe_partitioned", A, instance=True),
        Target(PIPE_ENGINE, "is_grad_partitioned", A, instance=True))),
    Capability("partition layers over virtual stages (chunked pipeline module)", (
        Target(PIPE_MODULE, "_partition_layers", ("method",)),
        Target(PIPE_MODULE, "_build", M),
        Target(PIPE_MODULE, "_set_bounds", ("start", "stop")),
        Target(PIPE_MODULE, "_precompute_checkpointable_values", M),
        Target(PIPE_MODULE, "stage_owner", ("layer_idx",)),
        Target(PIPE_MODULE, "save_state_dict", ("save_dir", "checkpoint_engine")),
        Target(PIPE_MODULE, "load_state_dir", ("load_dir", "checkpoint_engine")))),
    Capability("cut pipeline stages at explicit boundaries (--pipeline-layout, --pipeline-balance)", (
        Target(PIPE_MODULE, "_partition_layers", ("method",)),
        Target(PIPE_MODULE, "_set_bounds", ("start", "stop")),
        Target("deepspeed.runtime.pipe.dualpipev:DualPipeVModule", "_partition_layers", ("method",)))),
    Capability("wrap the pipeline engines' instruction handlers (--timeline)", (
        Target(PIPE_ENGINE, "_INSTRUCTION_MAP", A),
        Target(PIPE_ENGINE, "_exec_schedule", ("pipe_schedule",)))),
    Capability("replace fp32 clipping with the layout-correct norm", (
        Target(ENGINE, "clip_fp32_gradients", M),
        Target(ENGINE, "_take_model_step", ("lr_kwargs",)),
        Target(ENGINE, "_global_grad_norm", A, instance=True))),
    Capability("DeepSpeed's expert handling for mtds's MoE blocks (expert_groups.py)", (
        Target("deepspeed.moe.layer:MoE", "set_deepspeed_parallelism", ("use_data_before_expert_parallel_",)),
        Target("deepspeed.utils.groups", "_create_expert_data_and_model_parallel",
               ("expert_parallel_size_", "mpu", "use_data_before_expert_parallel_")),
        Target("deepspeed.utils.groups", "_get_expert_parallel_group_dict", M),
        Target("deepspeed.utils.groups", "mpu", A),
        Target("deepspeed.utils.groups", "_get_expert_parallel_group_ranks", ("group_name",)),
        Target("deepspeed.utils.groups", "_get_expert_data_parallel_group_ranks", ("group_name",)),
        *(Target("deepspeed.utils.groups", name, A) for name in (
            "_EXPERT_PARALLEL_GROUP", "_EXPERT_PARALLEL_GROUP_RANKS", "_EXPERT_DATA_PARALLEL_GROUP",
            "_EXPERT_DATA_PARALLEL_GROUP_RANKS")),
        Target("deepspeed.moe.utils", "split_params_into_different_moe_groups_for_optimizer",
               ("param_groups", "max_group_size")),
        Target(ENGINE, "has_moe_layers", A, instance=True))),
    Capability("checkpoint mtds's experts through DeepSpeed's MoE checkpoint path (expert_checkpoint.py)", (
        Target(ENGINE, "_save_moe_checkpoint", ("save_dir", "tag", "client_state", "exclude_frozen_parameters")),
        Target(ENGINE, "_get_non_moe_state_dict", ("full_state_dict",)),
        Target(ENGINE, "load_moe_state_dict", ("checkpoint_path", "tag", "state_dict", "old_moe_load", "model",
                                               "num_experts", "checkpoint_engine", "checkpoint_mp_rank")),
        Target(ENGINE, "_get_expert_ckpt_name", ("checkpoints_path", "layer_id", "expert_id", "tag",
                                                 "checkpoint_mp_rank")))),
    # on a pipeline the same path runs per stage: _save_moe_checkpoint takes the stage's whole module from
    # DeepSpeedEngine.module_state_dict (not the per-layer files), names every file by the grid's model-parallel
    # rank (stage * t + TP rank), and PipelineEngine.load_module_state_dict loads that dict when has_moe_layers
    Capability("checkpoint an expert-parallel pipeline stage through DeepSpeed's MoE path (expert_checkpoint.py)", (
        Target(PIPE_ENGINE, "load_module_state_dict", ("checkpoint", "strict")),
        Target("deepspeed.runtime.pipe.topology:PipelineParallelGrid", "get_model_parallel_rank", M),
        Target(ENGINE, "checkpoint_mp_rank", A, instance=True))),
    Capability("sum sequence-parallel gradients before the data-parallel reduction", (
        Target(ENGINE, "allreduce_gradients", M),
        Target(BF16, "__init__", A))),
    # (also read, not listed: the optimizer's ``dtype`` and ``reduce_scatter`` flags -- names too generic
    # for the boundary scan, which would then flag every ``tensor.dtype`` in mtds)
    Capability("reduce-scatter ZeRO-1's gradients into the partition its step reads", (
        Target(ZERO12, "reduce_gradients", ("pipeline_parallel",)),
        Target(ZERO12, "_build_compact_grad_partition_buffer", ("group_idx",)),
        # compact_partition.py builds this group itself from the layout of one DeepSpeed build
        Target("deepspeed.runtime.zero.stage_1_and_2:GradPartitionBufferGroup", "move_flat_partition",
               ("device", "non_blocking")),
        Target(ZERO12, "get_gradient_for_reduction", ("param",)),
        Target(ZERO12, "_clear_param_grad_only", M),
        Target(ZERO12, "_is_muon_group", ("tensor_list",)),
        Target(ZERO12, "is_gradient_accumulation_boundary", M),
        *(Target(ZERO12, name, A, instance=True) for name in (
            "bit16_groups", "bit16_groups_flat", "real_dp_process_group", "dp_process_group", "averaged_gradients",
            "all_grad_tensors", "reduce_bucket_size", "partition_gradients", "overlap_comm", "cpu_offload",
            "use_grad_accum_attribute", "has_moe_layers", "zenflow", "sequence_parallel_size",
            "communication_data_type", "gradient_accumulation_dtype", "gradient_average",
            "_grad_acc_hooks", "contiguous_gradients")),
        Target(PIPE_MODULE, "get_tied_weights_and_groups", M),
        Target(PIPE_ENGINE, "_INSTRUCTION_MAP", A))),
    Capability("reduce-scatter BF16_Optimizer's gradients into the partition its step reads", (
        Target(ENGINE, "buffered_allreduce_fallback", ("grads", "elements_per_buffer")),
        Target(ENGINE, "postscale_gradients", M),
        Target(ENGINE, "gradient_predivide_factor", M),
        Target(ENGINE, "communication_data_type", A),
        Target(ENGINE, "gradient_average", A, instance=True),
        Target(BF16, "get_grads_for_norm", ("for_clipping",)),
        *(Target(BF16, name, A, instance=True) for name in (
            "fp32_groups_gradients_flat", "fp32_groups_gradient_flat_partition", "fp32_groups_gradients",
            "bf16_groups", "real_dp_process_group", "dp_process_group",
            "grad_acc_dtype", "norm_type", "_uses_muon")),
        Target("deepspeed.moe.utils", "is_moe_param_group", ("param_group",)))),
    Capability("ZeRO-1/2's gradient norm in one foreach (zero_norm.py)", (
        Target(ZERO12, "get_grad_norm_direct", ("gradients", "params", "norm_type")),
        Target(ZERO12, "_model_parallel_all_reduce", ("tensor", "op")),
        Target("deepspeed.runtime.zero.utils", "get_norm_dtype", M),
        Target("deepspeed.runtime.utils", "mask_nan_or_inf_with_val_inplace", ("input", "device")),
        Target("deepspeed.runtime.utils", "is_model_parallel_parameter", ("p",)),
        Target("deepspeed.runtime.constants", "PIPE_REPLICATED", A),
        *(Target(ZERO12, name, A, instance=True) for name in ("model_parallel_rank", "cpu_offload")))),
    Capability("ZeRO-1/2's step re-points parameters only when they moved (zero_repoint.py)", (
        Target(ZERO12, "_update_model_bit16_weights", ("group_index",)),
        *(Target(ZERO12, name, A, instance=True) for name in (
            "round_robin_bit16_groups", "round_robin_bit16_meta", "round_robin_bit16_offsets", "bit16_groups_flat",
            "cpu_offload", "has_moe_layers")))),
    Capability("durable checkpoint writes and safe loads", (
        Target(ENGINE, "checkpoint_engine", A, instance=True),)),
    Capability("load a universal checkpoint", (
        Target(ENGINE, "_config.load_universal_checkpoint", A, instance=True),)),
    # expert_universal.py: mtds reads the ZeRO-1/2 partition files and writes the stacked experts marked so that
    # DeepSpeed's universal load slices each rank's own (a loader without the EP slicing would fail the numel check)
    Capability("load expert tensors of a universal checkpoint per EP rank (expert_universal.py)", (
        Target("deepspeed.checkpoint.universal_checkpoint", "load_hp_checkpoint_state",
               ("folder", "tp_rank", "tp_world_size", "ep_rank", "ep_size")),
        Target("deepspeed.runtime.base_optimizer", "_get_universal_checkpoint_ep_info", M),
        *(Target("deepspeed.checkpoint.constants", name, A) for name in (
            "EP_IS_EXPERT_PARAM", "EP_NUM_EXPERTS", "PARAM", "PARAM_GROUPS", "OPTIMIZER_STATE_DICT",
            "BASE_OPTIMIZER_STATE", "PARAM_SLICE_MAPPINGS", "SINGLE_PARTITION_OF_FP32_GROUPS")))),
    Capability("refresh ZeRO's fp32 master weights from the module", (
        Target(ZERO12, "refresh_fp32_params", M),
        Target(BF16, "_restore_from_bit16_weights", M))),
    Capability("consolidate ZeRO-3 partitions", (
        Target("deepspeed.utils.zero_to_fp32", "parse_model_states", ("files",)),
        Target("deepspeed.utils.zero_to_fp32", "parse_optim_states", ("files", "ds_checkpoint_dir")),
        Target("deepspeed.utils.zero_to_fp32", "_get_fp32_state_dict_from_zero3_checkpoint",
               ("world_size", "fp32_flat_groups", "zero_model_states", "exclude_frozen_parameters")))),
    # config_schema.py: DeepSpeedConfig parses a dict wrapped to record its lookups; the section models
    # (DeepSpeedConfigModel, extra="forbid") name themselves when they refuse a probe key.
    Capability("check a DeepSpeed JSON's keys against DeepSpeed's own config parser", (
        Target("deepspeed.runtime.config:DeepSpeedConfig", "__init__", ("config", "mpu")),
        Target("deepspeed.runtime.config_utils:DeepSpeedConfigModel", "__init__", A))),
    Capability("name the pipeline's p2p groups for the collective tracer", (
        Target("deepspeed.runtime.pipe.p2p", "_groups", A),)),
)


def version() -> str:
    import deepspeed
    return deepspeed.__version__


def _numbers(text: str) -> tuple[int, ...]:
    numbers = []
    for part in text.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        numbers.append(int(digits) if digits else 0)
    return tuple(numbers)


@functools.lru_cache(maxsize=16)      # the planner asks it of every candidate it weighs
def in_tested_range(text: str) -> bool:
    low, high = TESTED
    return low <= _numbers(text) < high


def _resolve(owner: str):
    module, _, cls = owner.partition(":")
    obj = importlib.import_module(module)
    return getattr(obj, cls) if cls else obj


def _problem(obj, target: Target) -> str | None:
    """Why ``obj`` does not provide ``target`` (None: it does)."""
    for part in target.attr.split("."):
        if part == "__init__" and not inspect.isclass(obj):
            return "is not a class"
        if not hasattr(obj, part):
            return "is missing"
        obj = getattr(obj, part)
    if target.params is None:
        return None
    if not callable(obj):
        return "is no longer callable"
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return None                                 # a builtin: nothing to compare
    params = signature.parameters
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params.values()):
        return None                                 # a decorated method: takes whatever is passed
    missing = [name for name in target.params if name not in params]
    if missing:
        return f"has no parameter {', '.join(missing)} (signature now {signature})"
    required = [n for n, p in params.items() if p.default is p.empty and n != "self"
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    extra = [n for n in required if n not in target.params]
    if extra:
        return f"now requires {', '.join(extra)} (signature now {signature})"
    return None


def mismatch_line(capability: str, target: Target, problem: str) -> str:
    return (f"DeepSpeed {version()}: {target.label()} {problem} -- mtds needs it to {capability}; "
            f"mtds is tested with {TESTED_SPEC}: pip install '{TESTED_SPEC}'")


def check_installed(capabilities=CAPABILITIES) -> None:
    """Raise :class:`DeepSpeedMismatch` (one line) for the first class- or module-level name that is
    missing or takes other parameters on the installed DeepSpeed."""
    for cap in capabilities:
        for target in cap.targets:
            if target.instance:
                continue
            try:
                owner = _resolve(target.owner)
            except (ImportError, AttributeError):
                raise DeepSpeedMismatch(mismatch_line(cap.name, target, f"cannot be imported ({target.owner})")) \
                    from None
            if problem := _problem(owner, target):
                raise DeepSpeedMismatch(mismatch_line(cap.name, target, problem))


def check_engine(engine, capabilities=CAPABILITIES) -> None:
    """The attributes DeepSpeed creates in ``__init__``, on the built engine and its optimizer (only
    those of the classes the run actually uses)."""
    for cap in capabilities:
        for target in cap.targets:
            if not target.instance:
                continue
            cls = _resolve(target.owner)
            obj = next((o for o in (engine, getattr(engine, "optimizer", None)) if isinstance(o, cls)), None)
            if obj is not None and (problem := _problem(obj, target)):
                raise DeepSpeedMismatch(mismatch_line(cap.name, target, problem))


def check_subclass(cls, base, overrides: tuple[str, ...]) -> None:
    """An mtds subclass of a DeepSpeed class overrides exactly ``overrides``: a name of its own that
    DeepSpeed has since added to ``base`` would replace DeepSpeed's method without anyone knowing."""
    for name in vars(cls):
        if name.startswith("__") or name in overrides:
            continue
        if any(name in vars(klass) for klass in base.__mro__):
            raise DeepSpeedMismatch(
                f"DeepSpeed {version()}: {base.__name__} now defines {name!r}, which mtds's {cls.__name__} also "
                f"defines; mtds is tested with {TESTED_SPEC}: pip install '{TESTED_SPEC}'")
