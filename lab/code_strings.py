"""Megatron-core on CPU: its code names 'cuda' (and CUDA tensor types) as string constants; these rewrite
those constants in the code objects of one module's functions and methods. Megatron's code only: nothing of
torch is touched. Used by lab/megatron_gpt.py (0.16) and lab/megatron_lm.py (0.19)."""
from __future__ import annotations

CUDA_TO_CPU = {"cuda": "cpu"}


def swap_strings(code, table: dict[str, str]):
    consts = tuple(table.get(c, c) if isinstance(c, str) else swap_strings(c, table) if hasattr(c, "co_consts")
                   else c for c in code.co_consts)
    return code.replace(co_consts=consts) if consts != code.co_consts else code


def rewrite_module(module, table: dict[str, str] = CUDA_TO_CPU) -> None:
    """Every function and method defined in ``module`` (unwrapped) gets ``table``'s strings swapped."""
    for obj in list(vars(module).values()):
        if getattr(obj, "__module__", None) != module.__name__:
            continue
        fns = [obj] if callable(obj) and hasattr(obj, "__code__") else \
            [getattr(a, "__func__", a) for a in vars(obj).values()] if isinstance(obj, type) else []
        for fn in fns:
            fn = getattr(fn, "__wrapped__", fn)
            if hasattr(fn, "__code__"):
                fn.__code__ = swap_strings(fn.__code__, table)
