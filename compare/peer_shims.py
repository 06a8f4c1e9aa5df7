"""What Megatron-core and torchtitan need to run on CPU ranks with gloo, applied in the peer's own process
(compare/peer_entry.py) and listed in every result (``PATCHES``): nothing in site-packages is edited.
Imported only by peer_entry.py, in the peers' interpreter."""
from __future__ import annotations

import importlib
import importlib.util
import sys
import types

PATCHES: list[str] = []


def _have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _stub(name: str, **attrs) -> None:
    """An import-time-only module (MoE kernels importing triton), never called by a dense model."""
    m = types.ModuleType(name)
    m.__path__ = []
    m.__dict__.update(attrs)
    sys.modules[name] = m


def _cpu_strings(module) -> int:
    """'cuda' -> 'cpu' (and torch.cuda tensor type names) in the constants of the module's functions."""
    swap = {"cuda": "cpu", "torch.cuda.FloatTensor": "torch.FloatTensor"}

    def fixed(code):
        consts = tuple(swap.get(c, c) if isinstance(c, str) else (fixed(c) if hasattr(c, "co_consts") else c)
                       for c in code.co_consts)
        return code.replace(co_consts=consts) if consts != code.co_consts else code

    n, funcs = 0, []
    for obj in vars(module).values():
        if getattr(obj, "__module__", None) != module.__name__:
            continue
        if isinstance(obj, type):
            for a in vars(obj).values():
                funcs += [a, getattr(a, "__func__", None), getattr(a, "fget", None)]
        else:
            funcs.append(obj)
    for fn in filter(None, funcs):
        fn = getattr(fn, "__wrapped__", fn)
        if hasattr(fn, "__code__"):
            new = fixed(fn.__code__)
            if new is not fn.__code__:
                fn.__code__, n = new, n + 1
    return n


def megatron_cpu_shims() -> None:
    import torch
    if not _have("triton"):
        _stub("megatron.core.transformer.moe.ops.paged_stash", GLOBAL_BLOCK_SIZE=1024,
              paged_stash_copy_kernel=None, paged_stash_pop_kernel=None)
        PATCHES.append("stub megatron.core.transformer.moe.ops.paged_stash (MoE-only, imports triton)")
    if torch.cuda.is_available():
        return
    from megatron.core.tensor_parallel import random as mrandom
    torch.cuda.manual_seed = torch.manual_seed
    torch.cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda new_state, *a, **k: torch.set_rng_state(new_state)
    PATCHES.append("CUDA RNG (torch.cuda.manual_seed/get_rng_state, tensor_parallel.random) -> CPU RNG")
    torch.cuda.current_device = lambda: torch.device("cpu")
    PATCHES.append("torch.cuda.current_device -> cpu (buffers, DDP grad buffers)")

    class NoStream:
        def wait_event(self, *a, **k): pass
        def wait_stream(self, *a, **k): pass
        def synchronize(self): pass
    torch.cuda.current_stream = lambda device=None: NoStream()
    torch.cuda.synchronize = lambda device=None: None
    PATCHES.append("torch.cuda.current_stream / synchronize -> no-ops")
    torch.Tensor.cuda = lambda self, *a, **k: self
    PATCHES.append("Tensor.cuda() -> identity (tied-embedding all-reduce at pp > 1)")
    counts = {name: _cpu_strings(importlib.import_module(f"megatron.core.{name}"))
              for name in ("optimizer.optimizer", "optimizer.clip_grads", "optimizer.distrib_optimizer",
                           "pipeline_parallel.schedules", "transformer.utils", "utils",
                           "distributed.param_and_grad_buffer")}
    PATCHES.append(f"string constants 'cuda' -> 'cpu' in functions of {counts}")


def torchtitan_cpu_shims() -> None:
    import torch
    if not _have("triton"):
        missing = dict(combine_op=None, dispatch_op=None, init_buffer=None,
                       maybe_update_minimal_async_ep_config=lambda *a, **k: None,
                       MinimalAsyncEPDispatchMetadata=type("MinimalAsyncEPDispatchMetadata", (), {}))
        _stub("torchtitan.distributed.minimal_async_ep", **missing)
        _stub("torchtitan.distributed.minimal_async_ep.api", **missing)
        PATCHES.append("stub torchtitan.distributed.minimal_async_ep (MoE expert parallel only, imports triton)")
    if torch.cuda.is_available():
        return
    import torchtitan.distributed.parallel_dims as tpd
    import torchtitan.distributed.utils as tdu
    import torchtitan.tools.utils as tu
    tu.device_type, tu.device_module = "cpu", torch.cpu
    tpd.device_type = "cpu"
    tdu.device_type, tdu.device_module = "cpu", torch.cpu
    PATCHES.append("torchtitan device_type 'cuda' -> 'cpu' (tools.utils, distributed.parallel_dims, distributed.utils)")
