"""Packed GPT samples over an indexed dataset: document, sample and shuffle indices (Megatron's scheme).

Documents with lengths L (T tokens in all), s = seq_length:

  doc_index     epoch permutations of the documents, epoch e's seeded by (seed, e), back to back:
                the token stream is their concatenation (every document once per epoch)
  windows       window j = stream[j*s : j*s + s + 1] (consecutive windows share a boundary token,
                as in mtds.data.packed); epoch e owns the windows starting in [e*T, (e+1)*T)
  shuffle_index which windows are used, in order: epoch by epoch, each epoch's windows in a
                pseudo-random permutation keyed by (seed, e); the last epoch contributes a prefix of
                its own. The permutation is a Feistel network (cycle-walked onto the window count),
                evaluated only at the positions used: O(samples used), not O(windows in the epoch)
  sample_index  (position in doc_index, offset in that document) where each used window starts,
                for all of them at once by searchsorted on the cumulative lengths (vectorized)

Only the samples asked for are materialized, so a corpus far larger than the run needs costs its
document count, not its token count. Nothing depends on how many samples are asked for, so the
first n samples of a longer build are the n samples of a shorter one: a run resumed with more
--steps continues the same order.
"""
import numpy as np

from mtds.data.errors import DataError


def _first_window(epoch, total: int, s: int):
    """Index of the first window starting in `epoch` (works on arrays)."""
    return -(-np.asarray(epoch, dtype=np.int64) * total // s)


_MULT = np.uint64(0x9E3779B97F4A7C15)


def permuted(positions: np.ndarray, n: int, key) -> np.ndarray:
    """Entries `positions` of a keyed pseudo-random permutation of range(n), without building it.

    A 4-round Feistel network is a bijection of [0, 2^bits); values that land at or beyond n walk
    the cycle again until they fall inside, which keeps it a bijection of [0, n). The first m
    entries therefore do not depend on how many are asked for.
    """
    if n <= 1:
        return np.zeros(len(positions), dtype=np.int64)
    bits = max(2, int(n - 1).bit_length())
    bits += bits % 2
    half, mask = np.uint64(bits // 2), np.uint64((1 << (bits // 2)) - 1)
    keys = np.random.default_rng(list(key)).integers(0, 2 ** 63, size=4, dtype=np.uint64)
    out = np.asarray(positions, dtype=np.uint64).copy()
    todo = np.ones(len(out), dtype=bool)
    with np.errstate(over="ignore"):
        while todo.any():
            x = out[todo]
            left, right = x >> half, x & mask
            for k in keys:
                mixed = (right + k) * _MULT
                left, right = right, left ^ ((mixed ^ (mixed >> np.uint64(29))) & mask)
            x = (left << half) | right
            out[todo] = x
            todo[todo] = x >= np.uint64(n)
    return out.astype(np.int64)


def epochs_needed(total_tokens: int, seq_length: int, num_samples: int) -> int:
    """The fewest epochs whose windows number at least num_samples."""
    if total_tokens < 1:
        raise DataError("an indexed dataset with no tokens cannot give samples")
    epochs = max(1, (num_samples - 1) * seq_length // total_tokens)
    while _first_window(epochs, total_tokens, seq_length) < num_samples:
        epochs += 1
    return epochs


def build_indices(doc_lengths: np.ndarray, seq_length: int, num_samples: int, seed: int) -> dict:
    """doc_lengths: int64 per document (the documents this part uses, by position).
    Returns {"doc_index", "shuffle_index", "sample_index", "epochs"}, the last two of num_samples rows."""
    lengths = np.asarray(doc_lengths, dtype=np.int64)
    total, s = int(lengths.sum()), seq_length
    if total < s + 1:   # callers check first, with a message naming the data
        raise DataError(f"{total} tokens cannot fill one sample of {s + 1}")
    epochs = epochs_needed(total, s, num_samples)
    n_docs = len(lengths)
    doc_dtype = np.int32 if n_docs < 2 ** 31 else np.int64
    perms = [np.random.default_rng([seed, 0, e]).permutation(n_docs).astype(doc_dtype) for e in range(epochs + 1)]
    # The last window of an epoch reaches up to s tokens into the next: keep just enough of it.
    perms[-1] = perms[-1][:int(np.searchsorted(np.cumsum(lengths[perms[-1]]), s + 1)) + 1]
    doc_index = np.concatenate(perms)
    first = _first_window(np.arange(epochs + 1), total, s)
    chosen, remaining = [], num_samples
    for e in range(epochs):
        size = int(first[e + 1] - first[e])
        take = min(size, remaining)
        chosen.append(first[e] + permuted(np.arange(take, dtype=np.int64), size, (seed, 1, e)))
        remaining -= take
    shuffle_index = np.concatenate(chosen).astype(np.int64)
    ends = np.cumsum(lengths[doc_index])                  # stream position where each entry ends
    starts = shuffle_index * s
    where = np.searchsorted(ends, starts, side="right")   # first entry ending after the start
    offsets = starts - (ends[where] - lengths[doc_index[where]])
    return {"doc_index": doc_index, "shuffle_index": shuffle_index,
            "sample_index": np.stack([where, offsets], axis=1), "epochs": epochs}


class PackedSamples:
    """Sample i (i < num_samples) of one indexed dataset as a numpy array of seq_length + 1 ids.

    Document d (a doc_index value) is the token range [doc_start[d], doc_start[d] + doc_lengths[d])
    of the .bin: a whole document, or the piece of one that a train/eval cut leaves to this part.
    """

    def __init__(self, dataset, doc_start, doc_lengths, indices, seq_length: int):
        self.dataset, self.seq_length = dataset, seq_length
        self.doc_start = np.asarray(doc_start)
        self.doc_lengths = np.asarray(doc_lengths)
        self.doc_index = indices["doc_index"]
        self.sample_index = indices["sample_index"]

    def __len__(self) -> int:
        return len(self.sample_index)

    def __getitem__(self, i: int) -> np.ndarray:
        pos, offset = (int(v) for v in self.sample_index[i])
        need, parts = self.seq_length + 1, []
        while need > 0:
            doc = int(self.doc_index[pos])
            take = min(int(self.doc_lengths[doc]) - offset, need)
            start = int(self.doc_start[doc]) + offset
            parts.append(self.dataset.ids[start:start + take])
            need -= take
            pos, offset = pos + 1, 0
        return np.concatenate(parts) if len(parts) > 1 else np.array(parts[0])
