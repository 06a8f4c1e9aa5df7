"""Which keys of a DeepSpeed JSON the installed DeepSpeed reads, taken from DeepSpeed's own parser.

DeepSpeed ignores a key it does not know at the top level and in the sections it reads key by key (a
``"zero_optimisation"`` block trains at ZeRO-0 without a word), and refuses one in the sections it
hands to its pydantic models only when the engine is built, after the data and the model. mtds
checks the keys first, against DeepSpeed itself rather than a copied list:

* the top level: ``DeepSpeedConfig`` (the class ``deepspeed.initialize`` builds) parses a config
  wrapped in a dict that records every key looked up (``get``, ``[]``, ``in``, ``keys()``); plus the
  two keys ``deepspeed.initialize`` reads itself (``INITIALIZE_KEYS``);
* each section the user wrote: the same parse of that section alone, with a probe key (one per
  nested dict) added. A section DeepSpeed hands to a pydantic model (``DeepSpeedZeroConfig``,
  ``DeepSpeedBF16Config``, the monitors, ...: all ``extra="forbid"``) refuses its probe: the error
  names the model and where, whose fields and aliases are then the valid keys (nested models
  likewise). A section read key by key: the keys looked up are the valid ones. A section read
  whole (iterated or copied: ``pipeline``, ``data_efficiency.data_sampling``) or handed on
  (``PASSED_ON``: ``optimizer.params``, ``scheduler.params``) is not checked; nor is one whose parse
  fails on the user's values (DeepSpeed then stops with its own error).

Values: in a pydantic section DeepSpeed drops ``"auto"`` (HF Trainer's placeholder) and uses the
default, and converts strings to booleans and numbers (``"enabled": "false"`` is False); both are
reported (:func:`find_problems`).
"""
from __future__ import annotations

import collections.abc
import contextlib
import enum
import functools
import json
import logging
import typing
from dataclasses import dataclass

PROBE = "__mtds_probe_{}__"
# Keys deepspeed.initialize itself reads from the config (deepspeed/__init__.py), besides DeepSpeedConfig.
INITIALIZE_KEYS = ("sequence_parallel_size", "data_parallel_size")
# Dicts DeepSpeed passes on whole to another constructor: any key is valid there.
PASSED_ON = {("optimizer", "params"): "the optimizer's constructor",
             ("scheduler", "params"): "the LR scheduler's constructor"}
SCHEMA_CAPABILITY = "check a DeepSpeed JSON's keys against DeepSpeed's own config parser"
# The smallest config DeepSpeedConfig parses at any world size (no batch arithmetic to fail).
_BASE = {"train_micro_batch_size_per_gpu": 1}


def _mismatch(problem: str):
    """The installed DeepSpeed's parser no longer works as this module relies on: one line."""
    from mtds.deepspeed_compat.capabilities import CAPABILITIES, DeepSpeedMismatch, mismatch_line
    capability = next(c for c in CAPABILITIES if c.name == SCHEMA_CAPABILITY)
    return DeepSpeedMismatch(mismatch_line(capability.name, capability.targets[0], problem))


@dataclass(frozen=True)
class ConfigProblem:
    """One key or value of a DeepSpeed config that DeepSpeed would ignore, refuse late, or read otherwise
    than written. ``path``: the keys from the top level to it."""

    path: tuple[str, ...]
    kind: str                    # "unknown" | "auto" | "string"
    silent: bool = True          # "unknown": DeepSpeed ignores it (True) or refuses it once the engine starts
    suggestion: tuple[str, ...] | None = None    # "unknown": the nearest valid key, as a path
    valid: tuple[str, ...] = ()  # "unknown": the valid keys there
    value: object = None         # "auto" / "string": the value written
    converted: object = None     # "string": what DeepSpeed reads; "auto": the default it uses instead


