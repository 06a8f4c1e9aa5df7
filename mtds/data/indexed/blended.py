"""A blend of indexed datasets as one map-style dataset of packed samples, indices cached on disk.

    ds = build_blended([(0.3, "a_text_document"), (0.7, "b_text_document")], seq_length=128,
                       num_samples=steps * B, seed=1234, builder=local_rank == 0)
    ds[n]   # LongTensor of seq_length + 1 ids: sample dataset_sample_index[n] of dataset dataset_index[n]

`split` = (fraction, part) holds documents out: a seeded `fraction` of each dataset's documents
is the "eval" part, the rest "train" (as Megatron's --split, by documents, so no document is in
both).
"""
import os

import numpy as np
import torch

from .blend import blending_index
from .checks import check_fills_a_sample, check_token_ids
from .index_cache import cache_key, load_or_build, prefix_identity
from .reader import IndexedDataset
from .samples import PackedSamples, build_indices

_VERSION = 1


class BlendedSamples:
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


def split_documents(num_documents: int, split, seed: int) -> np.ndarray:
    """Document ids of this part, ascending."""
    if split is None:
        return np.arange(num_documents)
    fraction, part = split
    n_eval = int(round(fraction * num_documents))
    if fraction > 0:
        n_eval = max(1, n_eval)
    order = np.random.default_rng([seed, 2]).permutation(num_documents)
    return np.sort(order[:n_eval] if part == "eval" else order[n_eval:])


def build_blended(blend, *, seq_length: int, num_samples: int, seed: int, builder: bool,
                  cache_dir=None, split=None, log=print, wait_timeout: float = 3600.0,
                  vocab_size=None) -> BlendedSamples:
    datasets = [IndexedDataset(prefix) for _, prefix in blend]
    if vocab_size is not None:
        for ds in datasets:
            check_token_ids(ds, vocab_size)
    weights = [w for w, _ in blend]
    parts_docs, parts_lengths = [], []
    for ds in datasets:
        docs = split_documents(ds.num_documents, split, seed)
        lengths = ds.document_lengths()[docs]
        check_fills_a_sample(ds, int(lengths.sum()), seq_length, f" ({split[1]} part)" if split else "")
        parts_docs.append(docs)
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
        parts.append(PackedSamples(ds, parts_docs[k], parts_lengths[k], indices, seq_length))
        sources.append({"prefix": ds.prefix, "weight": weights[k], "documents": len(parts_docs[k]),
                        "tokens": int(parts_lengths[k].sum()), "samples": len(indices["shuffle_index"]),
                        "epochs": built["meta"]["epochs"][k]})
    return BlendedSamples(parts, built["dataset_index"], built["dataset_sample_index"], seq_length, sources)
