"""Training samples from indexed datasets: Megatron's document/sample/shuffle indices, the blend,
the on-disk cache built by one process while the others wait on the file, and --eod-mask-loss."""
import os
import shutil
import threading
import time

import numpy as np
import pytest
import torch

from mtds.data import DataError, MicroBatchStream
from mtds.data.indexed import IndexedWriter
from mtds.data.indexed.blend_spec import blending_index, parse_blend
from mtds.data.indexed.blended_dataset import build_blended
from mtds.data.indexed.checks import check_token_ids
from mtds.data.indexed.index_cache import load_or_build
from mtds.data.indexed.reader import IndexedDataset
from mtds.data.indexed.samples import PackedSamples, build_indices, permuted


def write(prefix, docs, dtype=np.uint16):
    with IndexedWriter(str(prefix), dtype) as w:
        for d in docs:
            w.add_document(d)
    return str(prefix)


def docs_in(lo, n_docs, seed):
    """Documents of ids lo, lo+1, ... in order, so any window of a sample says where it came from."""
    rng = np.random.default_rng(seed)
    out, nxt = [], lo
    for _ in range(n_docs):
        k = int(rng.integers(1, 40))
        out.append(np.arange(nxt, nxt + k))
        nxt += k
    return out


def test_parse_blend():
    assert parse_blend(["a"]) == [(1.0, "a")]
    assert parse_blend(["3", "a", "1", "b"]) == [(0.75, "a"), (0.25, "b")]
    for args, msg in ((["0.3", "a", "0.7"], "weight prefix pairs"), (["-1", "a", "2", "b"], "positive"),
                      (["a", "0.3", "b", "0.7"], "not a weight"), ([], "needs a dataset prefix")):
        with pytest.raises(DataError, match=msg):
            parse_blend(args)


def test_blending_index_shares_and_prefix():
    w = np.array([0.2, 0.5, 0.3])
    which, sample = blending_index(w, 10_000)
    counts = np.stack([np.cumsum(which == k) for k in range(3)], axis=1)
    ideal = np.arange(1, 10_001)[:, None] * w
    assert np.abs(counts - ideal).max() <= 1.0          # every prefix, so 10,000 samples within 0.01%
    for k in range(3):   # each dataset's samples in order 0, 1, 2, ...
        assert np.array_equal(sample[which == k], np.arange(counts[-1, k]))
    w2, s2 = blending_index(w, 4_000)
    assert np.array_equal(w2, which[:4000]) and np.array_equal(s2, sample[:4000])


