"""Put a live rank back in the state a fresh process has, between two test bodies run on it.

A pooled rank (:mod:`lab.testing.pool`) runs many bodies in one process. What one body leaves in
module globals must not reach the next: DeepSpeed's process-group caches (``deepspeed.utils.groups``),
its comm backend (``deepspeed.comm.comm.cdb``), its activation-checkpointing RNG tracker and mpu, its
accelerator object (tests patch ``is_fp16_supported``), mtds's collective tracer wrappers on
``torch.distributed``, torch's default dtype/device, RNG streams, grad mode, thread count; the
environment, working directory, signal handlers, logging handlers and warning filters; the process
groups the body created, and the DeepSpeed engines it left alive (their gradient hooks keep them, and
their process groups' threads, past gc: :func:`_release_leaked_engines`).

:class:`ProcessState` is taken once, right after the rank started and imported what it preloads. Rather
than a list of known globals, which silently goes stale when DeepSpeed moves one, it records every
global of every tracked module (``mtds.*``, ``deepspeed.*``, ``torch.distributed*``): the binding, and
for mutable containers and for instances of tracked classes one level of contents (a tracker's
``states_`` dict, a registry dict); likewise the attributes of the classes those modules define. A
restore rebinds what was rebound, refills what was filled, deletes what was added. Modules first
imported by a body are recorded after it (their state from that body persists; the pool imports every mtds module first, which keeps
that set small and the pool reports it).
"""
from __future__ import annotations

import copy
import gc
import logging
import os
import random
import signal
import sys
import threading
import warnings
import weakref
from types import ModuleType

import torch

TRACKED_PREFIXES = ("mtds", "deepspeed")
# Only the functions bound in these: the collective tracer wraps torch.distributed's in place, and
# DeepSpeed's ZeRO-3 replaces ``torch.nn.functional.linear`` for the life of the process ("This will
# persist unless manually reset"), zero.Init torch's tensor factories and ``Tensor.__new__`` while it is
# open -- a body after a ZeRO-3 one would otherwise run another linear backward. Nothing else: torch
# keeps its group registry in module globals there (``_group_count`` and friends), and a counter put
# back would name the next body's groups like the last one's, whose rendezvous keys are still in the
# store -- the new groups would then pair with dead ones and hang.
BINDINGS_ONLY = ("torch.distributed", "torch.distributed.distributed_c10d", "torch", "torch.nn.functional")
PATCHABLE_CLASSES = (torch.Tensor, torch.nn.Module, torch.nn.Parameter)
_CONTAINERS = (dict, list, set)
_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR2, signal.SIGALRM)
_MISSING = object()


def _tracked(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in TRACKED_PREFIXES)


def _copy(value):
    if not isinstance(value, _CONTAINERS):
        return _MISSING
    try:
        return copy.copy(value)        # dict subclasses too (OrderedDict, defaultdict)
    except Exception:                  # a container type that cannot be copied: its binding still is
        return _MISSING


def _put_back(current, saved) -> None:
    """Refill ``current`` (the same container object) with ``saved``'s items, in place."""
    if _unchanged(current, saved):
        return
    current.clear()
    if isinstance(current, list):
        current.extend(saved)
    else:
        current.update(saved)


def _unchanged(current, saved) -> bool:
    """By identity (a container of tensors has no usable ``==``)."""
    if len(current) != len(saved):
        return False
    if isinstance(current, dict):
        return current.keys() == saved.keys() and all(current[k] is saved[k] for k in saved)
    if isinstance(current, list):
        return all(a is b for a, b in zip(current, saved))
    return {id(x) for x in current} == {id(x) for x in saved}


def _is_tracked_instance(value) -> bool:
    cls = type(value)
    return (not isinstance(value, (type, ModuleType)) and _tracked(getattr(cls, "__module__", "") or "")
            and isinstance(getattr(value, "__dict__", None), dict))


