"""Phase 1 of a run, "set up the world": the processes, their layout and groups, before any run-specific work.

Order matters: the collective tracer wraps ``torch.distributed`` before DeepSpeed caches the collectives
it uses; the heartbeat starts once there is a process group to beat over; the layout is checked against
the world size and the model before any group exists; the dropout streams need the groups.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from mtds.observe.comm_trace import CommTracer
from mtds.model.config import ModelConfig
from mtds.hf.resolve import resolve_model_config
from mtds.training.cpu_allocator import tune_cpu_allocator
from mtds.parallel.layout import ParallelGroups, ParallelLayout
from mtds.parallel.pipeline_layout import parse_layout
from mtds.safety.heartbeat import Heartbeat
from mtds.safety.startup import rendezvous_error
from mtds.tp import RNGTracker, seed_parallel_streams

from mtds.training.config import TrainConfig
from mtds.training.distributed import init_distributed


@dataclass
class World:
    """Who this rank is and whom it talks to; the same for every run these processes could do."""

    device: torch.device
    backend: str
    size: int                      # number of ranks
    layout: ParallelLayout         # t x p x d, checked against the model
    model_cfg: ModelConfig
    groups: ParallelGroups
    rng: RNGTracker                # dropout streams, masks keyed by (step, micro-batch, layer)
    tracer: CommTracer | None      # bytes per collective (None: --trace-comm off)
    allocator: str | None = None   # what mtds.training.cpu_allocator set (CPU runs), for the start-up log


def setup_world(cfg: TrainConfig, heartbeat: Heartbeat) -> World:
    """Distributed init (with the tracer first), heartbeat, layout (validated), process groups, RNG streams."""
    # The tracer wraps torch.distributed before DeepSpeed starts and caches the collectives it uses.
    tracer = CommTracer().install() if cfg.trace_comm else None
    try:
        device, backend = init_distributed(cfg.dist_timeout_s)
    except RuntimeError as err:     # torch's DistStoreError and timeouts while the ranks gather
        raise rendezvous_error(err, cfg.dist_timeout_s) from None
    heartbeat.start()
    size = dist.get_world_size()
    # Before the model and the first step allocate: large temporaries then come back from the heap.
    allocator = tune_cpu_allocator() if device.type == "cpu" else None

    dualpipev = cfg.pipeline_schedule == "dualpipev"   # DeepSpeed's DualPipeVEngine: two chunks per rank
    layout = ParallelLayout.for_world(size, tp=cfg.tp, pp=cfg.pp, vp=2 if dualpipev else cfg.virtual_stages)
    model_cfg = resolve_model_config(cfg.model, **cfg.model_overrides)
    layout.check_model(num_heads=model_cfg.num_heads, num_kv_heads=model_cfg.kv_heads,
                       hidden_size=model_cfg.hidden_size, ffn_hidden_size=model_cfg.ffn_size,
                       num_layers=model_cfg.num_layers)
    if cfg.sequence_parallel:
        layout.check_sequence_parallel(cfg.seq_length)
    if cfg.pipeline_layout and layout.pp > 1:   # checked before any process group exists
        parse_layout(cfg.pipeline_layout, stages=layout.pp * layout.vp, num_layers=model_cfg.num_layers)

    groups = layout.build_groups(timeout_s=cfg.dist_timeout_s)
    if tracer is not None:
        for name in ("tp", "dp", "pp", "mp"):
            tracer.name_group(getattr(groups, f"{name}_group"), name)
    rng = seed_parallel_streams(cfg.seed, groups, device)   # dropout streams, keyed per layer forward
    return World(device=device, backend=backend, size=size, layout=layout, model_cfg=model_cfg, groups=groups,
                 rng=rng, tracer=tracer, allocator=allocator)
