"""Explicit pipeline layouts: how many transformer blocks each virtual stage holds, and where the
embedding (E) and the final norm + LM head + loss (L) sit.

Syntax (after Megatron-core's ``--pipeline-model-parallel-layout``): ``E`` embedding, ``t`` one
transformer block, ``L`` final norm + LM head + loss, ``|`` ends a virtual stage, ``X*n`` repeats an
item or a parenthesised group n times, spaces and commas are ignored. Virtual stage k runs on pipeline
rank k mod p (interleaved placement; dualpipev: the V, stage k and 2p-1-k on one rank).

    "Et*3|t*3|t*2L"       three stages: E + 3 blocks, 3 blocks, 2 blocks + L
    "E|t*4|t*4|L"         the first and last stage hold no transformer block
    "Et|(tt|)*3tL"        groups repeat stage separators too

A :class:`StageLayout` is what the model builder consumes: blocks per virtual stage, E always on the
first and L on the last (mtds's data path feeds the input ids to stage 0 and the labels to the last).
Layer indices stay global (0 embedding, 1..l blocks, l+1 final norm, l+2 head), so checkpoints do not
depend on the layout.
"""
from __future__ import annotations

from dataclasses import dataclass


class PipelineLayoutError(ValueError):
    """A --pipeline-layout that cannot be built; the message says what to change."""


@dataclass(frozen=True)
class StageLayout:
    """Transformer blocks held by each virtual stage, in pipeline order (E on the first, L on the last)."""

    blocks: tuple[int, ...]

    @property
    def stages(self) -> int:
        return len(self.blocks)

    @property
    def num_layers(self) -> int:
        return sum(self.blocks)

    def spec_parts(self) -> list[int]:
        """DeepSpeed ``parts`` over mtds's spec list [E, t_1..t_l, final norm, head]: virtual stage k
        builds specs parts[k]:parts[k+1]. E adds one spec to the first stage, L two to the last."""
        parts, end = [0], 1
        for k, n in enumerate(self.blocks):
            end += n + (2 if k == self.stages - 1 else 0)
            parts.append(end)
        return parts

    def block_ranges(self) -> list[range]:
        """Global indices (1..l) of the blocks of each virtual stage."""
        out, start = [], 1
        for n in self.blocks:
            out.append(range(start, start + n))
            start += n
        return out

    def __str__(self) -> str:
        """The layout in its own syntax, runs of equal middle stages as one group: 'Et|(t*2|)*6tL'."""
        cells = [("E" if k == 0 else "") + (f"t*{n}" if n > 1 else "t" * n) + ("L" if k == self.stages - 1 else "")
                 for k, n in enumerate(self.blocks)]
        if len(cells) == 1:
            return cells[0]
        out, middle, i = [cells[0] + "|"], cells[1:-1], 0
        while i < len(middle):
            j = i
            while j < len(middle) and middle[j] == middle[i]:
                j += 1
            out.append(f"({middle[i]}|)*{j - i}" if j - i > 1 else middle[i] + "|")
            i = j
        return "".join(out) + cells[-1]


def uniform_layout(num_layers: int, stages: int) -> StageLayout:
    """DeepSpeed's ``partition_method="type:TransformerLayer"`` split (what mtds ran before layouts):
    l // S blocks per stage, the first l mod S stages one more; E and L ride with the end stages."""
    base, extra = divmod(num_layers, stages)
    return StageLayout(tuple(base + (1 if k < extra else 0) for k in range(stages)))


def _expand(text: str) -> list[str]:
    """Tokens E, t, L, | with every ``*n`` repetition and group unrolled."""
    pos = 0

    def error(what: str) -> PipelineLayoutError:
        return PipelineLayoutError(f"--pipeline-layout {text!r}: {what} at character {pos + 1}; syntax: E "
                                   f"(embedding), t (block), L (head + loss), | (next stage), X*n repeats, "
                                   f"(...) groups, e.g. 'Et*3|t*3|t*2L'")

    def sequence(closing: str | None) -> list[str]:
        nonlocal pos
        out: list[str] = []
        while pos < len(text):
            ch = text[pos]
            if ch in " ,":
                pos += 1
                continue
            if ch == ")":
                if closing is None:
                    raise error("unmatched ')'")
                pos += 1
                return out
            if ch in "EtL|":
                item = [ch]
                pos += 1
            elif ch == "(":
                pos += 1
                item = sequence(")")
            else:
                raise error(f"unexpected {ch!r}")
            out.extend(item * repeat())
        if closing is not None:
            raise error("missing ')'")
        return out

    def repeat() -> int:
        nonlocal pos
        while pos < len(text) and text[pos] == " ":
            pos += 1
        if pos >= len(text) or text[pos] != "*":
            return 1
        pos += 1
        start = pos
        while pos < len(text) and text[pos].isdigit():
            pos += 1
        if start == pos:
            raise error("'*' needs a count")
        return int(text[start:pos])

    return sequence(None)


def parse_layout(text: str, *, stages: int, num_layers: int) -> StageLayout:
    """The layout ``text`` describes, checked against p·v virtual stages and the model's l blocks."""
    tokens = _expand(text)
    cells: list[list[str]] = [[]]
    for tok in tokens:
        if tok == "|":
            cells.append([])
        else:
            cells[-1].append(tok)
    flat = [tok for tok in tokens if tok != "|"]
    problems = []
    if len(cells) != stages:
        problems.append(f"has {len(cells)} stages ('|' + 1) but the run has p x v = {stages} virtual stages")
    if flat.count("E") != 1 or not cells[0] or cells[0][0] != "E":
        problems.append("needs exactly one E, first in the first stage")
    if flat.count("L") != 1 or not cells[-1] or cells[-1][-1] != "L":
        problems.append("needs exactly one L, last in the last stage")
    blocks = tuple(cell.count("t") for cell in cells)
    if sum(blocks) != num_layers:
        problems.append(f"holds {sum(blocks)} transformer blocks but the model has {num_layers}")
    empty = [k for k, cell in enumerate(cells) if not cell]
    if empty:
        problems.append(f"stage {empty[0]} holds nothing (DeepSpeed needs parameters on every stage): give it "
                        f"a block")
    if problems:
        raise PipelineLayoutError(f"--pipeline-layout {text!r} {'; '.join(problems)}")
    return StageLayout(blocks)


__all__ = ["PipelineLayoutError", "StageLayout", "parse_layout", "uniform_layout"]
