"""Weights of a ZeRO-3 checkpoint, for export and evaluation.

Under ZeRO-3 the model-state files hold no weights (only shapes): every parameter lives in the fp32
partitions of the optimizer files, flattened over the d data-parallel ranks. DeepSpeed's zero_to_fp32
consolidates them; it assumes one model-parallel rank, so it is run once per TP rank on that rank's
files (``zero_pp_rank_<d>_mp_rank_<t>_*``), and the TP pieces are joined by the split table like any
other checkpoint. The consolidated tensors stay lazy (views of the memory-mapped partitions) until a
layer asks for them.

DeepSpeed's readers unpickle with ``weights_only=False``: every file has been through the safe loader
before (complete.check_complete, which ``resolve_tag_dir`` runs).
"""
from __future__ import annotations

import contextlib
import glob
import io
import os
from typing import Iterable

import torch

from mtds.model.config import ModelConfig
from mtds.deepspeed_compat.checkpointing import consolidate_zero3

from mtds.checkpoint.errors import CheckpointFormatError
from mtds.checkpoint.names import ds_name


def zero3_files(tag_dir: str, tp_rank: int, kind: str) -> list[str]:
    """This TP rank's ``kind`` ("model" or "optim") files in data-parallel rank order."""
    from deepspeed.utils.zero_to_fp32 import natural_keys
    pattern = os.path.join(tag_dir, f"*zero_pp_rank_*_mp_rank_{tp_rank:02d}_{kind}_states.pt")
    return sorted(glob.glob(pattern), key=natural_keys)


def expected_zero3_files(tag_dir: str, tp: int, dp: int) -> list[str]:
    names = []
    for t in range(tp):
        for d in range(dp):
            names.append(os.path.join(tag_dir, f"zero_pp_rank_{d}_mp_rank_{t:02d}_model_states.pt"))
    return names


class Zero3StateReader:
    """TP pieces of one global layer's parameters, consolidated from ZeRO-3 partitions."""

    def __init__(self, tag_dir: str, cfg: ModelConfig, tp: int):
        self.tag_dir, self.cfg, self.tp = tag_dir, cfg, tp
        self._states: dict[int, dict] = {}

    def _state(self, tp_rank: int) -> dict:
        if tp_rank not in self._states:
            model_files, optim_files = (zero3_files(self.tag_dir, tp_rank, kind) for kind in ("model", "optim"))
            if not model_files or len(model_files) != len(optim_files):
                raise CheckpointFormatError(f"{self.tag_dir}: TP rank {tp_rank} has {len(model_files)} ZeRO-3 model "
                                            f"and {len(optim_files)} optimizer files (partial checkpoint?)")
            try:
                # zero_to_fp32 reports progress on stdout/stderr; a CLI's only stderr line is its error.
                with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                    stage, state = consolidate_zero3(model_files, optim_files, self.tag_dir)
                    if stage != 3:
                        raise ValueError(f"optimizer files are of ZeRO stage {stage}, not 3")
                    self._states[tp_rank] = state
            except (ValueError, KeyError, AssertionError, FileNotFoundError) as err:
                first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                raise CheckpointFormatError(f"{self.tag_dir}: cannot consolidate ZeRO-3 partitions of TP rank "
                                            f"{tp_rank}: {first}") from None
        return self._states[tp_rank]

    def pieces(self, layer: int, names: Iterable[str]) -> dict[str, list[torch.Tensor]]:
        out: dict[str, list[torch.Tensor]] = {}
        for n in names:
            key = ds_name(self.cfg, layer, n, pipeline=False)
            out[n] = []
            for tp_rank in range(self.tp):
                state = self._state(tp_rank)
                if key not in state:
                    raise CheckpointFormatError(f"{self.tag_dir} lacks parameter {key!r}: the checkpoint is of a "
                                                f"different model or partial")
                out[n].append(state[key].contiguous())     # materialise only this tensor
        return out
