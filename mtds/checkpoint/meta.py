"""``mtds_meta.json``: written by rank 0 into every checkpoint tag folder, so tools need only --ckpt.

It holds what DeepSpeed's files do not say plainly: the logical model (ModelConfig), the layout the
files are sharded for, which module shape wrote them (pipeline per-layer files or one file per TP
rank), precision/ZeRO stage, the tokenizer, and whether the checkpoint carries optimizer state.
"""
from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from mtds.model.config import ModelConfig

from mtds.checkpoint.errors import CheckpointFormatError

META_FILE = "mtds_meta.json"
LATEST = "latest"
FORMAT_VERSION = 1


@dataclass
class CheckpointMeta:
    model: dict                      # ModelConfig.to_dict()
    tp: int
    pp: int
    dp: int
    step: int = 0
    # expert-parallel size E: each data rank holds 1/E of the experts, in its own files (docs/moe.md); 1 in
    # checkpoints written before it was recorded
    ep: int = 1
    zero_stage: int = 0
    precision: str = "fp32"
    tokenizer: str | None = None
    weights_only: bool = False       # hf-to-mtds output: module weights, no optimizer/data state
    # parameter order of the pipeline module ("" DeepSpeed's PipelineModule / plain; "chunks2" mtds's
    # ChunkedPipelineModule; "dualpipev"; "+layout3-1" a non-uniform pipeline layout, blocks per stage): rank
    # files written in another order need resharding by name
    module_order: str = ""
    pipeline: bool = False           # per-layer files (PipelineModule) vs mp_rank files (SequentialGPT)
    format_version: int = FORMAT_VERSION
    extra: dict = field(default_factory=dict)

    @property
    def layout(self) -> dict:
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp, "ep": self.ep}

    @property
    def model_config(self) -> ModelConfig:
        return ModelConfig(**self.model)

    def save(self, tag_dir: str) -> None:
        from mtds.checkpoint.durable import write_atomic
        write_atomic(os.path.join(tag_dir, META_FILE), json.dumps(asdict(self), indent=2))   # never half-written

    @classmethod
    def load(cls, tag_dir: str) -> "CheckpointMeta":
        path = os.path.join(tag_dir, META_FILE)
        if not os.path.isfile(path):
            raise CheckpointFormatError(f"{tag_dir!r} has no {META_FILE}: not an mtds checkpoint, or a partial one "
                                        f"(the save did not finish)")
        with open(path) as f:
            d: dict[str, Any] = json.load(f)
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in known})

