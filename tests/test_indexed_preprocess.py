"""mtds-preprocess: every input format gives the same tokens, workers and shards change nothing
but speed, the output is what megatron-core reads, and bad input is one `error:` line, exit 2."""
import csv
import gzip
import json
import os

import numpy as np
import pytest

from mtds.cli.preprocess import main
from mtds.data import SHIPPED_CORPUS, build_packed_dataset, load_tokenizer
from mtds.data.indexed import IndexedDataset
from mtds.data.indexed import preprocess as pp
from mtds.data.indexed.writer import IndexedWriter


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def texts():
    lines = open(os.path.join(SHIPPED_CORPUS, "sonnets.txt"), encoding="utf-8").read().splitlines()
    docs = ["\n".join(lines[i:i + 14]) for i in range(0, 14 * 30, 14)]
    docs[4] = ""   # empty documents are skipped
    docs[7] = "a literal <|endoftext|> stays text"
    return docs


@pytest.fixture
def jsonl(tmp_path, texts):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t, "title": f"doc {i}"}) + "\n" for i, t in enumerate(texts)))
    return path


def expected(tok, texts, eod=True):
    return [tok(t, add_special_tokens=False, split_special_tokens=True)["input_ids"] + [tok.eos_token_id] * eod
            for t in texts if t]


def read(prefix):
    ds = IndexedDataset(prefix)
    return [list(map(int, ds[i])) for i in range(len(ds))]


def run(input_path, prefix, **kw):
    kw.setdefault("show_progress", False)
    return pp.preprocess(str(input_path), str(prefix), log=lambda _: None, **kw)


def test_jsonl_two_keys(tmp_path, jsonl, tok, texts):
    out = run(jsonl, tmp_path / "o", json_keys=["text", "title"], append_eod=True)
    assert read(tmp_path / "o_text_document") == expected(tok, texts)
    assert read(tmp_path / "o_title_document") == expected(tok, [f"doc {i}" for i in range(len(texts))])
    assert out["text"]["documents"] == len(texts) - 1
    assert IndexedDataset(tmp_path / "o_text_document").dtype == np.uint16   # 8192-token vocabulary


def test_formats_agree(tmp_path, jsonl, tok, texts):
    """csv, parquet, a save_to_disk folder and gzipped json lines give the jsonl's tokens."""
    import datasets
    rows = [{"text": t} for t in texts]
    with open(tmp_path / "d.csv", "w", newline="") as f:
        w = csv.DictWriter(f, ["text"])
        w.writeheader()
        w.writerows(rows)
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "d.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    with gzip.open(tmp_path / "d.jsonl.gz", "wt") as f:
        f.write(jsonl.read_text())
    want = expected(tok, texts, eod=False)
    for name in ("d.csv", "d.parquet", "saved", "d.jsonl.gz"):
        run(tmp_path / name, tmp_path / name.replace(".", "_"))
        assert read(tmp_path / f"{name.replace('.', '_')}_text_document") == want, name


def test_same_tokens_as_training_path(tmp_path, tok):
    """A .txt file is one document, tokenized exactly as train.py --data tokenizes it."""
    sonnets = os.path.join(SHIPPED_CORPUS, "sonnets.txt")
    run(sonnets, tmp_path / "s", append_eod=True)
    packed = build_packed_dataset(sonnets, tok, 64, cache_dir=tmp_path / "c", show_progress=False)
    assert np.array_equal(IndexedDataset(tmp_path / "s_text_document")[0], packed.tokens)


def test_workers_and_shards_change_nothing(tmp_path, jsonl, monkeypatch, tok, texts):
    """2 workers write the bytes 1 worker writes, with a bounded number of chunks in flight;
    shards 0/2 + 1/2, merged, hold every document once (shard 0's every other one first)."""
    monkeypatch.setattr(pp, "CHUNK_DOCS", 3)
    run(jsonl, tmp_path / "one")
    pulled, written = [0], [0]
    chunks, add = pp._chunks, IndexedWriter.add_documents

    def counting_chunks(docs, shard):
        for chunk in chunks(docs, shard):
            pulled[0] += 1
            assert pulled[0] - written[0] <= 2 * 2 + 1   # never reads ahead of the writer
            yield chunk

    def counting_add(self, flat, lengths):
        written[0] += 1
        add(self, flat, lengths)
    monkeypatch.setattr(pp, "_chunks", counting_chunks)
    monkeypatch.setattr(IndexedWriter, "add_documents", counting_add)
    run(jsonl, tmp_path / "two", workers=2)
    for ext in (".bin", ".idx"):
        assert ((tmp_path / f"one_text_document{ext}").read_bytes()
                == (tmp_path / f"two_text_document{ext}").read_bytes())
    monkeypatch.setattr(pp, "_chunks", chunks)
    for i in range(2):
        run(jsonl, tmp_path / "sh", shard=(i, 2))
    assert main(["--merge", "--output-prefix", str(tmp_path / "sh"), "--no-progress"]) is None
    assert read(tmp_path / "sh_text_document") == (expected(tok, texts[0::2], eod=False)
                                                   + expected(tok, texts[1::2], eod=False))


