"""Data pipeline: corpus -> tokens (cached) -> packed samples -> per-rank micro-batches.

    tok = load_tokenizer(None)                       # shipped byte-level BPE
    check_vocab(tok, model_vocab_size)
    check_seq_length(seq_length, max_positions)
    ds = build_packed_dataset(None, tok, seq_length)  # shipped corpus
    train_ds, eval_ds = split_train_eval(ds, 0.05, seed)
    stream = MicroBatchStream(train_ds, global_batch_size=B, micro_batch_size=b,
                              dp_rank=r, dp_size=d, seed=seed)

Every error is a DataError with a one-line message.
"""
from mtds import lazy_exports

# Resolved on first use (PEP 562): mtds-preprocess's worker processes import mtds.data.indexed and
# must not pay for torch and datasets, which the training-side modules pull in.
_HOMES = {"SHIPPED_CORPUS": "assets", "SHIPPED_TOKENIZER": "assets", "check_seq_length": "checks",
          "DataError": "errors", "PackedDataset": "packed", "build_packed_dataset": "packed",
          "build_train_eval": "split", "split_train_eval": "split", "MicroBatchStream": "micro_batches",
          "build_streams": "job_data", "check_vocab": "tokenizer", "load_tokenizer": "tokenizer"}

__all__ = ["DataError", "load_tokenizer", "check_vocab", "check_seq_length",
           "build_packed_dataset", "PackedDataset", "split_train_eval", "build_train_eval",
           "MicroBatchStream", "build_streams", "SHIPPED_CORPUS", "SHIPPED_TOKENIZER"]

__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
