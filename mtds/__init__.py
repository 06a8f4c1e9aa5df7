"""mtds: Megatron-style tensor parallelism layered on DeepSpeed (PTD-P: tensor x pipeline x data)."""
from __future__ import annotations

import importlib

__version__ = "0.1.0"


def lazy_exports(package: str, homes: dict[str, str]):
    """``(__getattr__, __dir__)`` for a package whose names live in submodules, imported on first use
    (PEP 562): ``homes`` maps each exported name to its submodule. mtds.data, mtds.model and mtds.hf use it so
    that their light parts (indexed data for preprocess workers, the model config and preset resolution for
    the planner) need no torch, datasets or transformers."""
    def __getattr__(name):
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{homes[name]}"), name)
        setattr(importlib.import_module(package), name, value)
        return value

    def __dir__():
        return sorted(set(vars(importlib.import_module(package))) | set(homes))

    return __getattr__, __dir__
