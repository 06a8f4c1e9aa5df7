"""Megatron-LM checkpoints in and out: the ``torch_dist`` format Megatron-LM writes with
``--ckpt-format torch_dist`` (Megatron-core's ``dist_checkpointing``), for GPT-2 and Llama-style models.

args.py       Megatron-LM's arguments (``common.pt``'s ``args``, or flags) <-> ModelConfig
keys.py       Megatron-core's sharded-state keys <-> mtds's (global layer, name), with the two layouts that differ
              (QKV interleaved per query group; layers stacked on a leading axis)
common.py     ``common.pt`` read without running code: unknown classes (enums, functions) become opaque stubs
dist_ckpt.py  the ``iter_XXXXXXX`` folder: found from the tracker file, read and written through
              torch.distributed.checkpoint (the storage layer Megatron-core's torch_dist strategy uses)
convert.py    both directions between a Megatron folder and an mtds checkpoint (``mtds-convert``)
errors.py     MegatronCheckpointError: the one-line message of every refusal
deepspeed_import.py  Megatron-DeepSpeed's GPTModelPipe checkpoints (DeepSpeed layer files) -> mtds, through
              deepspeed.checkpoint.DeepSpeedCheckpoint

Tensors in a torch_dist checkpoint are stored at their global shape (every TP/PP shard placed at its
offset), so reading and writing here is layout free: any (t, p) on either side.
"""
