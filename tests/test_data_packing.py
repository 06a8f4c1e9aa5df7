"""Loading, tokenization, EOS joining, packing and the token cache."""
import json
import os
import shutil

import numpy as np
import pytest

from mtds.data import build_packed_dataset, load_tokenizer, split_train_eval
from mtds.data.indexed import IndexedDataset
from mtds.data.packed import PackedDataset
from mtds.data.source import resolve_source

DOCS = ["To be, or not to be: that is the question.",
        "",  # empty documents are skipped: no doubled EOS
        "Now is the winter of our discontent\nMade glorious summer by this sun of York.",
        "Brevity is the soul of wit. <|endoftext|> stays text."]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


def expected_stream(tok, docs):
    out = []
    for doc in docs:
        if doc:
            out += tok(doc, add_special_tokens=False, split_special_tokens=True)["input_ids"]
            out.append(tok.eos_token_id)
    return np.array(out)


def write_jsonl(path, docs, column="text"):
    path.write_text("".join(json.dumps({column: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def test_eos_joins_documents_and_windows_tile_the_stream(tmp_path, tok):
    data = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    s = 8
    ds = build_packed_dataset(str(data), tok, s, cache_dir=tmp_path / "c", show_progress=False)
    want = expected_stream(tok, DOCS)
    assert np.array_equal(np.asarray(ds.tokens), want)
    # one EOS per non-empty document, each right after that document's last token
    assert ds.info["num_documents"] == 3
    assert np.count_nonzero(want == tok.eos_token_id) == 3 and want[-1] == tok.eos_token_id
    # window i = stream[i*s : i*s + s + 1]; neighbours share exactly one boundary token
    assert len(ds) == (len(want) - 1) // s
    for i in range(len(ds)):
        sample = ds[i].numpy()
        assert sample.shape == (s + 1,)
        assert np.array_equal(sample, want[i * s: i * s + s + 1])
        if i:
            assert ds[i - 1][-1] == ds[i][0]
    # labels cover every stream token after the first exactly once; only the ragged tail is dropped
    labels = np.concatenate([ds[i].numpy()[1:] for i in range(len(ds))])
    assert np.array_equal(labels, want[1:1 + len(labels)])
    assert len(want) - 1 - len(labels) < s


def test_text_files_are_one_document_each(tmp_path, tok):
    folder = tmp_path / "txt"
    folder.mkdir()
    (folder / "a.txt").write_text("First play.\n\nStill the first play.\n")
    (folder / "b.txt").write_text("Second play.\n")
    (folder / ".hidden.txt").write_text("ignored")
    ds = build_packed_dataset(str(folder), tok, 4, cache_dir=tmp_path / "c", show_progress=False)
    want = expected_stream(tok, ["First play.\n\nStill the first play.\n", "Second play.\n"])
    assert np.array_equal(np.asarray(ds.tokens), want)


@pytest.mark.parametrize("fmt", ["csv", "parquet", "disk"])
def test_other_formats_and_text_column(tmp_path, tok, fmt):
    import datasets
    table = datasets.Dataset.from_dict({"body": DOCS, "n": list(range(len(DOCS)))})
    if fmt == "csv":
        path = tmp_path / "d.csv"
        table.to_csv(str(path))
    elif fmt == "parquet":
        path = tmp_path / "d.parquet"
        table.to_parquet(str(path))
    else:
        path = tmp_path / "saved"
        datasets.DatasetDict({"train": table}).save_to_disk(str(path))
    ds = build_packed_dataset(str(path), tok, 8, text_column="body", cache_dir=tmp_path / "c",
                              show_progress=False)
    assert np.array_equal(np.asarray(ds.tokens), expected_stream(tok, DOCS))


def test_cache_is_reused_and_keyed_on_content(tmp_path, tok, monkeypatch):
    data = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    first = build_packed_dataset(str(data), tok, 8, cache_dir=tmp_path / "c", show_progress=False)
    assert first.info["from_cache"] is False

    # A second run, even with another seq_length, must not tokenize again.
    import mtds.data.packed as packed
    monkeypatch.setattr(packed, "tokenize_to_stream", lambda *a, **k: pytest.fail("re-tokenized"))
    again = build_packed_dataset(str(data), tok, 5, cache_dir=tmp_path / "c", show_progress=False)
    assert again.info["from_cache"] is True
    assert np.array_equal(np.asarray(again.tokens), np.asarray(first.tokens))
    monkeypatch.undo()

    # Changed data is a cache miss.
    write_jsonl(data, DOCS + ["A new document."])
    changed = build_packed_dataset(str(data), tok, 8, cache_dir=tmp_path / "c", show_progress=False)
    assert changed.info["from_cache"] is False


def test_default_cache_lives_next_to_the_data(tmp_path, tok, monkeypatch):
    monkeypatch.delenv("MTDS_DATA_CACHE", raising=False)
    data = write_jsonl(tmp_path / "docs.jsonl", DOCS)
    ds = build_packed_dataset(str(data), tok, 8, show_progress=False)
    # the cache is an indexed dataset (one reader for both data paths): one sequence per document
    (idx,) = (tmp_path / ".mtds_cache").glob("tokens-*.idx")
    cached = IndexedDataset(str(idx)[:-4])
    assert cached.num_documents == ds.info["num_documents"] == 3
    assert [int(cached[i][-1]) for i in range(3)] == [tok.eos_token_id] * 3
    assert np.array_equal(np.concatenate([cached[i] for i in range(3)]), expected_stream(tok, DOCS))


def test_cache_key_follows_content_not_path_or_mtime(tmp_path, tok):
    """Touching the data or reading it from another path (a copy, another mount point) reuses the
    cache; the same size with other content does not."""
    (tmp_path / "a").mkdir()
    data = write_jsonl(tmp_path / "a" / "docs.jsonl", DOCS)
    cache = tmp_path / "c"

    def build(path):
        return build_packed_dataset(str(path), tok, 8, cache_dir=cache, show_progress=False).info["from_cache"]

    assert build(data) is False
    os.utime(data, (1, 1))
    assert build(data) is True
    shutil.copytree(tmp_path / "a", tmp_path / "b")     # another path, new mtimes
    assert build(tmp_path / "b" / "docs.jsonl") is True
    assert resolve_source(str(tmp_path / "b")).identity == resolve_source(str(tmp_path / "a")).identity
    text = data.read_text()
    data.write_text(text.replace("To be", "Tu be"))      # same size, other content
    assert build(data) is False


def test_a_large_file_is_keyed_by_its_size_and_sampled_blocks(tmp_path, monkeypatch):
    from mtds.data import fingerprint
    monkeypatch.setattr(fingerprint, "WHOLE_FILE_BYTES", 1000)
    body = bytes(range(256)) * 64 * 1024                       # 16 MiB: sampled, not hashed whole
    (tmp_path / "a").write_bytes(body)
    (tmp_path / "b").write_bytes(body)
    digest = fingerprint.file_digest(str(tmp_path / "a"))
    assert fingerprint.file_digest(str(tmp_path / "b")) == digest
    middle = 5 * (len(body) - fingerprint.BLOCK) // (fingerprint.SAMPLED_BLOCKS - 1) + 100
    for at in (0, middle, len(body) - 1):                      # in the first, a middle and the last block
        (tmp_path / "b").write_bytes(body[:at] + b"x" + body[at + 1:])
        assert fingerprint.file_digest(str(tmp_path / "b")) != digest, at
    (tmp_path / "b").write_bytes(body + b"x")
    assert fingerprint.file_digest(str(tmp_path / "b")) != digest


def test_num_proc_gives_the_same_stream(tmp_path, tok):
    data = write_jsonl(tmp_path / "docs.jsonl", DOCS * 4)
    one = build_packed_dataset(str(data), tok, 8, cache_dir=tmp_path / "c1", show_progress=False)
    two = build_packed_dataset(str(data), tok, 8, num_proc=2, cache_dir=tmp_path / "c2",
                               show_progress=False)
    assert np.array_equal(np.asarray(one.tokens), np.asarray(two.tokens))


def test_shipped_corpus_builds(tmp_path, tok):
    ds = build_packed_dataset(None, tok, 256, cache_dir=tmp_path, show_progress=False)
    assert ds.info["num_documents"] == 18 and len(ds) > 2000
    assert int(ds[0].max()) < len(tok)


def test_split_train_eval_is_disjoint_and_seeded():
    ds = PackedDataset(np.arange(101), 10)  # 10 windows
    train, held = split_train_eval(ds, 0.2, seed=7)
    assert len(train) == 8 and len(held) == 2
    windows = lambda d: {int(d[i][0]) for i in range(len(d))}  # noqa: E731
    assert windows(train).isdisjoint(windows(held))
    assert windows(train) | windows(held) == windows(ds)
    again_train, _ = split_train_eval(ds, 0.2, seed=7)
    assert np.array_equal(again_train.indices, train.indices)
    assert split_train_eval(ds, 0.0, seed=7) == (ds, None)


def test_build_train_eval_prefers_a_separate_eval_spec(tmp_path, tok):
    from mtds.data import build_train_eval
    train_file = write_jsonl(tmp_path / "train.jsonl", DOCS * 3)
    eval_file = write_jsonl(tmp_path / "eval.jsonl", DOCS[:1])

    def build(spec):
        return build_packed_dataset(str(spec), tok, 4, cache_dir=tmp_path / "c", show_progress=False)

    train, held = build_train_eval(build, train_file, eval_file, 0.02, seed=1)
    assert held.info["source"] == str(eval_file) and train.indices is None
    train, held = build_train_eval(build, train_file, None, 0.25, seed=1)
    assert len(held) == round(0.25 * (len(train) + len(held)))
