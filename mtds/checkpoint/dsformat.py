"""DeepSpeed's model-state files, read and written without an engine.

PipelineModule (p > 1): ``layer_XX-model_YY-model_states.pt`` = state_dict of spec layer XX on TP rank
YY (the tied head has no file of its own: stage 0's embedding file holds the table), plus one
``mp_rank_ZZ_model_states.pt`` per (stage, TP rank), ZZ = stage * t + tp, holding engine state
(step, scheduler, client_state) with module=None.
SequentialGPT (p = 1): ``mp_rank_YY_model_states.pt`` per TP rank with the whole module under "module".
"""
from __future__ import annotations

import glob
import os
import re
from typing import Iterable

import torch

from mtds.model.config import ModelConfig
from mtds.checkpoint.safe_load import UnreadableFileError, safe_load

from mtds.checkpoint.errors import CheckpointFormatError
from mtds.checkpoint.names import ds_name

_LAYER_FILE = re.compile(r"layer_(\d+)-model_(\d+)-model_states\.pt$")


def layer_file(tag_dir: str, layer: int, tp_rank: int) -> str:
    return os.path.join(tag_dir, f"layer_{layer:02d}-model_{tp_rank:02d}-model_states.pt")


def mp_rank_file(tag_dir: str, mp_rank: int) -> str:
    return os.path.join(tag_dir, f"mp_rank_{mp_rank:02d}_model_states.pt")


def expert_file(tag_dir: str, expert: int, tp_rank: int) -> str:
    """DeepSpeed's file of global expert ``expert`` (TP rank's slices, every MoE block); "layer_0": its counter
    of MoE modules, and mtds has one (``ExpertGroups``) for all blocks."""
    return os.path.join(tag_dir, f"layer_0_expert_{expert}_mp_rank_{tp_rank:02d}_model_states.pt")


def zero_optim_file(tag_dir: str, dp_rank: int, mp_rank: int) -> str:
    """ZeRO-1/2 data rank ``dp_rank``'s optimizer partition of model-parallel rank ``mp_rank``."""
    return os.path.join(tag_dir, f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt")


def expert_optim_file(tag_dir: str, ep_shard: int, mp_rank: int) -> str:
    """ZeRO-0 at E > 1: the whole optimizer of EP shard ``ep_shard`` (DeepSpeed's MoE save)."""
    return os.path.join(tag_dir, f"expp_rank_{ep_shard}_mp_rank_{mp_rank:02d}_optim_states.pt")


def has_layer_files(tag_dir: str) -> bool:
    return bool(glob.glob(os.path.join(tag_dir, "layer_*-model_*-model_states.pt")))


def load_file(path: str) -> dict:
    """torch.load with mmap: tensors are paged in when touched, so reading one layer of a big
    per-rank file does not load the rest."""
    if not os.path.isfile(path):
        raise CheckpointFormatError(f"missing checkpoint file {path} (partial or corrupt checkpoint)")
    try:
        return safe_load(path, mmap=True)
    except UnreadableFileError as err:   # truncated zip, not a torch file, ...
        raise CheckpointFormatError(str(err)) from None


class ModuleStateReader:
    """TP pieces of one global layer's parameters, from either file layout."""

    def __init__(self, tag_dir: str, cfg: ModelConfig, tp: int, pipeline: bool):
        self.tag_dir, self.cfg, self.tp, self.pipeline = tag_dir, cfg, tp, pipeline
        self._modules: dict[int, dict] = {}

    def _module(self, tp_rank: int) -> dict:
        if tp_rank not in self._modules:
            module = load_file(mp_rank_file(self.tag_dir, tp_rank)).get("module")
            if not isinstance(module, dict):
                raise CheckpointFormatError(f"{mp_rank_file(self.tag_dir, tp_rank)} holds no module weights")
            self._modules[tp_rank] = module
        return self._modules[tp_rank]

    def pieces(self, layer: int, names: Iterable[str]) -> dict[str, list[torch.Tensor]]:
        names = list(names)
        out: dict[str, list[torch.Tensor]] = {n: [] for n in names}
        for tp_rank in range(self.tp):
            if self.pipeline:
                state = load_file(layer_file(self.tag_dir, layer, tp_rank))
                keys = {n: n for n in names}
            else:
                state = self._module(tp_rank)
                keys = {n: ds_name(self.cfg, layer, n, pipeline=False) for n in names}
            for n in names:
                if keys[n] not in state:
                    where = layer_file(self.tag_dir, layer, tp_rank) if self.pipeline else mp_rank_file(self.tag_dir, tp_rank)
                    raise CheckpointFormatError(f"{where} lacks parameter {keys[n]!r}: the checkpoint is of a "
                                                f"different model or partial")
                out[n].append(state[keys[n]])
        return out


def own_storage(t: torch.Tensor) -> torch.Tensor:
    """torch.save writes a view's whole storage: copy views, keep tensors that own theirs (no extra memory)."""
    t = t.contiguous()
    return t if t.untyped_storage().nbytes() == t.numel() * t.element_size() else t.clone()


def write_layer_file(tag_dir: str, layer: int, tp_rank: int, state: dict[str, torch.Tensor]) -> None:
    torch.save({k: own_storage(v) for k, v in state.items()}, layer_file(tag_dir, layer, tp_rank))


def engine_state(*, module, mp_world_size: int, dp_world_size: int, client_state: dict) -> dict:
    """The keys DeepSpeed's load_checkpoint(load_module_only=True) reads from an mp_rank file."""
    import deepspeed
    return {"module": module, "buffer_names": [], "optimizer": None, "param_shapes": None, "lr_scheduler": None,
            "global_steps": 0, "global_samples": 0, "skipped_steps": 0, "dp_world_size": dp_world_size,
            "mp_world_size": mp_world_size, "ds_version": deepspeed.__version__, **client_state}
