"""mtds's import graph read from the source (nothing is imported), and the same graph folded to folders:
files per folder, arrows between folders, and arrows that run from a lower layer up to a higher one.

    python -m lab.import_graph              # the folder report of this checkout
    python -m lab.import_graph --repo DIR   # of another checkout (e.g. an older commit, for before/after)

The graph: an edge A -> B for every ``import``/``from ... import`` in A that names mtds module B, wherever it
sits in A: at module level, inside a function, or under ``if TYPE_CHECKING:``. ``from mtds.x import y`` is an
edge to ``mtds.x.y`` when that is a module, else to ``mtds.x``. A package's ``__init__`` is its own node.
"""
from __future__ import annotations

import argparse
import ast
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "mtds"

# Layers of the house, lowest first: a folder may import its own layer and those below it. Folders of one
# layer do not import each other in a circle (tests/test_import_cycles.py checks modules).
LAYERS = (
    ("mtds.deepspeed_compat", "mtds.parallel", "mtds.safety", "mtds.local_ranks", "mtds.rules"),
    ("mtds.observe", "mtds.tp", "mtds.cp", "mtds.data"),
    ("mtds.model",),
    ("mtds.hf", "mtds.checkpoint", "mtds.plan", "mtds.megatron"),
    ("mtds.pipe",),
    ("mtds.training",),
    ("mtds.eval", "mtds.cli", "mtds.gpucheck", "mtds.cluster"),
)


def module_names(root: Path = ROOT) -> dict[str, Path]:
    """``{"mtds.a.b": path}`` for every .py file under the package (packages by their __init__)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = ("mtds",) + path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _absolute(module: str, is_package: bool, level: int, name: str | None) -> str:
    """The absolute name of a relative import ``from <level dots><name> import ...`` inside ``module``."""
    if level == 0:
        return name or ""
    base = module.split(".")
    base = base[: len(base) - level + (1 if is_package else 0)]
    return ".".join(base + ([name] if name else []))


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the mtds modules it imports (module- and function-level alike, see the docstring)."""
    modules = module_names(root)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(module, is_package, node.level, node.module)
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for target in targets:
                while target and target not in modules:      # `import mtds.a.b.c` where c is a name
                    target = target.rpartition(".")[0]
                if target and target != module:
                    graph[module].add(target)
    return graph


def folder_of(module: str) -> str:
    """``mtds.a.b.c`` -> ``mtds.a`` (the package root's own modules are folders of their own: ``mtds.eval``)."""
    parts = module.split(".")
    return ".".join(parts[:2])


def layer_of(folder: str) -> int | None:
    return next((i for i, layer in enumerate(LAYERS) if folder in layer), None)


def folder_graph(graph: dict[str, set[str]]) -> Counter:
    """{(folder A, folder B): number of module edges} for A != B."""
    arrows = Counter()
    for a, targets in graph.items():
        for b in targets:
            fa, fb = folder_of(a), folder_of(b)
            if fa != fb and fb != "mtds":
                arrows[(fa, fb)] += 1
    return arrows


def upward(arrows: Counter) -> list[tuple[str, str, int]]:
    """Arrows from a lower layer up to a higher one (or to/from a folder no layer names)."""
    out = []
    for (a, b), n in sorted(arrows.items()):
        la, lb = layer_of(a), layer_of(b)
        if la is None or lb is None or lb > la:
            out.append((a, b, n))
    return out


def report(root: Path = ROOT) -> str:
    graph = import_graph(root)
    files = Counter(folder_of(m) for m in graph)
    arrows = folder_graph(graph)
    lines = [f"{sum(files.values())} modules in {len(files)} folders", "", "files per folder:"]
    lines += [f"  {f:<24} {n}" for f, n in sorted(files.items())]
    lines += ["", f"arrows between folders: {len(arrows)} (module edges: {sum(arrows.values())})"]
    lines += [f"  {a} -> {b} ({n})" for (a, b), n in sorted(arrows.items())]
    up = upward(arrows)
    lines += ["", f"arrows up a layer: {len(up)}"] + [f"  {a} -> {b} ({n})" for a, b, n in up]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m lab.import_graph", description=__doc__.split("\n")[0])
    p.add_argument("--repo", type=Path, default=ROOT.parent, help="a checkout holding mtds/ [this one]")
    args = p.parse_args(argv)
    print(report(args.repo / "mtds"))


if __name__ == "__main__":
    main()
