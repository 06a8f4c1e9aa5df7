"""mtds's one boundary to DeepSpeed's internals (``mtds/deepspeed_compat/``): nothing outside it uses a
private or undocumented DeepSpeed name, and a DeepSpeed that lacks one -- or stops calling a method mtds
replaces -- ends the run with one ``error:`` line instead of a silently wrong number."""
from __future__ import annotations

import ast
import functools
import importlib.util
import os
import re

import pytest

from lab.testing import spawn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BOUNDARY = os.path.join("mtds", "deepspeed_compat")
# DeepSpeed's subpackages whose private names mtds could reach (all it imports from).
DS_PACKAGES = ("runtime", "pipe", "checkpoint", "utils", "comm", "accelerator", "ops/adam", "__init__.py")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


@functools.lru_cache(maxsize=None)
def deepspeed_private_names() -> frozenset[str]:
    """Every ``_name`` DeepSpeed defines: functions, classes, attributes assigned, module globals."""
    root = importlib.util.find_spec("deepspeed").submodule_search_locations[0]
    names = set()
    for sub in DS_PACKAGES:
        path = os.path.join(root, sub)
        files = [path] if path.endswith(".py") else [os.path.join(d, f) for d, _, fs in os.walk(path)
                                                     for f in fs if f.endswith(".py")]
        for file in files:
            with open(file) as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    name = node.name
                elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                    name = node.attr
                elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                    name = node.id
                else:
                    continue
                if _private(name):
                    names.add(name)
    return frozenset(names)


def undocumented_names() -> frozenset[str]:
    """The public-looking but undocumented DeepSpeed names the boundary registers (its capabilities)."""
    from mtds.deepspeed_compat import CAPABILITIES
    return frozenset(part for cap in CAPABILITIES for t in cap.targets for part in t.attr.split(".")
                     if not part.startswith("_"))


def _mtds_files():
    for d, _, files in os.walk(os.path.join(ROOT, "mtds")):
        rel = os.path.relpath(d, ROOT)
        if rel == BOUNDARY or rel.startswith(BOUNDARY + os.sep):
            continue
        for f in files:
            if f.endswith(".py"):
                yield os.path.join(d, f)