class _Namespace:
    """One namespace (a module's globals, a class's or an instance's attributes): bindings and one level
    of container contents."""

    def __init__(self, target, items: dict, contents: bool = True, only_these: bool = False):
        self.target = target
        self.only_these = only_these     # put back these bindings only; leave the namespace's others alone
        self.bindings = dict(items)
        self.contents = {k: c for k, v in items.items() if (c := _copy(v)) is not _MISSING} if contents else {}

    def restore(self, current: dict, set_attr, del_attr, problems: list[str]) -> None:
        # A submodule imported by the body is bound on its package: it stays (``import a.b`` does not
        # bind it again once it is in sys.modules).
        added = [] if self.only_these else [k for k in current if k not in self.bindings]
        for key in [k for k in added if not isinstance(current[k], ModuleType)]:
            self._apply(problems, key, del_attr, key)
        for key, value in self.bindings.items():
            if current.get(key, _MISSING) is not value:
                self._apply(problems, key, set_attr, key, value)
        for key, saved in self.contents.items():
            _put_back(self.bindings[key], saved)

    def _apply(self, problems: list[str], key: str, action, *args) -> None:
        try:
            action(*args)
        except (AttributeError, TypeError) as err:
            problems.append(f"{getattr(self.target, '__name__', type(self.target).__name__)}.{key}: {err}")


