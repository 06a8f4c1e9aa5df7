"""A blend of indexed datasets as one map-style dataset of packed samples, indices cached on disk.

    ds = build_blended([(0.3, "a_text_document"), (0.7, "b_text_document")], seq_length=128,
                       num_samples=steps * B, seed=1234, builder=local_rank == 0)
    ds[n]   # LongTensor of seq_length + 1 ids: sample dataset_sample_index[n] of dataset dataset_index[n]

`split` = (fraction, part) holds data out: each dataset's documents in a seeded order, cut at
`fraction` of its tokens from the end; what lies after the cut is the "eval" part, the rest "train".
Whole documents, except the one the cut falls in (split in two), so the fraction is exact even for a
dataset of one document, and no token is in both parts.
"""
import os

import numpy as np
import torch

from mtds.data.indexed.blend_spec import blending_index
from mtds.data.indexed.checks import check_fills_a_sample, check_token_ids
from mtds.data.indexed.index_cache import cache_key, load_or_build, prefix_identity
from mtds.data.indexed.reader import IndexedDataset
from mtds.data.indexed.samples import PackedSamples, build_indices

_VERSION = 1


class BlendedSamples:
    grows_by_prefix = True   # its first n samples are the same whatever its length (see samples.py)

    def __init__(self, parts, dataset_index, dataset_sample_index, seq_length, sources):
        self.parts, self.seq_length, self.sources = parts, seq_length, sources
        self.dataset_index, self.dataset_sample_index = dataset_index, dataset_sample_index

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, n: int) -> torch.Tensor:
        if not -len(self) <= n < len(self):
            raise IndexError(f"sample {n} out of range for {len(self)} samples")
        part = self.parts[int(self.dataset_index[n])]
        return torch.from_numpy(part[int(self.dataset_sample_index[n])].astype(np.int64))


def split_pieces(dataset, split, seed: int):
    """(starts, lengths) in the .bin of the documents (or pieces of one) that make up this part."""
    lengths = dataset.document_lengths()
    starts = dataset.sequence_pointers[dataset.document_indices[:-1]] // dataset.dtype.itemsize
    if split is None:
        return np.asarray(starts, dtype=np.int64), lengths
    fraction, part = split
    order = np.random.default_rng([seed, 2]).permutation(len(lengths))
    ends = np.cumsum(lengths[order])
    cut = int(round(int(ends[-1]) * (1.0 - fraction))) if len(ends) else 0
    k = int(np.searchsorted(ends, cut, side="right"))   # the document the cut falls in (if any)
    head = cut - (int(ends[k - 1]) if k else 0)
    if part == "train":
        docs = order[:k]
        piece = (starts[order[k]], head) if k < len(order) else None
    else:
        docs = order[k + 1:]
        piece = (starts[order[k]] + head, lengths[order[k]] - head) if k < len(order) else None
    part_starts, part_lengths = starts[docs].astype(np.int64), lengths[docs]
    if piece is not None and piece[1] > 0:   # the document the cut falls in: its head or its tail
        part_starts = np.append(part_starts, piece[0])
        part_lengths = np.append(part_lengths, piece[1])
    in_file_order = np.argsort(part_starts, kind="stable")   # reads stay local
    return part_starts[in_file_order], part_lengths[in_file_order]


def build_blended(blend, *, seq_length: int, num_samples: int, seed: int, builder: bool,
                  cache_dir=None, split=None, log=print, wait_timeout: float = 3600.0,
                  vocab_size=None) -> BlendedSamples:
    datasets = [IndexedDataset(prefix) for _, prefix in blend]
    if vocab_size is not None:
        for ds in datasets:
            check_token_ids(ds, vocab_size)
    weights = [w for w, _ in blend]
    parts_starts, parts_lengths = [], []
    for ds in datasets:
        starts, lengths = split_pieces(ds, split, seed)
        check_fills_a_sample(ds, int(lengths.sum()), seq_length, f" ({split[1]} part)" if split else "")
        parts_starts.append(starts)
        parts_lengths.append(lengths)
    key = cache_key({"v": _VERSION, "sources": [prefix_identity(ds) for ds in datasets], "weights": weights,
                     "seq_length": seq_length, "seed": seed, "num_samples": num_samples,
                     "split": list(split) if split else None})
    home = cache_dir or os.environ.get("MTDS_DATA_CACHE") or os.path.join(
        os.path.dirname(os.path.abspath(datasets[0].prefix)), ".mtds_cache")
    directory = os.path.join(home, f"blend-{key}")

    def build():
        which, sample = blending_index(weights, num_samples)
        arrays, epochs = {"dataset_index": which, "dataset_sample_index": sample}, []
        for k, lengths in enumerate(parts_lengths):
            needed = int(np.count_nonzero(which == k))
            idx = build_indices(lengths, seq_length, max(needed, 1), seed)
            epochs.append(round(needed * seq_length / int(lengths.sum()), 3))
            arrays[f"ds{k}_doc_index"] = idx["doc_index"]
            for name in ("sample_index", "shuffle_index"):   # max(needed, 1) above: never an empty build
                arrays[f"ds{k}_{name}"] = idx[name][:needed]
        return arrays, {"epochs": epochs, "num_samples": num_samples}

    built = load_or_build(directory, build, builder=builder, log=log, timeout=wait_timeout)
    parts, sources = [], []
    for k, ds in enumerate(datasets):
        indices = {name: built[f"ds{k}_{name}"] for name in ("doc_index", "sample_index", "shuffle_index")}
        parts.append(PackedSamples(ds, parts_starts[k], parts_lengths[k], indices, seq_length))
        sources.append({"prefix": ds.prefix, "weight": weights[k], "documents": len(parts_starts[k]),
                        "tokens": int(parts_lengths[k].sum()), "samples": len(indices["shuffle_index"]),
                        "epochs": built["meta"]["epochs"][k]})
    return BlendedSamples(parts, built["dataset_index"], built["dataset_sample_index"], seq_length, sources)