def _deepspeed_import_names(tree) -> tuple[set[str], set[str]]:
    """Names bound by ``import deepspeed...`` / ``from deepspeed... import``, and by other imports."""
    ds, other = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                (ds if a.name.split(".")[0] == "deepspeed" else other).add((a.asname or a.name).split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            target = ds if (node.module or "").split(".")[0] == "deepspeed" else other
            target.update(a.asname or a.name for a in node.names)
    return ds, other


def _subclasses_deepspeed(node: ast.ClassDef, ds_names: set[str]) -> bool:
    return any(isinstance(b, ast.Name) and b.id in ds_names or
               isinstance(b, ast.Attribute) and ast.unparse(b).split(".")[0] in ds_names for b in node.bases)


def _own_private_names(tree) -> set[str]:
    """``_x`` that mtds code defines itself: functions, and methods/attributes of classes that do not
    subclass DeepSpeed."""
    ds_names, _ = _deepspeed_import_names(tree)
    own = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and _subclasses_deepspeed(node, ds_names):
            continue
        if isinstance(node, ast.ClassDef):
            for item in ast.walk(node):
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(item.name):
                    own.add(item.name)
                elif isinstance(item, ast.Attribute) and isinstance(item.ctx, ast.Store) and _private(item.attr):
                    own.add(item.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(node.name):
            own.add(node.name)
    return own


def violations_in(source: str, filename: str, private: frozenset[str], undocumented: frozenset[str],
                  own: frozenset[str] = frozenset()) -> list[str]:
    """Uses of DeepSpeed internals in one file outside the boundary:
    - ``from deepspeed... import _x``, and a class subclassing a DeepSpeed class that defines ``_x``;
    - ``obj._x`` where DeepSpeed defines ``_x``, unless it is the file's own ``_x`` (defined or assigned
      on ``self`` by a class of this file that does not subclass DeepSpeed) or ``obj`` is a non-DeepSpeed
      import (``os._exit``); also ``getattr(obj, "_x")``;
    - ``obj.y`` where ``y`` is an undocumented name the boundary registers."""
    tree = ast.parse(source)
    ds_names, other_imports = _deepspeed_import_names(tree)
    own, found = set(own) | _own_private_names(tree), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and _subclasses_deepspeed(node, ds_names):
            found += [f"{filename}:{item.lineno}: {node.name} overrides DeepSpeed's {item.name}"
                      for item in ast.walk(node) if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
                      and _private(item.name) and item.name in private]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "deepspeed":
            found += [f"{filename}:{node.lineno}: imports {node.module}.{a.name}" for a in node.names
                      if _private(a.name)]
        elif isinstance(node, ast.Attribute):
            base = ast.unparse(node.value)
            if node.attr in private and node.attr not in own and base.split(".")[0] not in other_imports:
                found.append(f"{filename}:{node.lineno}: {base}.{node.attr}")
            elif node.attr in undocumented and base.split(".")[0] not in other_imports:
                found.append(f"{filename}:{node.lineno}: {base}.{node.attr} (undocumented)")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("getattr", "setattr", "hasattr") and len(node.args) >= 2 and \
                isinstance(node.args[1], ast.Constant) and node.args[1].value in private | undocumented and \
                node.args[1].value not in own:
            found.append(f"{filename}:{node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
    return found


def test_no_deepspeed_internals_outside_the_boundary():
    private, undocumented = deepspeed_private_names(), undocumented_names()
    assert {"_exec_reduce_grads", "_take_model_step", "_INSTRUCTION_MAP", "_groups"} <= private
    sources = {}
    for path in _mtds_files():
        with open(path) as f:
            sources[os.path.relpath(path, ROOT)] = f.read()
    # mtds's own private names anywhere (a subclass of an mtds class uses its base's names)
    own = frozenset().union(*(_own_private_names(ast.parse(text)) for text in sources.values()))
    from mtds.deepspeed_compat import CAPABILITIES
    needed = {part for cap in CAPABILITIES for t in cap.targets for part in t.attr.split(".") if _private(part)}
    assert not needed & own, f"mtds defines names the scan must see as DeepSpeed's: {needed & own}"
    found = []
    for name, text in sources.items():
        found += violations_in(text, name, private, undocumented, own)
    assert not found, "DeepSpeed internals used outside mtds/deepspeed_compat:\n" + "\n".join(found)


@pytest.mark.parametrize("snippet, expected", [
    ("def f(engine):\n    engine._take_model_step = None\n", "engine._take_model_step"),
    ("def f(engine):\n    return getattr(engine.optimizer, '_restore_from_bit16_weights', None)\n",
     "'_restore_from_bit16_weights'"),
    ("from deepspeed.utils.zero_to_fp32 import _get_fp32_state_dict_from_zero3_checkpoint\n", "imports"),
    ("from deepspeed.pipe import PipelineModule\nclass M(PipelineModule):\n    def _build(self):\n        pass\n",
     "overrides DeepSpeed's _build"),
    ("def f(engine):\n    engine.optimizer.clear_lp_grads()\n", "clear_lp_grads (undocumented)"),
])
def test_the_scan_sees_each_kind_of_use(snippet, expected):
    """The scan itself, on one line of each kind it must catch (and not on mtds's own private names)."""
    found = violations_in(snippet, "x.py", deepspeed_private_names(), undocumented_names())
    assert any(expected in line for line in found), found
    own = "import os\nclass T:\n    def _build(self):\n        os._exit(0)\n    def g(self):\n        self._build()\n"
    assert violations_in(own, "x.py", deepspeed_private_names(), undocumented_names()) == []


def test_tested_range_is_the_one_pyproject_declares():
    from mtds.deepspeed_compat import TESTED_SPEC, in_tested_range
    with open(os.path.join(ROOT, "pyproject.toml")) as f:
        declared = re.search(r'"(deepspeed[^"]*)"', f.read()).group(1).replace(" ", "")
    assert declared == TESTED_SPEC
    import deepspeed
    assert in_tested_range(deepspeed.__version__)
    assert not in_tested_range("0.20.0") and not in_tested_range("0.18.9+abc") and in_tested_range("0.19.9")


def test_installed_deepspeed_has_every_capability():
    from mtds.deepspeed_compat import CAPABILITIES, check_installed
    check_installed()
    assert len(CAPABILITIES) >= 10


def _start_up_error(cfg) -> str:
    """What train.py prints for this run: the one ``error:`` line (in-process; the check runs before the
    process group exists)."""
    from mtds.training import run
    from mtds.training.cli import user_errors
    with pytest.raises(user_errors()) as caught:
        run(cfg)
    text = str(caught.value).strip()
    assert len(text.splitlines()) == 1, text
    return text


@pytest.mark.parametrize("owner, attr, replacement, says", [
    ("deepspeed.runtime.pipe.engine:PipelineEngine", "_exec_reduce_grads", None, "is missing"),
    ("deepspeed.runtime.engine:DeepSpeedEngine", "_take_model_step", lambda self, lr_kwargs, closure: None,
     "now requires closure"),
    ("deepspeed.runtime.pipe.module:PipelineModule", "_set_bounds", lambda self, first, last: None,
     "has no parameter start, stop"),
    ("deepspeed.runtime.engine:DeepSpeedEngine", "clip_fp32_gradients", None, "is missing"),
])
def test_a_moved_deepspeed_method_is_one_error_line(monkeypatch, owner, attr, replacement, says):
    from mtds.deepspeed_compat import TESTED_SPEC
    from mtds.deepspeed_compat.capabilities import _resolve
    from tests.training_helpers import train_config
    import deepspeed
    cls = _resolve(owner)
    if replacement is None:
        monkeypatch.delattr(cls, attr)
    else:
        monkeypatch.setattr(cls, attr, replacement)
    text = _start_up_error(train_config())
    assert f"DeepSpeed {deepspeed.__version__}: {cls.__name__}.{attr} {says}" in text, text
    assert "mtds needs it to" in text and TESTED_SPEC in text, text


def test_a_deepspeed_method_shadowed_by_mtds_is_reported(monkeypatch):
    """A name of mtds's engine subclass that DeepSpeed has since added to its base class."""
    from deepspeed.runtime.pipe.engine import PipelineEngine

    from mtds.deepspeed_compat import DeepSpeedMismatch
    from mtds.deepspeed_compat.capabilities import check_subclass
    from mtds.pipe.engine import ScheduledPipelineEngine
    check_subclass(ScheduledPipelineEngine, PipelineEngine, ScheduledPipelineEngine.DEEPSPEED_OVERRIDES)
    monkeypatch.setattr(PipelineEngine, "_weight_step", lambda self: None, raising=False)
    with pytest.raises(DeepSpeedMismatch, match="PipelineEngine now defines '_weight_step'"):
        check_subclass(ScheduledPipelineEngine, PipelineEngine, ScheduledPipelineEngine.DEEPSPEED_OVERRIDES)


def _run_with_clipping_moved():
    """DeepSpeed's model step calling its own clipping rather than the engine's attribute (as if it had
    renamed the method mtds replaces): mtds's clipping never runs."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    from mtds.training import run
    from mtds.training.cli import user_errors
    from tests.training_helpers import train_config
    original = DeepSpeedEngine._take_model_step

    def take_model_step(self, lr_kwargs):
        ours = self.__dict__.pop("clip_fp32_gradients", None)
        try:
            return original(self, lr_kwargs)
        finally:
            if ours is not None:
                self.clip_fp32_gradients = ours

    DeepSpeedEngine._take_model_step = take_model_step
    try:
        run(train_config(steps=2, deepspeed_config=_zero0()))
    except user_errors() as err:
        return str(err)
    finally:
        DeepSpeedEngine._take_model_step = original
    return None


def _zero0():
    from tests.training_helpers import ds_config
    return ds_config(zero=0)


def test_a_patch_deepspeed_never_calls_is_reported():
    (text,) = spawn(_run_with_clipping_moved, 1)
    assert text is not None, "a run whose clipping patch never ran finished without an error"
    assert "never called mtds's patch DeepSpeedEngine.clip_fp32_gradients during the first step" in text, text


def test_deepspeed_compile_decorators_compile_at_the_first_call(monkeypatch):
    """DeepSpeed's ``@compiler.compile()`` (Muon's update, imported by every ZeRO optimizer's set-up) would load
    Inductor at import, ~0.75 CPU-s per rank: mtds defers it to the function's first call, which compiles
    once and returns what the function returns."""
    import torch
    from deepspeed.runtime import compiler

    from mtds.deepspeed_compat.lazy_compile import _deferred, defer_compile_decorators
    compiled = []

    def counting_compile(fn):
        compiled.append(fn)
        return fn
    square = _deferred(counting_compile)()(lambda x: x * x)
    assert compiled == []                           # decorating compiles nothing
    assert (square(3), square(4)) == (9, 16) and len(compiled) == 1
    monkeypatch.setattr(compiler, "compile", compiler.compile)     # restored after the test
    defer_compile_decorators()
    defer_compile_decorators()                      # idempotent: not deferred twice
    assert compiler.compile.mtds_deferred and compiler.compile.__closure__[0].cell_contents is torch.compile
