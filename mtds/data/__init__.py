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
from .assets import SHIPPED_CORPUS, SHIPPED_TOKENIZER
from .checks import check_seq_length
from .errors import DataError
from .packed import PackedDataset, build_packed_dataset
from .split import build_train_eval, split_train_eval
from .stream import MicroBatchStream
from .streams import build_streams
from .tokenizer import check_vocab, load_tokenizer

__all__ = ["DataError", "load_tokenizer", "check_vocab", "check_seq_length",
           "build_packed_dataset", "PackedDataset", "split_train_eval", "build_train_eval",
           "MicroBatchStream", "build_streams", "SHIPPED_CORPUS", "SHIPPED_TOKENIZER"]
