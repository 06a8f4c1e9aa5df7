"""Build the trainable GPT for a layout: a DeepSpeed ``PipelineModule`` when p > 1, otherwise a plain
``nn.Module`` from the *same* specs (so ZeRO-2/3, which DeepSpeed forbids with its pipeline engine,
work with tensor parallelism, and both paths hold identical layers and weights)."""
from __future__ import annotations

from functools import partial

import torch
from torch import nn

from mtds.cp.context import ContextParallel, context_of
from mtds.model.config import ModelConfig
from mtds.parallel.layout import ParallelGroups
from mtds.model import LMLoss, TransformerLayer
from mtds.model.aux_loss import collect_aux_loss
from mtds.model.documents import DocumentMasking
from mtds.model.gpt import moe_blocks
from mtds.parallel.pipeline_layout import StageLayout
from mtds.tp import RNGTracker, checkpoint

from mtds.pipe.specs import CHECKPOINTABLE_LAYERS, PARTITION_METHOD, gpt_layer_specs, tied_lm_logits


def _recompute(tracker: RNGTracker, function, *args):
    """PipelineModule's ``activation_checkpoint_func`` signature, replaying our TP RNG streams."""
    return checkpoint(function, tracker, *args)


def build_pipeline_module(cfg: ModelConfig, groups: ParallelGroups, *, seed: int, rng_tracker: RNGTracker,
                          recompute_interval: int = 0, recompute_attention: bool = False,
                          sequence_parallel: bool = False, virtual_stages: int | None = None,
                          dualpipev: bool = False, stage_layout: StageLayout | None = None,
                          documents: DocumentMasking | None = None, context: ContextParallel | None = None,
                          carry_router_stats: bool = False, cross_entropy_impl: str | None = None):
    """DeepSpeed's ``PipelineModule``; with ``virtual_stages`` set, mtds's ``ChunkedPipelineModule``
    (that many chunks per rank, for the schedules mtds's own engine runs); with ``dualpipev``,
    DeepSpeed's ``DualPipeVModule`` (two chunks per rank in a V; the tied embedding is one module on
    rank 0, which holds both ends). ``stage_layout``: the blocks of each virtual stage (p, p·v or 2p of
    them; mtds.parallel.pipeline_layout), else DeepSpeed splits the blocks evenly."""
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.dualpipev import DualPipeVModule

    from mtds.deepspeed_compat.chunked_module import ChunkedPipelineModule
    from mtds.deepspeed_compat.explicit_parts import ExplicitPartsDualPipeV, ExplicitPartsModule
    specs = gpt_layer_specs(cfg, tp_group=groups.tp_group, seed=seed, rng_tracker=rng_tracker,
                            sequence_parallel=sequence_parallel, recompute_attention=recompute_attention,
                            documents=documents, context=context, ep_group=groups.ep_group,
                            carry_router_stats=carry_router_stats)
    cls, extra = (PipelineModule, {}) if virtual_stages is None else \
        (ChunkedPipelineModule, {"virtual_stages": virtual_stages})
    if dualpipev:
        cls, extra = DualPipeVModule, {}
    if stage_layout is not None:
        stages = groups.layout.pp * (2 if dualpipev else virtual_stages or 1)
        if stage_layout.stages != stages or stage_layout.num_layers != cfg.num_layers:
            raise ValueError(f"pipeline layout {stage_layout} has {stage_layout.stages} stages and "
                             f"{stage_layout.num_layers} blocks; this model and schedule need {stages} and "
                             f"{cfg.num_layers}")
        if cls is PipelineModule:
            cls = ExplicitPartsModule
        elif cls is DualPipeVModule:
            cls = ExplicitPartsDualPipeV
        extra["parts"] = stage_layout.spec_parts()
    from mtds.observe.quiet import quiet_prints
    with quiet_prints():        # DeepSpeed's SEED_LAYERS=… and Using topology: … lines
        return cls(layers=specs, **extra, topology=groups.layout.topology(),
                   loss_fn=LMLoss(cfg, groups.tp_group, context, cross_entropy_impl),
                   partition_method=PARTITION_METHOD, activation_checkpoint_interval=recompute_interval,
                   activation_checkpoint_func=partial(_recompute, rng_tracker),
                   checkpointable_layers=CHECKPOINTABLE_LAYERS)


