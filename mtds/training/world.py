"""Phase 1 of a run, "set up the world": the processes, their layout and groups, before any run-specific work.

Order matters: the collective tracer wraps ``torch.distributed`` before DeepSpeed caches the collectives
it uses; the job is judged by the rulebook (mtds.training.admit) once the world size and the model are known,
before the heartbeat and any group; the dropout streams need the groups.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mtds.observe.comm_trace import CommTracer
from mtds.checkpoint.complete import LoadPlan, plan_load
from mtds.model.config import ModelConfig, differing_weight_fields
from mtds.hf.resolve import resolve_model_config
from mtds.training.cpu_allocator import tune_cpu_allocator
from mtds.parallel.layout import ParallelGroups, ParallelLayout
from mtds.training.admit import Admitted, admit
from mtds.safety.heartbeat import Heartbeat
from mtds.safety.startup import rendezvous_error
from mtds.tp import RNGTracker, seed_parallel_streams

from mtds.training.config import TrainConfig
from mtds.training.distributed import init_distributed

DEFAULT_MODEL = "gpt2-tiny"     # no --model, no --load checkpoint, no --init-from-hf


@dataclass
class World:
    """Who this rank is, whom it talks to, and the job it was admitted to run."""

    device: torch.device
    backend: str
    size: int                      # number of ranks
    layout: ParallelLayout         # t x c x p x d, checked against the model
    model_cfg: ModelConfig
    groups: ParallelGroups
    rng: RNGTracker                # dropout streams, masks keyed by (step, micro-batch, layer)
    tracer: CommTracer | None      # bytes per collective (None: --trace-comm off)
    admitted: Admitted             # the job the rulebook admitted: DeepSpeed dict, batch, stage partition
    allocator: str | None = None   # what mtds.training.cpu_allocator set (CPU runs), for the start-up log
    load: LoadPlan | None = None   # what --load means (None without it): read once, by rank 0


def setup_world(cfg: TrainConfig, heartbeat: Heartbeat) -> World:
    """Distributed init (with the tracer first), the job admitted by the rulebook, heartbeat, process groups, RNG
    streams."""
    # The tracer wraps torch.distributed before DeepSpeed starts and caches the collectives it uses.
    tracer = CommTracer().install() if cfg.trace_comm or cfg.log_straggler else None   # the straggler report reads its clock
    try:
        device, backend = init_distributed(cfg.dist_timeout_s)
    except RuntimeError as err:     # torch's DistStoreError and timeouts while the ranks gather
        raise rendezvous_error(err, cfg.dist_timeout_s) from None
    size = dist.get_world_size()
    load = _plan_load(cfg.load) if cfg.load else None
    model_cfg = run_model_config(cfg, load)
    # The rulebook, before the heartbeat and the groups: a refused job is one line from the first rank while
    # the others wait for its word (mtds.training.distributed.report_error), with no watchdog to take rank 0's
    # exit for a fault.
    admitted = admit(cfg, size, model_cfg, device)
    heartbeat.start()
    # Before the model and the first step allocate: large temporaries then come back from the heap.
    allocator = tune_cpu_allocator() if device.type == "cpu" else None

    layout = admitted.layout
    groups = layout.build_groups(timeout_s=cfg.dist_timeout_s)
    if tracer is not None:
        for name in ("tp", "dp", "pp", "mp") + (("cp", "dp_cp") if layout.cp > 1 else ()) + \
                (("ep", "expert_dp") if layout.ep > 1 else ()):
            tracer.name_group(getattr(groups, f"{name}_group"), name)
    rng = seed_parallel_streams(cfg.seed, groups, device)   # dropout streams, keyed per layer forward
    return World(device=device, backend=backend, size=size, layout=layout, model_cfg=model_cfg, groups=groups,
                 rng=rng, tracer=tracer, admitted=admitted, allocator=allocator, load=load)


def run_model_config(cfg: TrainConfig, load: LoadPlan | None = None) -> ModelConfig:
    """The model this run builds: ``--model``; without it the model the ``--load`` checkpoint records (one line
    says so), else ``--init-from-hf``'s config, else gpt2-tiny; then ``model_overrides``. A ``--model`` that is
    not the checkpoint's model ends the run here, in one line naming both."""
    recorded = load is not None and load.model is not None
    if cfg.model is None and recorded:
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"model: the one {load.tag_dir} records (mtds_meta.json), as no --model was given", flush=True)
        recorded_cfg = ModelConfig(**{k: v for k, v in load.model.items() if k not in ROUTER_OPTIONS})
        return _router_options(cfg, resolve_model_config(recorded_cfg, **cfg.model_overrides))
    model_cfg = resolve_model_config(cfg.model or cfg.init_from_hf or DEFAULT_MODEL, **cfg.model_overrides)
    if recorded:
        _check_recorded(cfg.model, model_cfg, load.tag_dir, ModelConfig(**load.model))
    return _router_options(cfg, model_cfg)


# Megatron-core's router options: training choices of this run, not of the weights (a checkpoint's record of
# them is not carried into a resumed run; its flags say them again)
ROUTER_OPTIONS = ("moe_z_loss_coeff", "moe_expert_capacity_factor", "moe_token_drop_policy",
                  "moe_router_bias_update_rate", "moe_router_load_balancing_type", "moe_aux_loss_coeff")


def _router_options(cfg: TrainConfig, model_cfg: ModelConfig) -> ModelConfig:
    """This run's router flags (z-loss, capacity) into the model where given; a dense model takes none. A
    ModelConfig passed from Python keeps its own values where the flags are left at their defaults."""
    given = {}
    if cfg.moe_z_loss_coeff:
        given["moe_z_loss_coeff"] = cfg.moe_z_loss_coeff
    if cfg.moe_expert_capacity_factor is not None:
        given.update(moe_expert_capacity_factor=cfg.moe_expert_capacity_factor,
                     moe_token_drop_policy=cfg.moe_token_drop_policy)
    if cfg.moe_router_load_balancing_type == "seq_aux_loss":
        given.update(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=cfg.moe_aux_loss_coeff)
    if cfg.moe_router_enable_expert_bias and model_cfg.moe_router_enable_expert_bias:   # else refused (rulebook)
        given["moe_router_bias_update_rate"] = cfg.moe_router_bias_update_rate
    if not given or not model_cfg.num_experts:     # a dense model: the rulebook's router-flags rule refuses
        return model_cfg
    return dataclasses.replace(model_cfg, **given)


def _plan_load(path: str) -> LoadPlan:
    """What --load means (:func:`mtds.checkpoint.complete.plan_load`): rank 0 reads, every rank gets it."""
    if not dist.is_initialized():
        return plan_load(path)
    answer = [plan_load(path) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(answer, src=0)
    return answer[0]


def _check_recorded(given, model_cfg: ModelConfig, tag_dir: str, recorded: ModelConfig) -> None:
    from mtds.checkpoint.lifecycle import CheckpointError
    mine, theirs = model_cfg.to_dict(), recorded.to_dict()
    diff = [f"{k} {mine[k]!r} vs {theirs[k]!r}" for k in differing_weight_fields(model_cfg, recorded)]
    if diff:
        who = f"--model {os.fspath(given)}" if isinstance(given, (str, os.PathLike)) else "the ModelConfig given"
        more = f" (and {len(diff) - 3} more)" if len(diff) > 3 else ""
        raise CheckpointError(f"{who} is a different model from the one checkpoint {tag_dir} records: "
                              f"{', '.join(diff[:3])}{more}: leave out --model to train the checkpoint's model")
