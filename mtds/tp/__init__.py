"""Megatron-style tensor parallelism: mappings, layers, vocab-parallel cross entropy, RNG tracker."""
from mtds.tp.cross_entropy import gather_vocab_parallel_logits, vocab_parallel_cross_entropy
from mtds.tp.init_shard import shard_rows
from mtds.tp.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, mark_tensor_parallel,
                     padded_vocab_size, parallel_lm_logits, unshard_rows)
from mtds.tp.mappings import (all_to_all, copy_to_tensor_parallel_region, gather_from_sequence_parallel_region,
                       gather_from_tensor_parallel_region, reduce_from_tensor_parallel_region,
                       reduce_scatter_to_sequence_parallel_region, scatter_to_sequence_parallel_region,
                       scatter_to_tensor_parallel_region)
from mtds.tp.sequence_grads import (allreduce_sequence_parallel_grads, mark_sequence_parallel,
                             shared_by_sequence_shards)

__all__ = [
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "parallel_lm_logits",
    "vocab_parallel_cross_entropy", "gather_vocab_parallel_logits", "padded_vocab_size", "mark_tensor_parallel",
    "shard_rows", "unshard_rows", "shared_by_sequence_shards", "mark_sequence_parallel",
    "allreduce_sequence_parallel_grads",
    "all_to_all", "copy_to_tensor_parallel_region", "reduce_from_tensor_parallel_region", "scatter_to_tensor_parallel_region",
    "gather_from_tensor_parallel_region", "reduce_scatter_to_sequence_parallel_region",
    "gather_from_sequence_parallel_region", "scatter_to_sequence_parallel_region",
    "RNGTracker", "MODEL_PARALLEL_RNG", "model_parallel_seed", "seed_parallel_streams", "checkpoint",
]

# The RNG tracker's module is loaded when one of its names is first asked for: its compiler.disable imports
# torch._dynamo (~1 CPU-s), which a process using only the mappings (the cluster's self-test ranks) never needs.
_RANDOM = ("MODEL_PARALLEL_RNG", "RNGTracker", "checkpoint", "model_parallel_seed", "seed_parallel_streams")


def __getattr__(name):
    if name in _RANDOM:
        from mtds.tp import random
        return getattr(random, name)
    raise AttributeError(f"module 'mtds.tp' has no attribute {name!r}")
