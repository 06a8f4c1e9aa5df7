"""The shipped tokenizer, refusal of broken ones, and fast offline failures."""
import os
import time

import pytest

from mtds.data import SHIPPED_TOKENIZER, DataError, build_packed_dataset, load_tokenizer
from mtds.data.tokenizer import validate_tokenizer


def test_shipped_tokenizer_reloads_offline_with_autotokenizer(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(SHIPPED_TOKENIZER)
    assert len(tok) == 8192
    assert tok.eos_token == tok.bos_token == tok.unk_token == "<|endoftext|>"
    text = "Is this a dagger which I see before me?"
    assert tok.decode(tok(text)["input_ids"]) == text  # byte-level: lossless


def test_empty_tokenizer_is_refused(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(BPE())).save_pretrained(tmp_path)
    with pytest.raises(DataError) as e:
        load_tokenizer(str(tmp_path))
    assert "empty" in str(e.value)


def test_tokenizer_without_eos_is_refused():
    tok = load_tokenizer(None)
    tok.eos_token = None
    with pytest.raises(DataError) as e:
        validate_tokenizer(tok, "x")
    assert "no EOS" in str(e.value)


@pytest.fixture
def no_hub(monkeypatch):
    """A closed local port as the hub: unreachable without touching the network."""
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")


def test_unreachable_hub_tokenizer_fails_fast(no_hub):
    from transformers import AutoTokenizer  # noqa: F401  -- before the clock: it bounds the hub check, not an import
    start = time.monotonic()
    with pytest.raises(DataError) as e:
        load_tokenizer("surely-not-cached/tokenizer-xyz")
    assert "could not be reached" in str(e.value)
    assert time.monotonic() - start < 10


def test_unreachable_hub_dataset_fails_fast(no_hub, tmp_path):
    tok = load_tokenizer(None)
    import datasets  # noqa: F401  -- before the clock: it bounds the hub check, not a cold import
    start = time.monotonic()
    with pytest.raises(DataError) as e:
        build_packed_dataset("someone/some-dataset:cfg@train", tok, 8, cache_dir=tmp_path,
                             show_progress=False)
    assert "pass a local file or directory" in str(e.value)
    assert time.monotonic() - start < 10


def _gpt2_files(folder, merges: int | None = None):
    """The shipped tokenizer (a byte-level BPE) as GPT-2's vocab.json + merges.txt (its first
    ``merges`` merges only: another tokenizer)."""
    import json
    spec = json.load(open(os.path.join(SHIPPED_TOKENIZER, "tokenizer.json")))
    folder.mkdir()
    (folder / "vocab.json").write_text(json.dumps(spec["model"]["vocab"]))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in spec["model"]["merges"][:merges]))
    return str(folder / "vocab.json"), str(folder / "merges.txt")


def test_megatron_gpt2_bpe_flags(tmp_path, monkeypatch):
    """--tokenizer-type GPT2BPETokenizer --vocab-file --merge-file: the same ids as the tokenizer those
    files come from, in train.py's config and in mtds-preprocess; saved once per content."""
    import numpy as np

    from mtds.cli.preprocess import main as preprocess_main
    from mtds.data.indexed import IndexedDataset
    from mtds.data.megatron_tokenizer import tokenizer_from_flags
    from mtds.training.cli import build_parser, config_from_args
    monkeypatch.setenv("MTDS_DATA_CACHE", str(tmp_path / "cache"))
    vocab, merges = _gpt2_files(tmp_path / "gpt2")
    flags = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges]
    cfg = config_from_args(build_parser().parse_args(["--deepspeed_config", "x.json", *flags]))
    text = "To be, or not to be: that is the question.\n  Whether 'tis nobler <|endoftext|> ünïcödé"
    shipped, ours = load_tokenizer(None), load_tokenizer(cfg.tokenizer)
    encode = dict(add_special_tokens=False, split_special_tokens=True)
    assert ours(text, **encode)["input_ids"] == shipped(text, **encode)["input_ids"]
    assert ours.eos_token_id == shipped.eos_token_id == 0 and len(ours) == len(shipped)
    copy = tmp_path / "elsewhere"
    copy.mkdir()
    for f in (vocab, merges):
        (copy / os.path.basename(f)).write_bytes(open(f, "rb").read())
    assert tokenizer_from_flags(None, "GPT2BPETokenizer", str(copy / "vocab.json"), str(copy / "merges.txt")) \
        == cfg.tokenizer
    # mtds-preprocess, with files of another tokenizer (half the merges): its ids, not the shipped ones
    vocab, merges = _gpt2_files(tmp_path / "half", merges=2000)
    half = load_tokenizer(tokenizer_from_flags(None, "GPT2BPETokenizer", vocab, merges))
    docs = tmp_path / "docs.jsonl"
    texts = ("Now is the winter of our discontent", "Made glorious summer")
    docs.write_text("".join(f'{{"text": "{t}"}}\n' for t in texts))
    preprocess_main(["--input", str(docs), "--output-prefix", str(tmp_path / "m"), "--append-eod", "--no-progress",
                     "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges])
    written = IndexedDataset(str(tmp_path / "m_text_document"))
    want = [i for t in texts for i in half(t, **encode)["input_ids"] + [0]]
    assert written.num_documents == 2 and np.array_equal(written.ids, want)
    assert len(want) > len([i for t in texts for i in shipped(t, **encode)["input_ids"] + [0]])