class ProcessState:
    """What a fresh rank looks like (see the module docstring); ``restore()`` goes back to it."""

    def __init__(self):
        self.namespaces: list[_Namespace] = []
        self.seen_modules: set[str] = set()
        self._record_torch()
        self._record_new_modules()
        self.default_dtype = torch.get_default_dtype()
        self.default_device = _default_device()
        self.grad_enabled = torch.is_grad_enabled()
        self.threads = torch.get_num_threads()
        self.deterministic = torch.are_deterministic_algorithms_enabled()
        self.torch_rng = torch.random.get_rng_state()
        self.python_rng = random.getstate()
        self.numpy_rng = _numpy_rng_state()
        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.signals = {s: signal.getsignal(s) for s in _SIGNALS}
        self.warning_filters = list(warnings.filters)
        self.loggers = _logger_state()
        self.groups = set(_process_groups())
        self.live_threads = set(threading.enumerate())
        self.os_threads = _os_threads()
        self.kept = weakref.WeakSet(_engine_parts())      # none, so far: a fresh process's, never emptied

    def _record_new_modules(self) -> list[str]:
        new = [n for n, m in list(sys.modules.items()) if _tracked(n) and n not in self.seen_modules
               and isinstance(m, ModuleType)]
        for name in new:
            self.seen_modules.add(name)
            self._record_module(sys.modules[name])
        return new

    def _record_torch(self) -> None:
        """What of torch a body may patch (see BINDINGS_ONLY); torch is imported before any snapshot."""
        import importlib

        import torch.nn.modules.module as module_mod
        for name in BINDINGS_ONLY:
            module = importlib.import_module(name)
            self.namespaces.append(_Namespace(module, _functions(vars(module)), contents=False, only_these=True))
        # hooks on every module (profilers register them)
        self.namespaces.append(_Namespace(module_mod, {k: v for k, v in vars(module_mod).items()
                                                       if k.startswith("_global") and isinstance(v, dict)},
                                          only_these=True))
        for cls in PATCHABLE_CLASSES:     # all of their own attributes: what is added goes again
            self.namespaces.append(_Namespace(cls, _class_attributes(cls), contents=False))

    def _record_module(self, module: ModuleType) -> None:
        items = dict(vars(module))
        self.namespaces.append(_Namespace(module, items))
        for value in items.values():
            if isinstance(value, type) and value.__module__ == module.__name__:
                self.namespaces.append(_Namespace(value, _class_attributes(value)))
            elif _is_tracked_instance(value):
                self.namespaces.append(_Namespace(value, vars(value)))

    def restore(self) -> tuple[list[str], list[str]]:
        """Undo what the last body changed. Returns the tracked modules the body imported first (recorded
        now, as it left them) and the attributes that could not be put back."""
        self._destroy_new_groups()
        problems: list[str] = []
        for ns in self.namespaces:
            target = ns.target
            if isinstance(target, ModuleType):
                ns.restore(vars(target), lambda k, v, t=target: setattr(t, k, v),
                           lambda k, t=target: delattr(t, k), problems)
            elif isinstance(target, type):
                ns.restore(_class_attributes(target), lambda k, v, t=target: setattr(t, k, v), lambda k, t=target: delattr(t, k),
                           problems)
            else:
                d = vars(target)
                ns.restore(d, d.__setitem__, d.__delitem__, problems)
        torch.set_default_dtype(self.default_dtype)
        if _default_device() != self.default_device:
            # Only when it changed: setting one (even "cpu") puts a Python mode around every torch op.
            torch.set_default_device(self.default_device)
        torch.set_grad_enabled(self.grad_enabled)
        torch.set_num_threads(self.threads)
        torch.use_deterministic_algorithms(self.deterministic)
        torch.autograd.set_detect_anomaly(False)
        if "torch._dynamo" in sys.modules:
            # Dynamo's cached code calls the graphs it put in the compiled function's module globals
            # (__compiled_fn_*), which the restore above deleted: a fresh process has no such cache either
            sys.modules["torch._dynamo"].reset()
        torch.random.set_rng_state(self.torch_rng)
        random.setstate(self.python_rng)
        _set_numpy_rng_state(self.numpy_rng)
        if os.environ != self.environ:
            os.environ.clear()
            os.environ.update(self.environ)
        if os.getcwd() != self.cwd:
            os.chdir(self.cwd)
        for s, handler in self.signals.items():
            if signal.getsignal(s) is not handler and handler is not None:
                signal.signal(s, handler)
        warnings.filters[:] = self.warning_filters
        _restore_loggers(self.loggers)
        gc.collect()
        if _os_threads() > self.os_threads:      # something the body built still holds process groups
            released = _release_leaked_engines(self.kept)
            if released:
                print(f"[pool] reset: emptied {released} DeepSpeed engines/optimizers the body left alive", flush=True)
            # what stays (torch's worker pools, started once; what still leaks) is the next body's baseline
            self.os_threads = _os_threads()
        self.kept = weakref.WeakSet(_engine_parts())      # none, so far: a fresh process's, never emptied
        return self._record_new_modules(), problems

    def leaked_threads(self) -> list[str]:
        """Non-daemon threads a body started and left running (a fresh process would not have them)."""
        return [t.name for t in threading.enumerate()
                if t not in self.live_threads and t.is_alive() and not t.daemon]

    def _destroy_new_groups(self) -> None:
        """Destroy the groups the body created, and agree on the next group's name.

        torch names a new group by a per-process counter, and the members rendezvous under that name.
        A body may create a group on some ranks only (``use_local_synchronization``, subgroups), so the
        counters can drift apart; the next body's groups would then rendezvous under different names
        and hang. Every rank moves on to the largest counter (collective on the default group).
        """
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d
        if not dist.is_initialized():
            return
        new = [pg for pg in _process_groups() if pg not in self.groups]
        print(f"[pool] reset: {len(new)} groups to destroy {[c10d._world.pg_names.get(pg) for pg in new]}, "
              f"counter {c10d._world.group_count}", flush=True)
        for pg in new:
            try:
                dist.destroy_process_group(pg)
            except (RuntimeError, ValueError, KeyError):
                pass    # already destroyed by its owner
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        count = torch.tensor([c10d._world.group_count], dtype=torch.int64, device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MAX)
        if int(count.item()) != c10d._world.group_count:
            print(f"[pool] group counter {c10d._world.group_count} -> {int(count.item())} (the body created "
                  f"groups on some ranks only)", flush=True)
        c10d._world.group_count = int(count.item())


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _engine_parts() -> list:
    """The live objects :func:`_release_leaked_engines` empties."""
    try:
        from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer
        from deepspeed.runtime.engine import DeepSpeedEngine
        from deepspeed.runtime.zero.parameter_offload import DeepSpeedZeRoOffload
    except ImportError:
        return []
    kinds = (DeepSpeedEngine, DeepSpeedOptimizer, torch.optim.Optimizer, DeepSpeedZeRoOffload)
    # type(), not isinstance(): no __class__ lookup on arbitrary objects (lazy proxies, deprecated aliases).
    # Parameters too: DeepSpeed puts its process groups on them (ZeRO-1/2's _dp_group) and its hooks close
    # over them; and mtds's and DeepSpeed's modules (ZeRO-3's hooks keep a model's layers, with their TP groups).
    return [o for o in gc.get_objects() if issubclass(type(o), kinds)
            or (issubclass(type(o), torch.nn.Parameter) and vars(o))
            or (issubclass(type(o), torch.nn.Module) and _tracked(type(o).__module__))]