def test_indices_match_the_epoch_stream(tmp_path):
    lengths = np.array([5, 1, 0, 17, 3, 9, 2])
    s, seed = 4, 7
    idx = build_indices(lengths, s, num_samples=30, seed=seed)
    order = idx["doc_index"]
    assert idx["epochs"] == 4   # the fewest whose windows (one per 4 tokens started) number 30
    assert 4 * 7 < len(order) < 5 * 7   # and as much of a 5th as the last window reaches into
    for e in range(idx["epochs"]):   # each epoch is every document once
        assert sorted(order[e * 7:(e + 1) * 7]) == list(range(7))
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    stream = np.concatenate([np.arange(starts[d], starts[d] + lengths[d]) for d in order])
    ends = np.cumsum(lengths[order])
    shuffle = idx["shuffle_index"]
    assert len(shuffle) == 30 and len(set(shuffle)) == 30 and shuffle.max() <= (len(stream) - 1) // s - 1
    for j, (pos, off) in zip(shuffle, idx["sample_index"]):
        assert ends[pos] - lengths[order[pos]] + off == j * s and off < lengths[order[pos]]
    starts_of = np.concatenate([[0], np.cumsum(lengths)])
    ds = IndexedDataset(write(tmp_path / "d", [np.arange(starts_of[i], starts_of[i + 1]) for i in range(7)]))
    samples = PackedSamples(ds, starts_of[:-1], lengths, idx, s)
    for i in range(len(samples)):   # sample i is the stream's window at its shuffled position
        j = shuffle[i]
        assert np.array_equal(samples[i], stream[j * s:j * s + s + 1])
    epoch_of = shuffle * s // lengths.sum()
    assert np.all(np.diff(epoch_of) >= 0)   # samples only move within their epoch ...
    for e in range(3):   # ... and every full epoch gives all its windows
        assert sorted(shuffle[epoch_of == e]) == list(range(-(-e * 37 // s), -(-(e + 1) * 37 // s)))
    assert not np.array_equal(shuffle[:10], np.arange(10))   # epoch 0 is shuffled
    exact = build_indices(lengths, s, num_samples=38, seed=seed)   # 4 epochs start 37 windows: one more
    assert exact["epochs"] == 5 and len(exact["sample_index"]) == 38
    assert build_indices(lengths, s, num_samples=37, seed=seed)["epochs"] == 4   # exactly 4 epochs' windows
    longer = build_indices(lengths, s, num_samples=60, seed=seed)   # a longer run begins the same way
    for name in ("shuffle_index", "sample_index"):
        assert np.array_equal(longer[name][:30], idx[name])


def test_blend_samples_shares_cache_and_split(tmp_path):
    a = write(tmp_path / "a", docs_in(0, 60, 1))
    b = write(tmp_path / "b", docs_in(30_000, 25, 2))
    blend = parse_blend(["0.3", a, "0.7", b])
    kw = dict(seq_length=8, seed=3, builder=True, cache_dir=str(tmp_path / "cache"), log=lambda _: None)
    ds = build_blended(blend, num_samples=2000, **kw)
    assert len(ds) == 2000 and [s["weight"] for s in ds.sources] == [0.3, 0.7]
    src_b = 0
    for n in range(len(ds)):
        x = ds[n].numpy()
        assert x.shape == (9,)
        from_b = x[0] >= 30_000
        assert (x >= 30_000).all() == from_b and from_b == (ds.dataset_index[n] == 1)
        src_b += from_b
    assert abs(src_b / 2000 - 0.7) < 0.01
    assert ds.sources[1]["epochs"] > ds.sources[0]["epochs"]   # b is smaller and weighted more
    built = os.listdir(tmp_path / "cache")
    again = build_blended(blend, num_samples=2000, **kw)   # cache hit: nothing new
    assert os.listdir(tmp_path / "cache") == built and np.array_equal(again.dataset_index, ds.dataset_index)
    for ext in (".bin", ".idx"):   # another path, same content: same key
        shutil.copy(a + ext, str(tmp_path / "moved") + ext)
    build_blended([(0.3, str(tmp_path / "moved")), (0.7, b)], num_samples=2000, **kw)
    assert os.listdir(tmp_path / "cache") == built
    build_blended(blend, num_samples=2000, **dict(kw, seed=4))
    assert len(os.listdir(tmp_path / "cache")) == 2
    train = build_blended([(1.0, a)], num_samples=500, split=(0.2, "train"), **kw)
    held = build_blended([(1.0, a)], num_samples=50, split=(0.2, "eval"), **kw)
    whole = IndexedDataset(a).num_tokens
    assert train.sources[0]["tokens"] + held.sources[0]["tokens"] == whole
    assert held.sources[0]["tokens"] == round(0.2 * whole)
    assert train.sources[0]["documents"] + held.sources[0]["documents"] == 61   # one document cut in two
    seen = [{int(t) for n in range(len(d)) for t in d[n]} for d in (train, held)]
    assert not seen[0] & seen[1]   # no token in both
    one = write(tmp_path / "one", [np.arange(1000)])   # a single document still gives both parts
    held = build_blended([(1.0, one)], num_samples=40, split=(0.1, "eval"), **kw)
    assert {int(t) for n in range(len(held)) for t in held[n]} == set(range(900, 1000))


def test_waiters_wait_on_the_file(tmp_path):
    directory = str(tmp_path / "idx")
    got = {}

    def waiter():
        got["w"] = load_or_build(directory, None, builder=False, poll=0.01, timeout=30)

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.2)
    assert t.is_alive()   # nothing built yet: it waits
    load_or_build(directory, lambda: ({"x": np.arange(5)}, {"n": 5}), builder=True)
    t.join(10)
    assert list(got["w"]["x"]) == list(range(5)) and got["w"]["meta"]["n"] == 5

    def broken():
        raise DataError("boom")
    with pytest.raises(DataError, match="boom"):
        load_or_build(str(tmp_path / "bad"), broken, builder=True)
    with pytest.raises(DataError, match="failed on the building rank: boom"):
        load_or_build(str(tmp_path / "bad"), None, builder=False, poll=0.01, timeout=5)
    (tmp_path / "dead.building").write_text('{"host": "%s", "pid": 999999999}' % os.uname().nodename)
    with pytest.raises(DataError, match="died before finishing"):
        load_or_build(str(tmp_path / "dead"), None, builder=False, poll=0.01, timeout=5)
    with pytest.raises(DataError, match=r"waited 0 s for .*never"):
        load_or_build(str(tmp_path / "never"), None, builder=False, poll=0.01, timeout=0.05)


def test_token_ids_checked(tmp_path):
    ok = IndexedDataset(write(tmp_path / "ok", [np.arange(100)], np.int32))
    check_token_ids(ok, 100)
    big = IndexedDataset(write(tmp_path / "big", [np.zeros(50_000), [100], np.zeros(50_000)], np.int32))
    with pytest.raises(DataError, match="token id 100, outside the model's vocabulary of 100"):
        check_token_ids(big, 100)
    check_token_ids(IndexedDataset(write(tmp_path / "small", [np.arange(60_000)])), 65_536)   # dtype settles it


def test_eod_mask_loss():
    eod = 0
    data = [torch.tensor([5, 6, eod, 7, 8]), torch.tensor([eod, 9, 9, eod, 1])]

    class Two:
        seq_length = 4

        def __len__(self):
            return 2

        def __getitem__(self, i):
            return data[i]

    inputs, labels = next(MicroBatchStream(Two(), global_batch_size=2, micro_batch_size=2, shuffle=False,
                                           eod_mask_id=eod))
    assert labels.tolist() == [[6, eod, -100, 8], [-100, 9, eod, -100]]
    assert inputs.tolist() == [[5, 6, eod, 7], [eod, 9, 9, eod]]


def test_resume_continues_the_blend(tmp_path):
    a = write(tmp_path / "a", docs_in(0, 40, 5))
    b = write(tmp_path / "b", docs_in(20_000, 9, 6))
    kw = dict(seq_length=8, seed=1, builder=True, cache_dir=str(tmp_path / "c"), log=lambda _: None)
    ds = build_blended([(1.0, a)], num_samples=64, **kw)

    def stream():
        return MicroBatchStream(ds, global_batch_size=8, micro_batch_size=4, shuffle=False)
    first = stream()
    for _ in range(5):   # two steps and a half: the state counts completed global batches
        next(first)
    resumed = stream()
    resumed.load_state_dict(first.state_dict())
    reference = stream()
    for _ in range(4):
        next(reference)
    for _ in range(3):
        assert torch.equal(next(resumed)[0], next(reference)[0])
    longer = build_blended([(0.6, a), (0.4, b)], num_samples=96, **kw)   # more --steps on resume
    shorter = build_blended([(0.6, a), (0.4, b)], num_samples=64, **kw)
    assert all(torch.equal(longer[n], shorter[n]) for n in range(64))
    grown = MicroBatchStream(longer, global_batch_size=8, micro_batch_size=4, shuffle=False)
    grown.load_state_dict(MicroBatchStream(shorter, global_batch_size=8, micro_batch_size=4,
                                           shuffle=False).state_dict())


def test_permuted_is_a_prefix_stable_permutation():
    for n in (1, 2, 3, 37, 1000, 65_537):
        assert sorted(permuted(np.arange(n), n, (1, n))) == list(range(n))
    full = permuted(np.arange(5000), 5000, (7,))
    assert np.array_equal(permuted(np.arange(40), 5000, (7,)), full[:40])   # no need to build the rest
    assert abs(np.mean(np.abs(np.diff(full))) - 5000 / 3) < 100   # |step| of a random permutation: n/3
    assert not np.array_equal(full, permuted(np.arange(5000), 5000, (8,)))
