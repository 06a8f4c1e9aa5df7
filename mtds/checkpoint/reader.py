"""Read an mtds checkpoint (any layout, either file layout, ZeRO-0/1/2/3) as full logical tensors, one layer
at a time.

Peak memory is one layer's pieces from every TP rank plus its merged copy: the per-layer files are
mmapped and only the requested layer is touched. Expert-parallel checkpoints (E > 1) too: each block's
stacked experts are joined from DeepSpeed's per-expert files (mtds.checkpoint.expert_files).
"""
from __future__ import annotations

import os
from typing import Iterable, Iterator

import torch

from mtds.checkpoint.complete import resolve_tag_dir
from mtds.checkpoint.dsformat import ModuleStateReader, has_layer_files, layer_file, mp_rank_file
from mtds.checkpoint.errors import CheckpointFormatError
from mtds.checkpoint.expert_files import ExpertFileReader, PipelineStageReader, expert_files
from mtds.checkpoint.meta import CheckpointMeta
from mtds.checkpoint.shard_spec import layer_names, unshard
from mtds.checkpoint.zero3_weights import Zero3StateReader, expected_zero3_files


class MtdsCheckpoint:
    def __init__(self, path: str):
        self.tag_dir = resolve_tag_dir(path)
        self.meta = CheckpointMeta.load(self.tag_dir)
        try:
            self.cfg = self.meta.model_config
        except (TypeError, ValueError) as err:
            raise CheckpointFormatError(f"{self.tag_dir}: unusable model config in meta file ({err})") from None
        # ZeRO-3 keeps the weights only in the optimizer's fp32 partitions (consolidated per TP rank).
        self.zero3 = self.meta.zero_stage == 3 and not self.meta.weights_only
        # at E > 1 the stacked experts are in DeepSpeed's per-expert files (mtds.checkpoint.expert_files); on a
        # pipeline the stages holding MoE blocks write their module into their mp_rank file, not per-layer files
        self.expert_files = self.meta.ep > 1 and not self.meta.weights_only
        if self.expert_files and self.zero3:     # training refuses it too
            raise CheckpointFormatError(f"{self.tag_dir} was saved at --expert-model-parallel-size {self.meta.ep} "
                                        f"with ZeRO-3: not a layout mtds writes")
        stages = self.expert_files and self.meta.pipeline
        if not stages and self.meta.pipeline != has_layer_files(self.tag_dir):
            raise CheckpointFormatError(f"{self.tag_dir}: per-layer files "
                                        f"{'missing' if self.meta.pipeline else 'unexpected'} (partial checkpoint?)")
        if stages:
            self._check_files([mp_rank_file(self.tag_dir, r) for r in range(self.meta.tp * self.meta.pp)])
            self._reader = PipelineStageReader(self.tag_dir, self.cfg, self.meta.tp, self.meta.pp)
        else:
            self._reader = Zero3StateReader(self.tag_dir, self.cfg, self.meta.tp) if self.zero3 else \
                ModuleStateReader(self.tag_dir, self.cfg, self.meta.tp, self.meta.pipeline)
        self._check_files(self._expected_files())
        if self.expert_files:
            self._reader = ExpertFileReader(self._reader, self.tag_dir, self.cfg, self.meta.tp)

    def _expected_files(self) -> list[str]:
        """Every file the layout implies must exist: fail before writing anything, not half-way."""
        t, p = self.meta.tp, self.meta.pp
        if isinstance(self._reader, PipelineStageReader):
            return self._reader.expected_files(layer_names(self.cfg))
        wanted = expected_zero3_files(self.tag_dir, t, self.meta.dp) if self.zero3 else \
            [mp_rank_file(self.tag_dir, r) for r in range(t * p if self.meta.pipeline else t)]
        if self.meta.pipeline:
            wanted += [layer_file(self.tag_dir, layer, r) for layer in layer_names(self.cfg) for r in range(t)]
        if self.expert_files:
            wanted += expert_files(self.tag_dir, self.cfg, range(t))
        return wanted

    def _check_files(self, wanted: list[str]) -> None:
        missing = [os.path.basename(f) for f in wanted if not os.path.isfile(f)]
        if missing:
            raise CheckpointFormatError(f"{self.tag_dir} is partial: {len(missing)} file(s) missing, e.g. "
                                        f"{', '.join(missing[:3])}")

    def layers(self, wanted: Iterable[int] | None = None) -> Iterator[tuple[int, dict[str, torch.Tensor]]]:
        """(global layer, {name: full unpadded tensor}) in layer order; only ``wanted`` layers are read."""
        wanted = None if wanted is None else set(wanted)
        for layer, names in layer_names(self.cfg).items():
            if wanted is not None and layer not in wanted:
                continue
            pieces = self._reader.pieces(layer, names)
            yield layer, {n: unshard(self.cfg, layer, n, [p.detach() for p in pieces[n]]) for n in names}


def open_checkpoint(path: str) -> MtdsCheckpoint:
    return MtdsCheckpoint(path)
