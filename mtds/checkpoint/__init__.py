"""Checkpoints, all in one place: the crash-safe lifecycle of a training run's saves, DeepSpeed's files read
and written without an engine at any layout, resharding, universal conversion, and safe loading.

lifecycle.py      save and resume through DeepSpeed, plus what it does not keep (data position, RNG, meta)
commit.py         rank 0's half of a crash-safe save: the staged folder becomes the checkpoint
complete.py       which checkpoints are complete (markers, manifests); resolve_tag_dir
durable.py        fsynced files and folders, atomic replacement;  safe_load.py: torch.load that runs no code
shard_spec.py     every layer's parameters and how each is split over TP ranks (the one table everything uses)
names.py          DeepSpeed parameter names (pipeline / single-stage) <-> (global layer, name)
meta.py           mtds_meta.json: model config, layout, tokenizer of a checkpoint
dsformat.py       DeepSpeed's model-state files;  reader.py / writer.py: full logical layers out / in
reshard_load.py   a checkpoint's weights into the layers a rank builds, at any layout (weights-only loads, eval)
universal.py      DeepSpeed universal checkpointing (patterns, conversion, name aliases)
reshard_zero0.py  the same for ZeRO-0, which DeepSpeed's universal checkpointing does not handle
zero3_weights.py  the weights of a ZeRO-3 checkpoint, for export and evaluation

DeepSpeed's private checkpoint internals are reached only through :mod:`mtds.deepspeed_compat.checkpointing`
(the one boundary to DeepSpeed's internals); HF's files through :mod:`mtds.hf`.
"""
