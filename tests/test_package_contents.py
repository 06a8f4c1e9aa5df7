"""The installed package holds the product only: every module under ``mtds/`` imports with pytest, the lab,
the tests, the benchmarks and ``compare/`` unavailable (as after ``pip install mtds`` on a user's machine)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import mtds

ROOT = Path(mtds.__file__).resolve().parent
NOT_SHIPPED = ("pytest", "lab", "tests", "benchmarks", "compare")

PROBE = r"""
import importlib, importlib.abc, pkgutil, sys
import os
BLOCKED = set(os.environ["NOT_SHIPPED"].split(","))

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is not shipped with mtds")
        return None

sys.meta_path.insert(0, Block())
import mtds
failed = []
for info in pkgutil.walk_packages(mtds.__path__, "mtds."):
    if info.name.endswith(".__main__"):     # runs a command when imported
        continue
    try:
        importlib.import_module(info.name)
    except Exception as err:
        failed.append(f"{info.name}: {type(err).__name__}: {err}")
print("\n".join(failed) if failed else "ok", flush=True)
"""


def _module_count() -> int:
    return sum(1 for p in ROOT.rglob("*.py"))


def test_every_module_imports_without_the_lab_or_pytest():
    env = {**os.environ, "NOT_SHIPPED": ",".join(NOT_SHIPPED), "PYTHONPATH": str(ROOT.parent)}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, cwd="/",
                         env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "ok", out.stdout[-3000:]
    assert _module_count() > 150          # the walk covered the package, not an empty folder


def test_no_module_names_the_lab_or_pytest_in_an_import():
    """Lazy imports inside functions escape the probe above until called: read every import statement."""
    import ast
    offenders = []
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            offenders += [f"{path.relative_to(ROOT.parent)}: {n}" for n in names if n.split(".")[0] in NOT_SHIPPED]
    assert offenders == []
