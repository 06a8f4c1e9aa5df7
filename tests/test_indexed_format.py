"""Megatron's indexed format, checked against megatron-core itself (the oracle):
files mtds writes are read by megatron-core's IndexedDataset with the same tokens,
and files its IndexedDatasetBuilder writes are read by mtds."""
import os
import warnings

import numpy as np
import pytest
import torch

from mtds.data import DataError
from mtds.data.indexed import IndexedDataset, IndexedWriter, dtype_for_vocab, merge_indexed

with warnings.catch_warnings():   # "Transformer Engine and Apex are not installed"
    warnings.simplefilter("ignore")
    from megatron.core.datasets import indexed_dataset as mc


def documents(seed, n=40, vocab=8192):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=int(rng.integers(1, 50))) for _ in range(n)]


@pytest.mark.parametrize("vocab", [8192, 65536, 70000])
def test_megatron_reads_ours(tmp_path, vocab):
    docs = documents(vocab, vocab=vocab)
    docs[3] = np.array([vocab - 1, 0, vocab - 1])   # the largest id must survive the dtype
    prefix = str(tmp_path / "ours")
    with IndexedWriter(prefix, dtype_for_vocab(vocab)) as w:
        for doc in docs[:10]:
            w.add_document(doc)
        w.add_documents(np.concatenate(docs[10:]), [len(d) for d in docs[10:]])
    theirs = mc.IndexedDataset(prefix)
    assert theirs.index.dtype == (np.uint16 if vocab <= 65536 else np.int32)
    assert len(theirs) == len(docs)
    assert list(theirs.document_indices) == list(range(len(docs) + 1))
    for i, doc in enumerate(docs):
        assert np.array_equal(theirs[i], doc)
    assert np.array_equal(theirs.get(5, offset=1, length=2), docs[5][1:3])


def test_we_read_megatrons(tmp_path):
    docs = documents(1)
    prefix = str(tmp_path / "theirs")
    builder = mc.IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for doc in docs[:20]:   # one sequence per document, as preprocess_data.py writes them
        builder.add_item(torch.from_numpy(doc))
        builder.end_document()
    for a, b in zip(docs[20::2], docs[21::2]):   # two sequences per document (--split-sentences)
        builder.add_document(np.concatenate([a, b]), [len(a), len(b)])
    builder.finalize(prefix + ".idx")
    ours = IndexedDataset(prefix)
    assert ours.dtype == np.int32 and len(ours) == len(docs) and ours.num_documents == 30
    assert ours.num_tokens == sum(map(len, docs))
    for i, doc in enumerate(docs):
        assert np.array_equal(ours[i], doc)
    assert np.array_equal(ours.get(7, 2, 3), docs[7][2:5])
    assert list(ours.document_lengths()[19:21]) == [len(docs[19]), len(docs[20]) + len(docs[21])]


def test_merge_matches_megatron_add_index(tmp_path):
    """Our merge of two shards is byte-identical to megatron-core's add_index of the same shards."""
    docs = documents(2)
    shards = []
    for k, part in enumerate((docs[:15], docs[15:])):
        shards.append(str(tmp_path / f"shard{k}"))
        with IndexedWriter(shards[-1], np.uint16) as w:
            for doc in part:
                w.add_document(doc)
    merged = merge_indexed(shards, str(tmp_path / "merged"))
    builder = mc.IndexedDatasetBuilder(str(tmp_path / "mc.bin"), dtype=np.uint16)
    for shard in shards:
        builder.add_index(shard)
    builder.finalize(str(tmp_path / "mc.idx"))
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"merged{ext}").read_bytes() == (tmp_path / f"mc{ext}").read_bytes()
    assert [list(merged[i]) for i in range(len(docs))] == [list(d) for d in docs]


def test_interrupted_write_leaves_no_index(tmp_path):
    prefix = str(tmp_path / "cut")
    with pytest.raises(KeyboardInterrupt):
        with IndexedWriter(prefix, np.uint16) as w:
            w.add_document([1, 2, 3])
            raise KeyboardInterrupt
    assert os.listdir(tmp_path) == []


def test_id_too_large_for_dtype(tmp_path):
    with pytest.raises(DataError, match="does not fit the uint16"):
        with IndexedWriter(str(tmp_path / "x"), np.uint16) as w:
            w.add_document([1, 65536])
    assert not (tmp_path / "x.idx").exists()


def test_bad_files(tmp_path):
    prefix = str(tmp_path / "d")
    with pytest.raises(DataError, match="does not exist"):
        IndexedDataset(prefix)
    with IndexedWriter(prefix, np.uint16) as w:
        w.add_document(np.arange(100))
    good = (tmp_path / "d.idx").read_bytes()
    (tmp_path / "d.idx").write_bytes(b"NOTMEGA\x00\x00" + good[9:])
    with pytest.raises(DataError, match="not a Megatron index"):
        IndexedDataset(prefix)
    (tmp_path / "d.idx").write_bytes(good[:9] + (2).to_bytes(8, "little") + good[17:])
    with pytest.raises(DataError, match="version 2"):
        IndexedDataset(prefix)
    (tmp_path / "d.idx").write_bytes(good[:-4])
    with pytest.raises(DataError, match="truncated"):
        IndexedDataset(prefix)
    (tmp_path / "d.idx").write_bytes(good)
    (tmp_path / "d.bin").write_bytes((tmp_path / "d.bin").read_bytes()[:150])
    with pytest.raises(DataError, match="shorter than its index says"):
        IndexedDataset(prefix)