class _Recorder(dict):
    """A config dict that notes, per path, the keys DeepSpeed's parser looks up and whether it read the
    dict whole (iterated or copied it: then any key is handed on)."""

    def __init__(self, data: dict, path: tuple, log: dict, probes: dict | None = None, skip=frozenset()):
        super().__init__()
        self._path, self._log = path, log
        log.setdefault(path, [set(), False])
        for key, value in data.items():
            dict.__setitem__(self, key, _Recorder(value, path + (key,), log, probes, skip)
                             if isinstance(value, dict) else value)
        if probes is not None and path and path not in skip:
            name = PROBE.format(len(probes))
            probes[name] = path
            dict.__setitem__(self, name, 0)

    def _look(self, key):
        self._log[self._path][0].add(key)

    def _whole(self):
        self._log[self._path][1] = True

    def get(self, key, default=None):
        self._look(key)
        return super().get(key, default)

    def __getitem__(self, key):
        self._look(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self._look(key)
        return super().__contains__(key)

    def keys(self):
        return collections.abc.KeysView(self)     # ``key in d.keys()`` then goes through __contains__

    def __iter__(self):
        self._whole()
        return super().__iter__()

    def items(self):
        self._whole()
        return super().items()

    def values(self):
        self._whole()
        return super().values()

    def __copy__(self):
        self._whole()
        copy = _Recorder({}, self._path, self._log)
        dict.update(copy, self)
        return copy

    def __reduce_ex__(self, protocol):
        self._whole()
        return dict, (dict(self),)


@contextlib.contextmanager
def _quiet():
    """DeepSpeed's logger says nothing about the probe parses (they are not the run's config)."""
    from deepspeed.utils import logger
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _parse(config: dict, probes: dict | None = None, skip=frozenset()):
    """(lookups per path, the exception DeepSpeedConfig raised or None). ``probes``: a probe key is added
    to every nested dict but those at ``skip`` (paths), and noted here (probe key -> path)."""
    from deepspeed.runtime.config import DeepSpeedConfig
    log: dict = {}
    recorder = _Recorder(config, (), log, probes, skip)
    with _quiet():
        try:
            DeepSpeedConfig(recorder)
        except Exception as err:     # a pydantic ValidationError names the model: that is the point
            return log, err
    return log, None


@functools.lru_cache(maxsize=1)
def top_level_keys() -> frozenset[str]:
    """Every top-level key DeepSpeed's config parser looks up (and deepspeed.initialize's own)."""
    log, err = _parse(dict(_BASE))
    keys = frozenset(log[()][0])
    if err is not None or not {"train_batch_size", "zero_optimization", "optimizer", "bf16"} <= keys:
        raise _mismatch(f"refused the smallest config ({type(err).__name__}: {err})" if err is not None else
                        "no longer reads its config through lookups mtds can record")
    return keys | frozenset(INITIALIZE_KEYS)


def _pydantic_models() -> dict[str, list[type]]:
    import pydantic
    found: dict[str, list[type]] = {}
    todo = [pydantic.BaseModel]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            todo.append(sub)
            if sub.__module__.startswith("deepspeed."):
                found.setdefault(sub.__name__, []).append(sub)
    return found


def _models_in(annotation) -> list[type]:
    """The pydantic model classes an annotation allows (``Optional[M]``, ``Union[A, B]``, ``M``)."""
    import pydantic
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _names(field_name: str, info) -> set[str]:
    """A field's accepted keys: its name (DeepSpeed's models populate by name) and its aliases."""
    import pydantic
    names = {field_name}
    for alias in (info.alias, info.validation_alias):
        if isinstance(alias, str):
            names.add(alias)
        elif isinstance(alias, pydantic.AliasChoices):
            names.update(c for c in alias.choices if isinstance(c, str))
    return names


def _field(model: type, key: str):
    for name, info in model.model_fields.items():
        if key in _names(name, info):
            return name, info
    return None


def _valid_keys(model: type) -> frozenset[str]:
    return frozenset(n for name, info in model.model_fields.items() for n in _names(name, info))


def _model_at(model: type, loc: tuple) -> type | None:
    """The model validating ``loc`` inside ``model`` (loc as pydantic reports it: field keys, and a
    member's name where a field allows several models)."""
    candidates = [model]
    for part in loc:
        if not isinstance(part, str):
            return None
        named = [m for m in candidates if m.__name__ == part]
        if named and len(candidates) > 1:
            candidates = named
            continue
        hit = _field(candidates[0], part) if len(candidates) == 1 else None
        if hit is None:
            return None
        candidates = _models_in(hit[1].annotation)
    return candidates[0] if len(candidates) == 1 else None


@dataclass(frozen=True)
class _Section:
    models: dict                 # path in the section -> the pydantic model DeepSpeed validates that dict with
    lookups: dict                # path in the section -> keys looked up there (dicts read key by key)
    complete: bool               # the parse ran to the end: the lookups are all DeepSpeed makes


def _blank(section: dict, paths) -> dict:
    """``section`` with the dicts at ``paths`` (relative) emptied."""
    out = {}
    for key, value in section.items():
        if (key,) in paths:
            value = {}
        elif isinstance(value, dict):
            value = _blank(value, {p[1:] for p in paths if p[:1] == (key,)})
        out[key] = value
    return out


def _classify(name: str, section: dict) -> _Section:
    """Parse ``{name: section}`` with a probe key in each of its dicts. A dict whose probe a pydantic
    model refuses is that model's; the parse is then repeated with those dicts empty (so DeepSpeed
    gets past them) until no new model shows up."""
    import pydantic
    models: dict[tuple, type] = {}
    registry = None
    for _ in range(8):
        probes: dict = {}
        log, err = _parse({**_BASE, name: _blank(section, set(models))}, probes,
                          skip={(name,) + path for path in models})
        new = {}
        if isinstance(err, pydantic.ValidationError):
            registry = registry or _pydantic_models()
            candidates = registry.get(err.title, [])
            for error in err.errors():
                loc = tuple(error.get("loc", ()))
                if error.get("type") != "extra_forbidden" or not loc or loc[-1] not in probes:
                    continue
                path = probes[loc[-1]][1:]
                model = _model_at(candidates[0], loc[:-1]) if len(candidates) == 1 else None
                if model is not None and path not in models:
                    new[path] = model
        if not new:
            break
        models.update(new)
    lookups = {path[1:]: frozenset(k for k in keys if k not in probes) for path, (keys, whole) in log.items()
               if path[:1] == (name,) and not whole}
    return _Section(models=models, lookups=lookups, complete=err is None)


def _read_back(model: type, key: str, value):
    """What DeepSpeed's model makes of ``{key: value}`` alone; ``_NOTHING`` where it refuses it."""
    hit = _field(model, key)
    if hit is None:
        return _NOTHING
    try:
        with _quiet():
            return getattr(model(**{key: value}), hit[0])
    except Exception:         # refused (DeepSpeed says so itself), or valid only with other keys
        return _NOTHING


_NOTHING = object()


def _value_problem(path: tuple, model: type, key: str, value) -> ConfigProblem | None:
    """A string DeepSpeed reads otherwise than written: "auto" dropped for a default, "false"/"1" turned
    into a boolean or number (checked by building the model with that value alone)."""
    if not isinstance(value, str):
        return None
    got = _read_back(model, key, value)
    if got is _NOTHING:
        return None
    if isinstance(got, enum.Enum):
        got = got.value
    if value == "auto" and got != "auto":
        return ConfigProblem(path + (key,), "auto", value=value, converted=got)
    if isinstance(got, (bool, int, float)):     # not a path, a dtype, ... that a string stands for
        return ConfigProblem(path + (key,), "string", value=value, converted=got)
    return None


def _unknown(path, key, valid, silent) -> ConfigProblem:
    import difflib
    near = difflib.get_close_matches(key, sorted(valid), n=1, cutoff=0.6)
    return ConfigProblem(path + (key,), "unknown", silent=silent,
                         suggestion=path + (near[0],) if near else None, valid=tuple(sorted(valid)))


def _check_model(section: dict, model: type, path: tuple, out: list) -> None:
    valid = _valid_keys(model)
    for key, value in section.items():
        if key not in valid:
            out.append(_unknown(path, key, valid, silent=False))
            continue
        problem = _value_problem(path, model, key, value)
        if problem is not None:
            out.append(problem)
        elif isinstance(value, dict):
            models = _models_in(_field(model, key)[1].annotation)
            if len(models) == 1:
                _check_model(value, models[0], path + (key,), out)


def _check_lookups(section: dict, info: _Section, path: tuple, rel: tuple, out: list) -> None:
    model = info.models.get(rel)
    if model is not None:
        _check_model(section, model, path, out)
        return
    keys = info.lookups.get(rel)
    if keys is None or not info.complete:
        return                       # read whole, handed on, or not reached: not checked
    valid = set(keys) | {p[-1] for p in PASSED_ON if p[:-1] == path}
    for key, value in section.items():
        if key not in valid:
            out.append(_unknown(path, key, valid, silent=True))
        elif isinstance(value, dict) and path + (key,) not in PASSED_ON:
            _check_lookups(value, info, path + (key,), rel + (key,), out)


def find_problems(config: dict) -> list[ConfigProblem]:
    """What DeepSpeed would ignore, refuse late, or read otherwise than written in ``config`` (a parsed
    DeepSpeed JSON), in the config's order; [] for a clean one."""
    out: list[ConfigProblem] = []
    top = top_level_keys()
    for name, value in config.items():
        if name not in top:
            out.append(_unknown((), name, top, silent=True))
        elif isinstance(value, dict):
            _check_lookups(value, _classify_cached(name, value), (name,), (), out)
    return out


def _classify_cached(name: str, section: dict) -> _Section:
    try:
        key = json.dumps(section, sort_keys=True)
    except (TypeError, ValueError):
        return _classify(name, section)
    return _classify_json(name, key)


@functools.lru_cache(maxsize=64)
def _classify_json(name: str, section_json: str) -> _Section:
    return _classify(name, json.loads(section_json))