def _release_leaked_engines(kept) -> int:
    """Empty (the attributes of) every DeepSpeed engine, optimizer, ZeRO-3 offload manager, parameter and
    mtds/DeepSpeed module still alive after the body, but those in ``kept`` (alive when the rank started).

    Gradient hooks, and DeepSpeed's hooks on the loss and on ZeRO-3's module outputs, refer back to their
    engine from inside autograd: a reference cycle through C++ that gc cannot see, so an engine a body did
    not release (mtds.training.run takes its gradient hooks off, not the others) outlives the body with
    its process groups -- three gloo threads each -- and tensors. Emptying the Python side lets the rest
    go; the hooks are left holding empty shells. Returns how many objects were emptied."""
    leaked = [o for o in _engine_parts() if o not in kept]
    for obj in leaked:
        vars(obj).clear()
    count = len(leaked)
    leaked = obj = None
    gc.collect()
    return count


def _default_device():
    """The default device a body set, or None (torch's own default, with no mode installed)."""
    import torch.utils._device
    return torch.utils._device.CURRENT_DEVICE


def _class_attributes(cls: type) -> dict:
    """A class's own attributes, less the descriptors every class has for its instances' dicts."""
    return {k: v for k, v in vars(cls).items() if k not in ("__dict__", "__weakref__")}


def _functions(namespace) -> dict:
    """The callables bound in a namespace (functions, builtins, method descriptors), not its classes."""
    return {k: v for k, v in namespace.items() if callable(v) and not isinstance(v, type)
            and k not in ("__dict__", "__weakref__")}


def _process_groups() -> list:
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    if not dist.is_available() or not dist.is_initialized():
        return []
    return list(c10d._world.pg_map.keys())


def _logger_state() -> dict:
    loggers = [logging.getLogger()] + [lg for lg in logging.Logger.manager.loggerDict.values()
                                       if isinstance(lg, logging.Logger)]
    return {lg: (lg.level, list(lg.handlers), lg.propagate, lg.disabled) for lg in loggers}


def _restore_loggers(saved: dict) -> None:
    for lg, (level, handlers, propagate, disabled) in saved.items():
        lg.setLevel(level)
        for h in [h for h in lg.handlers if h not in handlers]:
            lg.removeHandler(h)
            h.close()
        lg.handlers[:] = handlers
        lg.propagate, lg.disabled = propagate, disabled
    for lg in logging.Logger.manager.loggerDict.values():
        if isinstance(lg, logging.Logger) and lg not in saved:
            for h in list(lg.handlers):   # a logger created by the body: drop what it holds open
                lg.removeHandler(h)
                h.close()


def _numpy_rng_state():
    np = sys.modules.get("numpy")
    return np.random.get_state() if np is not None else None


def _set_numpy_rng_state(state) -> None:
    np = sys.modules.get("numpy")
    if np is not None and state is not None:
        np.random.set_state(state)
