"""Cheap checks that an indexed dataset fits the model: token ids below its vocabulary."""
import numpy as np

from mtds.data.errors import DataError

_BLOCKS, _BLOCK = 32, 1 << 15


def check_token_ids(dataset, vocab_size: int) -> None:
    """The dtype's range settles it when it is small enough; otherwise the largest id in the first
    and last blocks and 32 blocks spread over the .bin (a few MB read, whatever the corpus size)."""
    if np.iinfo(dataset.dtype).max < vocab_size or dataset.num_tokens == 0:
        return
    n = dataset.num_tokens
    starts = np.unique(np.linspace(0, max(0, n - _BLOCK), _BLOCKS + 2).astype(np.int64))
    largest = max(int(dataset.ids[s:s + _BLOCK].max()) for s in starts)
    smallest = min(int(dataset.ids[s:s + _BLOCK].min()) for s in starts)
    if largest >= vocab_size or smallest < 0:
        bad = largest if largest >= vocab_size else smallest
        raise DataError(f"{dataset.prefix}.bin holds token id {bad}, outside the model's vocabulary of "
                        f"{vocab_size}; preprocess with the model's tokenizer or use a model whose "
                        f"vocab_size covers it")


def check_fills_a_sample(dataset, tokens: int, seq_length: int, what: str) -> None:
    if tokens < seq_length + 1:
        hint = " (or --eval-split 0, or --eval-data-path)" if what else ""
        raise DataError(f"{dataset.prefix}{what} has {tokens} tokens, fewer than one sample of "
                        f"seq_length + 1 = {seq_length + 1}; use more data or a shorter --seq-length{hint}")
