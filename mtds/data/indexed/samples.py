"""Packed GPT samples over an indexed dataset: document, sample and shuffle indices (Megatron's scheme).

For `num_samples` samples of s = seq_length (+1 shared boundary token) from documents with
lengths L (T tokens in all):

  epochs        E = the fewest with (E*T - 1) // s >= num_samples
  doc_index     E permutations of the documents, epoch e's seeded by (seed, e), back to back:
                the token stream is their concatenation (every document once per epoch)
  shuffle_index which stream windows are used, in order: window j = stream[j*s : j*s + s + 1]
                (consecutive windows share a boundary token, as in mtds.data.packed). Each epoch's
                windows (by first token) are permuted among themselves; the last epoch, when
                only part of it is needed, gives a seeded random choice of its windows
  sample_index  (position in doc_index, offset in that document) where each used window starts,
                for all of them at once by searchsorted on the cumulative lengths (vectorized)

Only the samples asked for are materialized, so a corpus far larger than the run needs costs its
document count, not its token count. Shuffling within epochs keeps every epoch but the last one
independent of E: a longer run repeats a shorter one's first epochs.
"""
import numpy as np

from ..errors import DataError


def epochs_needed(total_tokens: int, seq_length: int, num_samples: int) -> int:
    if total_tokens < 1:
        raise DataError("an indexed dataset with no tokens cannot give samples")
    return max(1, -(-(num_samples * seq_length + 1) // total_tokens))


def build_indices(doc_lengths: np.ndarray, seq_length: int, num_samples: int, seed: int) -> dict:
    """doc_lengths: int64 per document (the documents this split uses, by position).
    Returns {"doc_index", "shuffle_index", "sample_index", "epochs"}, the last two of num_samples rows."""
    lengths = np.asarray(doc_lengths, dtype=np.int64)
    total, s = int(lengths.sum()), seq_length
    epochs = epochs_needed(total, s, num_samples)
    n_docs = len(lengths)
    doc_dtype = np.int32 if n_docs < 2 ** 31 else np.int64
    doc_index = np.concatenate([np.random.default_rng([seed, 0, e]).permutation(n_docs).astype(doc_dtype)
                                for e in range(epochs)])
    n_built = (epochs * total - 1) // s                    # windows that fit in E epochs
    first = -(-np.arange(epochs + 1, dtype=np.int64) * total // s)   # first window of each epoch
    chosen, remaining = [], num_samples
    for e in range(epochs):
        lo, hi = int(first[e]), min(int(first[e + 1]), n_built)
        rng = np.random.default_rng([seed, 1, e])
        if hi - lo <= remaining:
            chosen.append(lo + rng.permutation(hi - lo))
        else:   # the last, partly used epoch: a seeded choice without drawing a permutation of all
            chosen.append(lo + rng.choice(hi - lo, remaining, replace=False))
        remaining -= len(chosen[-1])
        if remaining == 0:
            break
    shuffle_index = np.concatenate(chosen).astype(np.int64)
    ends = np.cumsum(lengths[doc_index])                  # stream position where each entry ends
    starts = shuffle_index * s
    where = np.searchsorted(ends, starts, side="right")   # first entry ending after the start
    offsets = starts - (ends[where] - lengths[doc_index[where]])
    return {"doc_index": doc_index, "shuffle_index": shuffle_index,
            "sample_index": np.stack([where, offsets], axis=1), "epochs": epochs}


class PackedSamples:
    """Sample i (i < num_samples) of one indexed dataset as a numpy array of seq_length + 1 ids.

    `documents` maps a document position (doc_index value) to the document id in `dataset`;
    document tokens are contiguous in the .bin, starting at `doc_start[id]`.
    """

    def __init__(self, dataset, documents, doc_lengths, indices, seq_length: int):
        self.dataset, self.seq_length = dataset, seq_length
        self.documents = np.asarray(documents)
        self.doc_lengths = np.asarray(doc_lengths)
        self.doc_index = indices["doc_index"]
        self.sample_index = indices["sample_index"]
        seqs = dataset.document_indices[:-1][self.documents]
        self.doc_start = dataset.sequence_pointers[seqs] // dataset.dtype.itemsize

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
