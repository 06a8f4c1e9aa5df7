"""The stacked expert tensors of a checkpoint saved at --expert-model-parallel-size E > 1 (docs/moe.md,
"Checkpoints at E > 1"), read back from DeepSpeed's per-expert files as TP pieces for reader.py.

There the model file holds every weight but mtds's stacked experts; global expert G's slices of every MoE block
sit in ``layer_0_expert_G_mp_rank_MM_model_states.pt`` (model-parallel rank MM's part: the TP rank at p = 1,
stage·t + TP rank on a pipeline). One block's [E_total, ...] piece of a TP rank is filled expert by expert, one
memory-mapped file open at a time, touching only that block's slices: the peak stays the reader's (one layer's
pieces from every TP rank plus its merged copy).

On a pipeline (p > 1) DeepSpeed's MoE save runs on each stage holding MoE blocks (an ``ExpertGroups`` module):
that stage's ``mp_rank_MM`` file holds its whole module without the experts under the PipelineModule's names
("<layer>.<name>"), its experts go to its own expert files; a stage without MoE blocks saves the pipeline's
per-layer files as for dense models (:class:`PipelineStageReader`).
"""
from __future__ import annotations

from typing import Iterable

import torch

from mtds.checkpoint.dsformat import expert_file, layer_file, load_file, mp_rank_file
from mtds.checkpoint.errors import CheckpointFormatError
from mtds.checkpoint.names import pipeline_name, sequential_name, TIED_PREFIX
from mtds.deepspeed_compat.expert_checkpoint import EXPERT_GROUPS, expert_key
from mtds.model.config import ModelConfig

# mtds.model.experts: [E, ...] per MoE block (the biases: GPT-OSS's)
STACKED = ("mlp.experts.gate_up", "mlp.experts.down", "mlp.experts.gate_up_bias", "mlp.experts.down_bias")


def expert_files(tag_dir: str, cfg: ModelConfig, mp_ranks: Iterable[int]) -> list[str]:
    return [expert_file(tag_dir, g, r) for g in range(cfg.num_experts) for r in mp_ranks]


def file_key(cfg: ModelConfig, layer: int, name: str, expert: int, pipeline: bool = False) -> str:
    """The key of ``expert``'s slice of ``name`` in its file: DeepSpeed renumbers the local expert to the global
    one on save; the rest is the stacked tensor's name in the saving stage's module."""
    inner = pipeline_name(cfg, layer, name) if pipeline else sequential_name(cfg, layer, name)
    return f"{EXPERT_GROUPS}.{expert_key(expert, inner)}"


class PipelineStageReader:
    """The dense TP pieces of an E > 1 pipeline checkpoint: a layer of a stage with MoE blocks from that stage's
    ``mp_rank`` module, any other from its per-layer file."""

    def __init__(self, tag_dir: str, cfg: ModelConfig, tp: int, pp: int):
        self.tag_dir, self.cfg, self.tp = tag_dir, cfg, tp
        self.stage_of: dict[int, int] = {}      # global layer -> the MoE stage whose module file holds it
        self.moe_stages: list[int] = []
        for stage in range(pp):
            module = load_file(mp_rank_file(tag_dir, stage * tp)).get("module")    # mmapped: the key index only
            if isinstance(module, dict):
                self.moe_stages.append(stage)
                for key in module:
                    layer = 0 if key.startswith(TIED_PREFIX) else int(key.split(".", 1)[0])
                    self.stage_of.setdefault(layer, stage)

    def mp_rank(self, layer: int, tp_rank: int) -> int:
        return self.stage_of[layer] * self.tp + tp_rank

    def pieces(self, layer: int, names: Iterable[str]) -> dict[str, list[torch.Tensor]]:
        names = list(names)
        out: dict[str, list[torch.Tensor]] = {n: [] for n in names}
        for tp_rank in range(self.tp):
            if layer in self.stage_of:
                where = mp_rank_file(self.tag_dir, self.mp_rank(layer, tp_rank))
                state = load_file(where)["module"]
                keys = {n: pipeline_name(self.cfg, layer, n) for n in names}
            else:
                where = layer_file(self.tag_dir, layer, tp_rank)
                state, keys = load_file(where), {n: n for n in names}
            for n in names:
                if keys[n] not in state:
                    raise CheckpointFormatError(f"{where} lacks parameter {keys[n]!r}: the checkpoint is of a "
                                                f"different model or partial")
                out[n].append(state[keys[n]])
        return out

    def expected_files(self, layers: Iterable[int]) -> list[str]:
        mp = [s * self.tp + r for s in self.moe_stages for r in range(self.tp)]
        return expert_files(self.tag_dir, self.cfg, mp) + \
            [layer_file(self.tag_dir, layer, r) for layer in layers if layer not in self.stage_of for r in range(self.tp)]


class ExpertFileReader:
    """TP pieces of one layer's parameters: the stacked experts from the per-expert files, the rest from
    ``dense`` (the model files' reader; a :class:`PipelineStageReader` on a pipeline)."""

    def __init__(self, dense, tag_dir: str, cfg: ModelConfig, tp: int):
        self.dense, self.tag_dir, self.cfg, self.tp = dense, tag_dir, cfg, tp
        self.pipeline = isinstance(dense, PipelineStageReader)

    def pieces(self, layer: int, names: Iterable[str]) -> dict[str, list[torch.Tensor]]:
        names = list(names)
        experts = [n for n in names if n in STACKED]
        out = self.dense.pieces(layer, [n for n in names if n not in experts])
        if experts:
            stacked = [self._stacked(layer, experts, r) for r in range(self.tp)]
            out.update({n: [s[n] for s in stacked] for n in experts})
        return {n: out[n] for n in names}

    def _stacked(self, layer: int, names: list[str], tp_rank: int) -> dict[str, torch.Tensor]:
        """TP rank ``tp_rank``'s [E_total, ...] piece of each of ``names`` in ``layer``, in global expert order."""
        if self.pipeline:
            if layer not in self.dense.stage_of:
                raise CheckpointFormatError(f"{self.tag_dir}: no stage's module file holds MoE layer {layer}: the "
                                            f"checkpoint is of a different model or partial")
            mp_rank = self.dense.mp_rank(layer, tp_rank)
        else:
            mp_rank = tp_rank
        stacked: dict[str, torch.Tensor] = {}
        for g in range(self.cfg.num_experts):
            path = expert_file(self.tag_dir, g, mp_rank)
            state = load_file(path)          # mmapped: only this block's slices are read
            for name in names:
                key = file_key(self.cfg, layer, name, g, self.pipeline)
                if key not in state:
                    raise CheckpointFormatError(f"{path} lacks {key!r}: the checkpoint is of a different model or "
                                                f"partial")
                if name not in stacked:
                    stacked[name] = state[key].new_empty((self.cfg.num_experts, *state[key].shape))
                stacked[name][g].copy_(state[key])
            del state                        # one expert file open at a time
        return stacked
