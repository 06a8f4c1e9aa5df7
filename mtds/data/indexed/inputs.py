"""Stream documents out of local files for preprocessing, one record at a time.

Accepted: a file or a directory of files (.txt, .json/.jsonl, .csv, .parquet; the text formats
also .gz/.bz2/.xz), a folder written by `datasets`' `save_to_disk`, or an :class:`HFStream` -- an HF
dataset read in `datasets`' streaming mode (a local dataset folder, or a hub name where the machine
can reach the hub), which neither downloads nor converts the dataset whole. A .txt file is one
document (as in training's --data); json lines, csv rows, parquet rows and dataset records are one
document each. Nothing here holds more than one record, one csv/parquet batch or one .txt file in memory.
"""
import bz2
import csv
import gzip
import json
import lzma
import os
import sys
from dataclasses import dataclass

from mtds.data.errors import DataError
from mtds.data.source import _builder_for, _data_files, _is_saved_dataset, _pick_split

_OPENERS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}


@dataclass(frozen=True)
class HFStream:
    """An HF dataset to stream: ``datasets.load_dataset(name, config, split=split, streaming=True)``."""
    name: str
    config: str | None = None
    split: str = "train"

    def __str__(self) -> str:
        return f"HF dataset {self.name}" + (f" ({self.config})" if self.config else "") + f" [{self.split}]"


def iter_documents(path, keys):
    """Validate `path` now (errors before anything is written); return an iterator of
    {key: text} dicts, one per document."""
    if isinstance(path, HFStream):
        return _hf_stream(path, list(keys))
    path = os.path.expanduser(str(path))
    if not os.path.exists(path):
        raise DataError(f"input {path!r} does not exist")
    if os.path.isdir(path) and _is_saved_dataset(path):
        return _saved_dataset(path, keys)
    if os.path.isfile(path) and _builder_for(path) is None:
        raise DataError(f"cannot read {path!r}: unknown file type; use .txt, .json, .jsonl, .csv, "
                        f".parquet or a save_to_disk folder")
    files = _data_files(path)
    if not files:
        raise DataError(f"input directory {path!r} holds no .txt/.json/.jsonl/.csv/.parquet files")
    if any(_builder_for(f) == "text" for f in files) and list(keys) != ["text"]:
        raise DataError(f"{path!r} has .txt files, whose only text is 'text'; drop --json-keys "
                        f"or pass --json-keys text")
    if any(f.endswith(".zst") for f in files):
        raise DataError(f"{path!r} has .zst files; decompress them first (zstd -d) or use .gz/.xz")
    return _files(files, list(keys))


def _files(files, keys):
    readers = {"text": _text, "json": _json_lines, "csv": _csv, "parquet": _parquet}
    for f in files:
        yield from readers[_builder_for(f)](f, keys)


def _open_text(path):
    opener = _OPENERS.get(os.path.splitext(path)[1].lower(), open)
    return opener(path, "rt", encoding="utf-8", errors="replace", newline="")


def _text(path, keys):
    with _open_text(path) as f:
        yield {"text": f.read()}


def _json_lines(path, keys):
    with _open_text(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                hint = " (a JSON array? write one object per line: JSON lines)" if line.lstrip().startswith("[") else ""
                raise DataError(f"{path}:{lineno} is not a JSON object: {exc.msg}{hint}") from None
            yield _pick(record, keys, f"{path}:{lineno}")


def _csv(path, keys):
    csv.field_size_limit(min(sys.maxsize, 2 ** 31 - 1))   # documents are longer than csv's 128 KiB default
    with _open_text(path) as f:
        reader = csv.DictReader(f)
        _check_columns(reader.fieldnames or [], keys, path)
        for row in reader:
            yield {k: row[k] for k in keys}


def _parquet(path, keys):
    import pyarrow.parquet as pq
    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:
        raise DataError(f"could not read {path!r} as parquet: {str(exc).splitlines()[0]}") from None
    _check_columns(pf.schema_arrow.names, keys, path)
    for batch in pf.iter_batches(batch_size=1024, columns=list(keys)):
        yield from _rows(batch.to_pydict(), keys, path)


def _saved_dataset(path, keys):
    from datasets import DatasetDict, load_from_disk
    ds = load_from_disk(path)
    if isinstance(ds, DatasetDict):
        ds = _pick_split(ds, None, path)
    _check_columns(ds.column_names, keys, path)
    return (row for batch in ds.select_columns(list(keys)).iter(batch_size=1024)
            for row in _rows(batch, keys, path))


def _hf_stream(source: HFStream, keys):
    from datasets import load_dataset
    try:
        ds = load_dataset(source.name, source.config, split=source.split, streaming=True)
    except Exception as exc:     # datasets raises many kinds: missing path, bad split, no network
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"cannot stream {source}: {first}") from None
    if ds.column_names is not None:     # known up front for most builders; else checked per record
        _check_columns(ds.column_names, keys, str(source))
    return (_pick(record, keys, str(source)) for record in ds)


def _rows(columns, keys, where):
    for i in range(len(columns[keys[0]])):
        yield _pick({k: columns[k][i] for k in keys}, keys, where)


def _pick(record, keys, where):
    if not isinstance(record, dict):
        raise DataError(f"{where} holds {type(record).__name__}, not a JSON object with {keys[0]!r}")
    out = {}
    for k in keys:
        if k not in record:
            raise DataError(f"{where} has no key {k!r}; it has {', '.join(map(repr, record)) or 'none'} "
                            f"(choose with --json-keys)")
        value = record[k]
        if value is not None and not isinstance(value, str):
            raise DataError(f"{where}: {k!r} holds {type(value).__name__}, not text")
        out[k] = value or ""
    return out


def _check_columns(names, keys, path):
    missing = [k for k in keys if k not in names]
    if missing:
        raise DataError(f"{path!r} has no column {missing[0]!r}; available: {', '.join(names)} "
                        f"(choose with --json-keys)")
