"""Every bad input is a one-line DataError that says what to do."""
import json

import numpy as np
import pytest

from mtds.data import (DataError, MicroBatchStream, build_packed_dataset, check_seq_length,
                       check_vocab, load_tokenizer)
from mtds.data.packed import PackedDataset


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


def build(spec, tok, tmp_path, **kw):
    return build_packed_dataset(str(spec), tok, kw.pop("seq_length", 8), cache_dir=tmp_path / "c",
                                show_progress=False, **kw)


def one_line(excinfo):
    msg = str(excinfo.value)
    assert "\n" not in msg and isinstance(excinfo.value, ValueError)
    return msg


def test_missing_path(tmp_path, tok):
    with pytest.raises(DataError) as e:
        build(tmp_path / "nope.jsonl", tok, tmp_path)
    assert "does not exist" in one_line(e)


def test_empty_dataset(tmp_path, tok):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(DataError) as e:
        build(tmp_path / "empty.jsonl", tok, tmp_path)
    assert "empty" in one_line(e)


def test_dataset_of_blank_documents(tmp_path, tok):
    (tmp_path / "blank.jsonl").write_text('{"text": ""}\n{"text": ""}\n')
    with pytest.raises(DataError) as e:
        build(tmp_path / "blank.jsonl", tok, tmp_path)
    assert "empty" in one_line(e)


def test_directory_without_data_files(tmp_path, tok):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "notes.bin").write_bytes(b"\0")
    with pytest.raises(DataError) as e:
        build(tmp_path / "d", tok, tmp_path)
    assert "no .txt" in one_line(e)


def test_missing_text_column_names_the_available_ones(tmp_path, tok):
    (tmp_path / "d.jsonl").write_text(json.dumps({"body": "hello", "id": 1}) + "\n")
    with pytest.raises(DataError) as e:
        build(tmp_path / "d.jsonl", tok, tmp_path)
    msg = one_line(e)
    assert "'text'" in msg and "body, id" in msg


def test_too_short_for_one_sample(tmp_path, tok):
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "tiny"}) + "\n")
    with pytest.raises(DataError) as e:
        build(tmp_path / "d.jsonl", tok, tmp_path, seq_length=64)
    assert "seq_length + 1 = 65" in one_line(e)


def test_too_small_for_one_global_batch():
    ds = PackedDataset(np.arange(41), 4)  # 10 samples
    with pytest.raises(DataError) as e:
        MicroBatchStream(ds, global_batch_size=16, micro_batch_size=2)
    msg = one_line(e)
    assert "10 samples" in msg and "16" in msg


def test_batch_sizes_must_divide():
    ds = PackedDataset(np.arange(41), 4)
    with pytest.raises(DataError):
        MicroBatchStream(ds, global_batch_size=6, micro_batch_size=2, dp_size=2)


def test_seq_length_above_max_positions():
    check_seq_length(1024, 1024)
    with pytest.raises(DataError) as e:
        check_seq_length(2048, 1024)
    assert "max_position_embeddings 1024" in one_line(e)


def test_model_vocab_must_cover_tokenizer(tok):
    check_vocab(tok, 8192)
    with pytest.raises(DataError) as e:
        check_vocab(tok, 4096)
    assert "at least 8192" in one_line(e)


def test_resume_with_other_data_is_refused():
    ds = PackedDataset(np.arange(41), 4)
    st = MicroBatchStream(ds, global_batch_size=4, micro_batch_size=2, seed=1)
    state = dict(st.state_dict(), num_samples=99)
    with pytest.raises(DataError):
        st.load_state_dict(state)