def test_interrupted_run_leaves_nothing(tmp_path, jsonl, monkeypatch):
    def interrupt(self, flat, lengths):
        raise KeyboardInterrupt
    monkeypatch.setattr(IndexedWriter, "add_documents", interrupt)
    with pytest.raises(KeyboardInterrupt):
        run(jsonl, tmp_path / "cut")
    assert sorted(os.listdir(tmp_path)) == ["docs.jsonl"]


def cli_error(capsys, argv):
    with pytest.raises(SystemExit) as e:
        main(argv + ["--no-progress"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    return err


def test_bad_input(tmp_path, jsonl, capsys):
    out = str(tmp_path / "o")
    assert "does not exist" in cli_error(capsys, ["--input", str(tmp_path / "nope.jsonl"), "--output-prefix", out])
    assert "no key 'body'" in cli_error(capsys, ["--input", str(jsonl), "--output-prefix", out, "--json-keys", "body"])
    assert "--shard takes i/N" in cli_error(capsys, ["--input", str(jsonl), "--output-prefix", out, "--shard", "2/2"])
    assert "--workers must be >= 1" in cli_error(capsys, ["--input", str(jsonl), "--output-prefix", out,
                                                          "--workers", "0"])
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n[1, 2]\n')
    assert "bad.jsonl:2" in cli_error(capsys, ["--input", str(tmp_path / "bad.jsonl"), "--output-prefix", out])
    (tmp_path / "empty.jsonl").write_text('{"text": ""}\n')
    assert "holds no text" in cli_error(capsys, ["--input", str(tmp_path / "empty.jsonl"), "--output-prefix", out])
    assert not list(tmp_path.glob("o_*"))   # nothing written half-way
    main(["--input", str(jsonl), "--output-prefix", out, "--no-progress"])
    assert "already exists; pass --overwrite" in cli_error(capsys, ["--input", str(jsonl), "--output-prefix", out])
    main(["--input", str(jsonl), "--output-prefix", out, "--no-progress", "--overwrite", "--append-eod"])
    assert IndexedDataset(out + "_text_document").num_tokens > 0
    assert "no shards of" in cli_error(capsys, ["--merge", "--output-prefix", out])
    assert "unrecognized arguments" in cli_error(capsys, ["--output-prefix", out, "--split-sentences"])


def test_backend_and_hf_encoders_agree(tok, texts):
    """Workers encode with the Rust backend alone; a slow tokenizer goes through transformers: same ids."""
    chunk = [{"text": t} for t in texts]
    fast = pp._Encoder(pp.encoder_spec(tok, None), ["text"], True)(chunk)["text"]
    slow = pp._Encoder(("name", None, tok.eos_token_id), ["text"], True)(chunk)["text"]
    assert np.array_equal(fast[0], slow[0]) and np.array_equal(fast[1], slow[1])
    assert list(np.split(fast[0], np.cumsum(fast[1])[:-1])[6]) == expected(tok, texts)[6]


def test_hf_dataset_in_streaming_mode(tmp_path, jsonl, tok, texts, capsys, monkeypatch):
    """--hf-dataset reads a dataset record by record with datasets' streaming mode: the same tokens as the
    files themselves, and nothing converted to Arrow in the datasets cache (a non-streaming load would
    write the whole dataset there first)."""
    folder = tmp_path / "hf"
    folder.mkdir()
    lines = jsonl.read_text().splitlines(keepends=True)
    (folder / "part-0.jsonl").write_text("".join(lines[:12]))
    (folder / "part-1.jsonl").write_text("".join(lines[12:]))
    cache = tmp_path / "datasets_cache"
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    import datasets.config
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    main(["--hf-dataset", str(folder), "--output-prefix", str(tmp_path / "s"), "--no-progress", "--append-eod"])
    assert read(tmp_path / "s_text_document") == expected(tok, texts)
    assert not list(cache.rglob("*.arrow")), "the dataset was converted whole instead of streamed"
    out = str(tmp_path / "o")
    assert "cannot stream HF dataset" in cli_error(capsys, ["--hf-dataset", str(tmp_path / "nope"), "--output-prefix", out])
    assert "Bad split" in cli_error(capsys, ["--hf-dataset", str(folder), "--split", "validation", "--output-prefix", out])
    assert "no column 'body'" in cli_error(capsys, ["--hf-dataset", str(folder), "--json-keys", "body",
                                                    "--output-prefix", out])
    assert "not allowed with argument" in cli_error(capsys, ["--hf-dataset", str(folder), "--input", str(jsonl),
                                                             "--output-prefix", out])
    assert not list(tmp_path.glob("o_*"))
