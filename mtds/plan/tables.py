"""Load the CSV tables shipped in ``mtds/plan/data`` (hardware specs, published results).

Files are read with importlib.resources so that they work from an installed wheel. Lines that
start with '#' are source comments and are skipped; numeric fields become int or float.
"""
from __future__ import annotations

import csv
import io
from importlib import resources


def _number(text: str):
    """Parse '8' -> 8, '1.5' -> 1.5; anything else stays a string."""
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return text


def read_text(name: str) -> str:
    """Raw text of a shipped data file (comments included)."""
    return resources.files("mtds.plan.data").joinpath(name).read_text(encoding="utf-8")


def source_comment(name: str) -> str:
    """The '#' header of a table: where its numbers come from."""
    return "\n".join(l[1:].strip() for l in read_text(name).splitlines() if l.startswith("#"))


def load_table(name: str) -> list[dict]:
    """Rows of a shipped CSV as dicts with numbers parsed."""
    body = "\n".join(l for l in read_text(name).splitlines() if l.strip() and not l.startswith("#"))
    return [{k: _number(v) for k, v in row.items()} for row in csv.DictReader(io.StringIO(body))]
