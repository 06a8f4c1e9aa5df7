"""One definition of each training option: its ``TrainConfig`` field.

A field made by :func:`opt` carries in its metadata all that train.py knows of the option: its flags (the first
as --help shows it, then its aliases, Megatron's names among them), help text, --help section, argparse extras
(choices, metavar, nargs, action) and range (``at_least``, ``above``, ``below``; a float must also be finite).
From that alone:

- :func:`add_flags` writes the argparse groups (sections and flags in field order);
- :func:`given_values` reads the parsed flags back as ``TrainConfig`` keyword arguments;
- :func:`check_ranges` raises one line naming the flag for a value out of its range.

The parser's defaults are all None, meaning "not given", so the field's default stays the only one. A field
without a flag says why (``no_flag=``); tests/test_options.py holds every field to one or the other.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import MISSING, Field, field, fields
from typing import Any, Callable

# argparse's type from the field's annotation (a string: config.py postpones annotations); else str
_TYPES = {"int": int, "int | None": int, "float": float, "float | None": float}


def opt(default: Any = MISSING, *flags: str, help: str | None = None, section: str | None = None,
        no_flag: str | None = None, factory: Callable | None = None, at_least: float | None = None,
        above: float | None = None, below: float | None = None, note: str = "", **argparse_kw: Any) -> Any:
    """A dataclass field with its option: ``flags`` (or ``no_flag``, the reason it has none), ``help``, its
    --help ``section``, its range and ``note`` (what the bound means, in the error); ``argparse_kw`` go to
    ``add_argument`` as they are (choices, metavar, nargs, action)."""
    if bool(flags) == bool(no_flag) or (flags and not (help and section)):
        raise TypeError(f"opt{flags}: give flags with help and section, or no_flag with the reason")
    meta = dict(flags=flags, help=help, section=section, no_flag=no_flag, argparse=argparse_kw,
                at_least=at_least, above=above, below=below, note=note)
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def option_name(f: Field) -> str:
    """The flag that names the option in messages: its shortest spelling (--tp, not
    --tensor-model-parallel-size)."""
    return min(f.metadata["flags"], key=len)


def flag_fields(cls) -> list[Field]:
    return [f for f in fields(cls) if f.metadata.get("flags")]


def _argparse_kw(f: Field) -> dict:
    kw = dict(dest=f.name, default=None, help=f.metadata["help"], **f.metadata["argparse"])
    if f.default is MISSING and f.default_factory is MISSING:
        kw["required"] = True
    if f.type == "bool":
        kw.setdefault("action", "store_true")
    if "action" not in kw:      # the flag takes a value
        kw["type"] = _TYPES.get(f.type)
        if "choices" not in kw:     # argparse's own placeholder, from the option's name (TP, DIST_TIMEOUT)
            kw.setdefault("metavar", option_name(f).lstrip("-").replace("-", "_").upper())
    return kw


def add_flags(parser: argparse.ArgumentParser, cls,
              after: Callable[[argparse._ArgumentGroup, str], None] | None = None) -> None:
    """One argument group per section of ``cls``, in field order; ``after(group, name)`` runs after each
    field's flag, so a flag that is no field can take its place in --help."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in flag_fields(cls):
        section = f.metadata["section"]
        group = groups.get(section) or groups.setdefault(section, parser.add_argument_group(section))
        group.add_argument(*f.metadata["flags"], **_argparse_kw(f))
        if after is not None:
            after(group, f.name)


def add_flag(parser: argparse.ArgumentParser, cls, name: str, *, help: str | None = None) -> None:
    """Field ``name``'s flag on another command's parser (mtds-eval's --cp as train.py declares it): the same
    spellings, choices and metavar, the field's default, and ``help`` where the command means less than
    train.py does."""
    f = next(f for f in flag_fields(cls) if f.name == name)
    kw = _argparse_kw(f)
    kw["default"] = f.default
    if help is not None:
        kw["help"] = help
    parser.add_argument(*f.metadata["flags"], **kw)


def given_values(args: argparse.Namespace, cls) -> dict[str, Any]:
    """``cls`` keyword arguments from parsed flags: those given (not None), a list (nargs) as a tuple."""
    values = {f.name: getattr(args, f.name) for f in flag_fields(cls)}
    return {k: tuple(v) if isinstance(v, list) else v for k, v in values.items() if v is not None}


def range_words(f: Field) -> str | None:
    """The field's range as its error says it (">= 1", "> 0", "in [0, 1)"), or None when it has none."""
    m = f.metadata
    if m.get("below") is not None:
        return f"in [{m['at_least']}, {m['below']})"
    if m.get("above") is not None:
        return f"> {m['above']}"
    if m.get("at_least") is not None:
        return f">= {m['at_least']}"
    return None


def _in_range(value: Any, m: dict) -> bool:
    if isinstance(value, float) and not math.isfinite(value):
        return False
    return not ((m["at_least"] is not None and value < m["at_least"]) or
                (m["above"] is not None and value <= m["above"]) or
                (m["below"] is not None and value >= m["below"]))


def check_ranges(config: Any) -> None:
    """Each set (not None) field within its range, in field order, else ``ValueError`` with one line naming the
    flag: ``--tp must be >= 1, got 0``."""
    for f in fields(config):
        words, value = range_words(f), getattr(config, f.name)
        if words is not None and value is not None and not _in_range(value, f.metadata):
            raise ValueError(f"{option_name(f)} must be {words}{f.metadata['note']}, got {value}")