class SequentialGPT(nn.Module):
    """The single-stage model: the pipeline specs built in order, called like a pipeline would."""

    def __init__(self, cfg: ModelConfig, groups: ParallelGroups, *, seed: int, rng_tracker: RNGTracker,
                 recompute_interval: int = 0, recompute_attention: bool = False, sequence_parallel: bool = False,
                 documents: DocumentMasking | None = None, context: ContextParallel | None = None,
                 cross_entropy_impl: str | None = None):
        super().__init__()
        specs = gpt_layer_specs(cfg, tp_group=groups.tp_group, seed=seed, rng_tracker=rng_tracker,
                                sequence_parallel=sequence_parallel, recompute_attention=recompute_attention,
                                documents=documents, context=context, ep_group=groups.ep_group)
        self.embedding = specs[0].build()
        self.layers = nn.ModuleList(spec.build() for spec in specs[1:-2])
        self.final_norm = specs[-2].build()
        # Tied: one table serves input and output; untied: a separate vocab-parallel head.
        self.lm_head = None if cfg.tie_word_embeddings else specs[-1].build()
        self.loss_fn = LMLoss(cfg, groups.tp_group, context, cross_entropy_impl)
        self.rng_tracker = rng_tracker
        self.recompute_interval = recompute_interval
        self.aux_loss_coef, self.z_loss_coef = cfg.router_aux_loss_coef, cfg.moe_z_loss_coeff

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embedding(input_ids)    # (hidden, segment ids) with packed documents
        k = self.recompute_interval
        if k and self.training:
            for start in range(0, len(self.layers), k):
                args = hidden if isinstance(hidden, tuple) else (hidden,)
                hidden = checkpoint(self._run_blocks(start, start + k), self.rng_tracker, *args)
        else:
            for layer in self.layers:
                hidden = layer(hidden)
        hidden = self.final_norm(hidden)
        return tied_lm_logits(self.embedding, hidden) if self.lm_head is None else self.lm_head(hidden)

    def _run_blocks(self, start: int, stop: int):
        def run(*hidden):
            hidden = hidden if len(hidden) > 1 else hidden[0]
            for layer in self.layers[start:stop]:
                hidden = layer(hidden)
            return hidden
        return run

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.logits(input_ids)
        # an MoE model's load-balancing term, as transformers adds it (mtds.model.aux_loss)
        aux = collect_aux_loss(moe_blocks(self), self.aux_loss_coef, self.training, self.z_loss_coef)
        if labels is None:
            return logits
        loss = self.loss_fn(logits, labels)
        return loss if aux is None else loss + aux


def build_model(cfg: ModelConfig, groups: ParallelGroups, *, seed: int, rng_tracker: RNGTracker,
                recompute_interval: int = 0, recompute_attention: bool = False,
                sequence_parallel: bool = False, virtual_stages: int | None = None,
                dualpipev: bool = False, stage_layout: StageLayout | None = None,
                documents: DocumentMasking | None = None, cp_comm_type: str = "p2p",
                carry_router_stats: bool = False, cross_entropy_impl: str | None = None) -> nn.Module:
    """PipelineModule for p > 1, SequentialGPT for p = 1. ``sequence_parallel``: activations
    between layers are split along the sequence over the TP group (Korthikanti et al. 2022); the
    weights, and so checkpoints, are the same either way. Recomputation: ``recompute_interval`` k > 0
    recomputes every k whole blocks ("full"); ``recompute_attention`` only the attention core
    ("selective"); they are alternatives, not meant together. ``virtual_stages``: build a
    ``ChunkedPipelineModule`` with that many chunks per rank (mtds's own pipeline schedules).
    ``stage_layout``: how many blocks each virtual stage holds (p > 1 only; mtds.parallel.pipeline_layout).
    ``documents``: packed-document resets (:mod:`mtds.model.documents`). ``cp_comm_type``: how attention
    crosses the context-parallel ranks when ``groups.layout.cp`` > 1 (:mod:`mtds.cp`). ``carry_router_stats``
    (training an MoE model at p > 1): the router statistics travel with the activations to the loss, which
    adds the load-balancing term (:mod:`mtds.model.router_carry`); without it an MoE model builds at p = 1 only.
    ``cross_entropy_impl``: the loss's (:class:`mtds.model.head.LMLoss`): None, or "native" for the fused one.
    What the layout, the model and these options may combine is the rulebook's (mtds.rules), which train.py and
    mtds-eval ask before they build."""
    if recompute_interval and recompute_attention:
        raise ValueError("full recomputation (recompute_interval) and selective (recompute_attention) exclude "
                         "each other: choose one")
    carry = bool(cfg.num_experts) and carry_router_stats and groups.layout.pp > 1
    common = dict(seed=seed, rng_tracker=rng_tracker, recompute_interval=recompute_interval,
                  recompute_attention=recompute_attention, sequence_parallel=sequence_parallel,
                  documents=documents, context=context_of(groups, cp_comm_type),
                  cross_entropy_impl=cross_entropy_impl)
    if groups.layout.pp > 1:
        return build_pipeline_module(cfg, groups, virtual_stages=virtual_stages, dualpipev=dualpipev,
                                     stage_layout=stage_layout, carry_router_stats=carry, **common)
    return SequentialGPT(cfg, groups, **common)


__all__ = ["build_model", "build_pipeline_module", "SequentialGPT", "TransformerLayer"]
