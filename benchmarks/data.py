"""The benchmark's batches: the shipped corpus through mtds's own data pipeline, so the HF side
reads exactly the samples, in exactly the order, that ``mtds.training.run`` feeds the engine."""
from __future__ import annotations


def micro_batch_stream(seq: int, micro_batch: int, global_batch: int, seed: int, dp_rank: int = 0, dp_size: int = 1):
    from mtds.data import MicroBatchStream, build_packed_dataset, load_tokenizer
    tokenizer = load_tokenizer(None)
    # eval_split 0 on the mtds side too: the whole packed corpus is the training set.
    dataset = build_packed_dataset(None, tokenizer, seq, show_progress=False)
    return MicroBatchStream(dataset, global_batch_size=global_batch, micro_batch_size=micro_batch,
                            dp_rank=dp_rank, dp_size=dp_size, seed=seed)
