"""Packed GPT samples over an indexed dataset: document, sample and shuffle indices (Megatron's scheme).

For `num_samples` samples of s = seq_length (+1 shared boundary token) from documents with
lengths L (T tokens in all):

  epochs        E = the fewest with (E*T - 1) // s >= num_samples
  doc_index     E permutations of the documents, epoch e's seeded by (seed, e), back to back:
                the token stream is their concatenation (every document once per epoch)
  sample_index  sample j starts at stream token j*s: (position in doc_index, offset in that
                document), found for all samples at once with searchsorted on the cumulative
                lengths (vectorized numpy, no per-token loop)
  shuffle_index the samples of each epoch (by their first token) permuted among themselves,
                seeded by (seed, e) too

Sample j is stream[j*s : j*s + s + 1]; consecutive samples share a boundary token as in
mtds.data.packed. Shuffling within epochs (not across all of them) keeps the order of every
epoch but the last built one independent of E: a longer run repeats a shorter one's first epochs.
"""
import numpy as np

from ..errors import DataError


def epochs_needed(total_tokens: int, seq_length: int, num_samples: int) -> int:
    if total_tokens < 1:
        raise DataError("an indexed dataset with no tokens cannot give samples")
    return max(1, -(-(num_samples * seq_length + 1) // total_tokens))


def build_indices(doc_lengths: np.ndarray, seq_length: int, num_samples: int, seed: int) -> dict:
    """doc_lengths: int64 per document (the documents this split uses, by position).
    Returns {"doc_index", "sample_index", "shuffle_index", "epochs"}; sample i of the dataset
    is built sample shuffle_index[i]."""
    lengths = np.asarray(doc_lengths, dtype=np.int64)
    total = int(lengths.sum())
    epochs = epochs_needed(total, seq_length, num_samples)
    n_docs = len(lengths)
    doc_dtype = np.int32 if n_docs < 2 ** 31 else np.int64
    doc_index = np.concatenate([np.random.default_rng([seed, 0, e]).permutation(n_docs).astype(doc_dtype)
                                for e in range(epochs)])
    ends = np.cumsum(lengths[doc_index])                  # stream position where each entry ends
    n_built = (epochs * total - 1) // seq_length
    starts = np.arange(n_built, dtype=np.int64) * seq_length
    where = np.searchsorted(ends, starts, side="right")   # first entry ending after the start
    sample_index = np.stack([where, starts - (ends[where] - lengths[doc_index[where]])], axis=1)
    return {"doc_index": doc_index, "sample_index": sample_index,
            "shuffle_index": _shuffle(starts // total, epochs, seed), "epochs": epochs}


def _shuffle(sample_epoch: np.ndarray, epochs: int, seed: int) -> np.ndarray:
    """A permutation of the samples that only moves samples within their epoch."""
    bounds = np.searchsorted(sample_epoch, np.arange(epochs + 1))
    out = np.arange(len(sample_epoch), dtype=np.int64)
    for e in range(epochs):
        lo, hi = bounds[e], bounds[e + 1]
        out[lo:hi] = lo + np.random.default_rng([seed, 1, e]).permutation(hi - lo)
    return out


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
        self.shuffle_index = indices["shuffle_index"]
        seqs = dataset.document_indices[:-1][self.documents]
        self.doc_start = dataset.sequence_pointers[seqs] // dataset.dtype.itemsize

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def __getitem__(self, i: int) -> np.ndarray:
        pos, offset = (int(v) for v in self.sample_index[int(self.shuffle_index[i])])
        need, parts = self.seq_length + 1, []
        while need > 0:
            doc = int(self.doc_index[pos])
            take = min(int(self.doc_lengths[doc]) - offset, need)
            start = int(self.doc_start[doc]) + offset
            parts.append(self.dataset.ids[start:start + take])
            need -= take
            pos, offset = pos + 1, 0
        return np.concatenate(parts) if len(parts) > 1 else np.array(parts[0])
