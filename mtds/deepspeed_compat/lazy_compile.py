"""DeepSpeed decorates a few functions with ``@compiler.compile()`` as their module is imported: Muon's update
(deepspeed/runtime/zero/muon/original_muon.py), imported by every ZeRO optimizer's set-up only to ask
``isinstance(optimizer, MuonWithAuxAdam)``. ``torch.compile(fn)`` loads Inductor right there: ~0.75 CPU-s per
rank at start-up, for functions a run without Muon never calls. :func:`defer_compile_decorators` makes the
decorator compile at the function's first call instead: the same compiled function, later. Decorators already
applied (modules imported before) are left as they are.

Checked against DeepSpeed 0.19.8 (``compile()`` returning ``torch.compile``). Not a capability: where a
DeepSpeed lacks ``compiler.compile`` nothing is deferred and nothing else changes.
"""
from __future__ import annotations

import functools


def _deferred(compile_fn):
    """A ``compile()`` whose decorator calls ``compile_fn(fn)`` on the first call of ``fn``."""
    def compile():
        def decorate(fn):
            compiled = None

            @functools.wraps(fn)
            def first_call_compiles(*args, **kwargs):
                nonlocal compiled
                if compiled is None:
                    compiled = compile_fn(fn)
                return compiled(*args, **kwargs)
            return first_call_compiles
        return decorate
    compile.mtds_deferred = True
    return compile


def defer_compile_decorators() -> None:
    """Replace ``deepspeed.runtime.compiler.compile`` (idempotent)."""
    import torch
    from deepspeed.runtime import compiler
    current = getattr(compiler, "compile", None)
    if current is None or getattr(current, "mtds_deferred", False) or not hasattr(torch, "compile"):
        return
    compiler.compile = _deferred(torch.compile)
