"""The stacked expert tensors of a checkpoint saved at --expert-model-parallel-size E > 1 (docs/moe.md,
"Checkpoints at E > 1"), read back from DeepSpeed's per-expert files as TP pieces for reader.py.

There the model file holds every weight but mtds's stacked experts; global expert G's slices of every MoE block
sit in ``layer_0_expert_G_mp_rank_TT_model_states.pt`` (TP rank TT's part). One block's [E_total, ...] piece of a
TP rank is filled expert by expert, one memory-mapped file open at a time, touching only that block's slices: the
peak stays the reader's (one layer's pieces from every TP rank plus its merged copy).
"""
from __future__ import annotations

from typing import Iterable

import torch

from mtds.checkpoint.dsformat import expert_file, load_file
from mtds.checkpoint.errors import CheckpointFormatError
from mtds.checkpoint.names import sequential_name
from mtds.deepspeed_compat.expert_checkpoint import EXPERT_GROUPS, expert_key
from mtds.model.config import ModelConfig

STACKED = ("mlp.experts.gate_up", "mlp.experts.down")     # mtds.model.experts: [E, ...] per MoE block


def expert_files(tag_dir: str, cfg: ModelConfig, tp: int) -> list[str]:
    return [expert_file(tag_dir, g, r) for g in range(cfg.num_experts) for r in range(tp)]


def file_key(cfg: ModelConfig, layer: int, name: str, expert: int) -> str:
    """The key of ``expert``'s slice of ``name`` in its file: DeepSpeed renumbers the local expert to the global
    one on save; the rest is the stacked tensor's name in the (p = 1) model."""
    return f"{EXPERT_GROUPS}.{expert_key(expert, sequential_name(cfg, layer, name))}"


class ExpertFileReader:
    """TP pieces of one layer's parameters: the stacked experts from the per-expert files, the rest from
    ``dense`` (the model files' reader)."""

    def __init__(self, dense, tag_dir: str, cfg: ModelConfig, tp: int):
        self.dense, self.tag_dir, self.cfg, self.tp = dense, tag_dir, cfg, tp

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
        stacked: dict[str, torch.Tensor] = {}
        for g in range(self.cfg.num_experts):
            path = expert_file(self.tag_dir, g, tp_rank)
            state = load_file(path)          # mmapped: only this block's slices are read
            for name in names:
                key = file_key(self.cfg, layer, name, g)
                if key not in state:
                    raise CheckpointFormatError(f"{path} lacks {key!r}: the checkpoint is of a different model or "
                                                f"partial")
                if name not in stacked:
                    stacked[name] = state[key].new_empty((self.cfg.num_experts, *state[key].shape))
                stacked[name][g].copy_(state[key])
            del state                        # one expert file open at a time
        return stacked
