"""mtds checkpoints without a running engine: read/write DeepSpeed's files at any layout, and reshard.

spec.py      every layer's parameters and how each is split over TP ranks (the one table everything uses)
names.py     DeepSpeed parameter names (pipeline / single-stage) <-> (global layer, name)
meta.py      mtds_meta.json: model config, layout, tokenizer of a checkpoint
complete.py  which checkpoints are complete (markers, manifests); resolve_tag_dir
dsformat.py  DeepSpeed's model-state files;  reader.py / writer.py: full logical layers out / in
load.py      a checkpoint's weights into the layers a rank builds, at any layout (weights-only loads, eval)
hf_source.py, hf_export.py  streaming HF safetensors in / out
universal.py DeepSpeed universal checkpointing (patterns, conversion, name aliases)
zero0.py     the same for ZeRO-0, which DeepSpeed's universal checkpointing does not handle
"""
from .errors import CheckpointFormatError
from .meta import CheckpointMeta
from .reader import MtdsCheckpoint, open_checkpoint

__all__ = ["CheckpointFormatError", "CheckpointMeta", "MtdsCheckpoint", "open_checkpoint"]
