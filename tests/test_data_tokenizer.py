"""The shipped tokenizer, refusal of broken ones, and fast offline failures."""
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
    start = time.monotonic()
    with pytest.raises(DataError) as e:
        load_tokenizer("surely-not-cached/tokenizer-xyz")
    assert "could not be reached" in str(e.value)
    assert time.monotonic() - start < 10


def test_unreachable_hub_dataset_fails_fast(no_hub, tmp_path):
    tok = load_tokenizer(None)
    start = time.monotonic()
    with pytest.raises(DataError) as e:
        build_packed_dataset("someone/some-dataset:cfg@train", tok, 8, cache_dir=tmp_path,
                             show_progress=False)
    assert "pass a local file or directory" in str(e.value)
    assert time.monotonic() - start < 10
