"""Turn a `--data` spec into a `datasets.Dataset` of raw documents.

Accepted specs:
  * None                      -> the shipped corpus (mtds/assets/corpus)
  * a local file              -> .txt, .json/.jsonl, .csv, .parquet (optionally .gz/.bz2/.xz/.zst)
  * a local directory         -> every data file in it (recursively, hidden entries skipped),
                                 all of one format; or a directory written by `save_to_disk`
  * "name[:config][@split]"   -> a HuggingFace Hub dataset (needs network; split defaults to train)
    ("path@split" also picks a split of a saved DatasetDict)

Text files hold ONE DOCUMENT PER FILE (datasets' `sample_by="document"`): that
keeps a play or an article whole, so EOS only ever falls between documents.
For many documents, use a jsonl/csv/parquet file with one document per row.

Resolution does not load anything: it returns a `Source` whose `identity`
(each file's path inside the data, size and content digest: mtds/data/fingerprint.py;
not its absolute path or mtime) keys the token cache, so a cache hit skips `datasets`.
"""
import os
from dataclasses import dataclass, field
from typing import Callable, Optional

from mtds.data.assets import SHIPPED_CORPUS
from mtds.data.errors import DataError
from mtds.data.fingerprint import files_identity
from mtds.data.hub import hub_reachable

_BUILDERS = {".txt": "text", ".text": "text",
             ".json": "json", ".jsonl": "json", ".ndjson": "json",
             ".csv": "csv", ".parquet": "parquet", ".pq": "parquet"}
_COMPRESSION = (".gz", ".bz2", ".xz", ".zst")
CACHE_DIRNAME = ".mtds_cache"


@dataclass
class Source:
    description: str                      # for messages: what the user asked for
    identity: Optional[dict]              # JSON-able; None = use the loaded dataset's fingerprint
    home: Optional[str]                   # directory "next to the data" for caches (None for hub)
    load: Callable[[str], "object"] = field(repr=False)  # hf_cache_dir -> datasets.Dataset


def resolve_source(spec=None, split=None) -> Source:
    if spec is None:
        return _files_source(SHIPPED_CORPUS, "the shipped corpus", split)
    spec = str(spec)
    path = os.path.expanduser(spec)
    if not os.path.exists(path):
        target, config, split_in_spec = _parse_hub_spec(spec)
        split = split or split_in_spec
        if os.path.exists(os.path.expanduser(target)):  # "dir@split" for a saved DatasetDict
            path = os.path.expanduser(target)
        elif _looks_like_path(target):
            raise DataError(f"data path {target!r} does not exist")
        else:
            return _hub_source(target, config, split)
    if os.path.isdir(path) and _is_saved_dataset(path):
        return _disk_source(path, split)
    return _files_source(path, spec, split)


def _parse_hub_spec(spec):
    target, _, split = spec.partition("@")
    name, _, config = target.partition(":")
    return name, config or None, split or None


def _looks_like_path(target: str) -> bool:
    """Hub names are `name` or `owner/name`; anything else is meant as a path."""
    if target.startswith(("/", ".", "~")) or target.count("/") > 1 or os.sep != "/" and os.sep in target:
        return True
    return _builder_for(target) is not None


def _builder_for(filename: str):
    stem = filename.lower()
    for suffix in _COMPRESSION:
        if stem.endswith(suffix):
            stem = stem[: -len(suffix)]
    return _BUILDERS.get(os.path.splitext(stem)[1])


def _is_saved_dataset(path: str) -> bool:
    names = set(os.listdir(path))
    return "dataset_dict.json" in names or {"state.json", "dataset_info.json"} <= names


def _data_files(path: str):
    if os.path.isfile(path):
        return [path]
    found = []
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "_")))
        found += [os.path.join(root, f) for f in sorted(files)
                  if not f.startswith((".", "_")) and _builder_for(f)]
    return found


def _files_source(path: str, description: str, split) -> Source:
    files = _data_files(path)
    if os.path.isfile(path) and _builder_for(path) is None:
        raise DataError(f"cannot read {description!r}: unknown file type; use .txt, .json, "
                        f".jsonl, .csv or .parquet")
    if not files:
        raise DataError(f"data directory {description!r} holds no .txt/.json/.jsonl/.csv/"
                        f".parquet files")
    files = [f for f in files if os.path.getsize(f) > 0]  # datasets trips over empty files
    if not files:
        raise DataError(f"dataset {description!r} is empty (its data files have 0 bytes)")
    builders = sorted({_builder_for(f) for f in files})
    if len(builders) > 1:
        raise DataError(f"data directory {description!r} mixes formats ({', '.join(builders)}); "
                        f"keep one format per directory")
    builder = builders[0]
    home = os.path.dirname(os.path.abspath(path)) if os.path.isfile(path) else os.path.abspath(path)

    def load(hf_cache_dir):
        from datasets import load_dataset
        extra = {"sample_by": "document"} if builder == "text" else {}
        try:
            return load_dataset(builder, data_files=files, split="train",
                                cache_dir=hf_cache_dir, **extra)
        except Exception as exc:  # malformed json/csv/parquet: say which data, in one line
            raise DataError(f"could not read {description!r} as {builder}: {_first_line(exc)}") from exc

    identity = {"kind": "files", "builder": builder, "files": files_identity(files, path)}
    return Source(description, identity, os.path.join(home, CACHE_DIRNAME), load)


def _disk_source(path: str, split) -> Source:
    def load(hf_cache_dir):
        from datasets import DatasetDict, load_from_disk
        ds = load_from_disk(path)
        if isinstance(ds, DatasetDict):
            ds = _pick_split(ds, split, path)
        return ds

    files = [os.path.join(r, f) for r, d, fs in os.walk(path) if CACHE_DIRNAME not in r for f in fs]
    identity = {"kind": "disk", "split": split, "files": files_identity(sorted(files), path)}
    return Source(path, identity, os.path.join(os.path.abspath(path), CACHE_DIRNAME), load)


def _pick_split(dsdict, split, where):
    if split is None:
        if "train" in dsdict:
            return dsdict["train"]
        if len(dsdict) == 1:
            return next(iter(dsdict.values()))
        split = "train"
    if split not in dsdict:
        raise DataError(f"{where!r} has no split {split!r}; available: {', '.join(dsdict)}")
    return dsdict[split]


def _hub_source(name: str, config, split) -> Source:
    description = name + (f":{config}" if config else "") + f"@{split or 'train'}"

    def load(hf_cache_dir):
        import datasets
        from datasets import load_dataset

        # In offline mode (HF_HUB_OFFLINE=1 when datasets was imported) datasets serves
        # a cached copy without touching the network. Otherwise check the hub first:
        # unreachable, huggingface_hub would retry for a minute before failing.
        if not datasets.config.HF_HUB_OFFLINE and not hub_reachable():
            raise DataError(f"dataset {description!r} is not a local path and the HuggingFace "
                            f"Hub could not be reached (offline?); pass a local file or directory")
        try:
            return load_dataset(name, config, split=split or "train", cache_dir=hf_cache_dir)
        except Exception as exc:
            raise DataError(f"could not load hub dataset {description!r}: {_first_line(exc)}; "
                            f"pass a local file or directory instead") from exc

    return Source(description, None, None, load)


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
