"""The markdown report: one section per check, a PASS/FAIL (or SKIP) row per case, with its numbers."""
from __future__ import annotations

from dataclasses import dataclass, field

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"


@dataclass
class Row:
    case: str
    status: str                 # PASS | FAIL | SKIP
    numbers: str = ""           # measured values, limits
    note: str = ""              # why it failed or was skipped (one line)


@dataclass
class Section:
    title: str
    intro: str = ""             # what is checked and the tolerance, with why
    rows: list[Row] = field(default_factory=list)
    table: list[dict] | None = None     # free-form table (the speed table) below the rows
    extra: list[str] = field(default_factory=list)      # markdown lines after the table (the step profile)
    seconds: float = 0.0

    def add(self, case: str, ok: bool, numbers: str = "", note: str = "") -> Row:
        row = Row(case, PASS if ok else FAIL, numbers, "" if ok else note)
        self.rows.append(row)
        return row

    def skip(self, case: str, why: str) -> None:
        self.rows.append(Row(case, SKIP, "", why))

    def fail(self, case: str, why: str) -> None:
        self.rows.append(Row(case, FAIL, "", why))

    @property
    def failed(self) -> bool:
        return any(r.status == FAIL for r in self.rows)


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render(header: list[str], sections: list[Section]) -> str:
    failed = sum(r.status == FAIL for s in sections for r in s.rows)
    passed = sum(r.status == PASS for s in sections for r in s.rows)
    lines = ["# mtds GPU check", ""] + [f"- {line}" for line in header]
    lines += [f"- result: **{'FAIL' if failed else 'PASS'}** ({passed} passed, {failed} failed)", ""]
    for s in sections:
        lines += [f"## {s.title}", ""]
        if s.intro:
            lines += [s.intro, ""]
        lines += ["| case | result | numbers | note |", "|---|---|---|---|"]
        lines += [f"| {_cell(r.case)} | {r.status} | {_cell(r.numbers)} | {_cell(r.note)} |" for r in s.rows]
        if s.table:
            keys = list(s.table[0])
            lines += ["", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
            lines += ["| " + " | ".join(_cell(row.get(k, "")) for k in keys) + " |" for row in s.table]
        if s.extra:
            lines += [""] + s.extra
        lines += ["", f"({s.seconds:.0f} s)", ""]
    return "\n".join(lines)
