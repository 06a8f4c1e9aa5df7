"""Model-state bytes per rank: measured from the tensors a DeepSpeed engine and its optimizer hold, and
the ZeRO paper's formulas (Rajbhandari et al. 2020, Section 5) for the same stage and precision.

Measured: every tensor reachable from the module's parameters (ZeRO-3: their ``ds_tensor`` partitions,
plus the full data of parameters DeepSpeed keeps gathered), their gradients, the wrapped torch
optimizer's parameters and state, and the tensors held in the DeepSpeed optimizer's attributes, each
storage counted once (DeepSpeed points parameters into flat buffers; a master copy may alias the
parameters). Classified as

  params     the module's parameters and DeepSpeed's low-precision flat/partitioned parameter buffers
  grads      ``.grad`` of those and of the optimizer's parameters, and DeepSpeed's gradient buffers
             (attributes named *grad* or *ipg*: accumulated partitions, reduction buckets)
  optimizer  the torch optimizer's state (Adam: exp_avg, exp_avg_sq) and its parameters where they are
             not the module's, and DeepSpeed's fp32 master partitions (the optimizer's weights)
  other      any other tensor a DeepSpeed optimizer attribute holds (reported, not hidden)

Measured on entry to the optimizer's step from the second step on: gradients of the whole step are
reduced and still held, and Adam's state exists, so this is the model-state peak. Once two steps in a
row hold the same bytes the state is steady and measuring stops: the walk costs about 1 ms of CPU, and
it runs inside the timed step, which the peers' steps do not carry. Activations and
temporary buffers are not model state (peak RSS covers everything).

Formulas, per rank, for Ψ parameters on the rank before ZeRO partitioning and d data-parallel ranks:
bytes per parameter for weights w, gradients g, optimizer K (master copy + Adam's two moments):
mixed precision (fp16/bf16): w = 2, g = 2, K = 12 (the paper's 16Ψ); fp32 as DeepSpeed runs it: w = 4,
g = 4, K = 8 for ZeRO-0 (torch's Adam updates the weights themselves, no copy) and 12 for ZeRO >= 1
(DeepSpeed's ZeRO optimizers keep their own fp32 partition besides the module's weights).
  ZeRO-0: (w + g + K) Ψ     ZeRO-1: (w + g) Ψ + K Ψ / d     ZeRO-2: w Ψ + (g + K) Ψ / d
  ZeRO-3: (w + g + K) Ψ / d + w Ψp   (Ψp: parameters DeepSpeed keeps whole, below
          zero_optimization.stage3_param_persistence_threshold, 1e5 elements by default)
"""
from __future__ import annotations

BUCKETS = ("params", "grads", "optimizer", "other")
# DeepSpeed's fp32 master partitions (outside its step ZeRO-3 leaves the torch optimizer's groups empty)
_MASTER_ATTRS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat", "fp32_groups_flat")
_PARAM_ATTRS = ("bit16_groups_flat", "fp16_partitioned_groups_flat", "lp_param_buffer",
                "parallel_partitioned_bit16_groups", "fp16_groups_flat")


def _tensors(obj, depth: int = 0):
    import torch
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 3 and isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o, depth + 1)
    elif depth < 3 and isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o, depth + 1)


def inner_optimizer(optimizer):
    """The torch optimizer inside DeepSpeed's wrappers (ZeRO, fp16/bf16), or the optimizer itself."""
    seen = set()
    while hasattr(optimizer, "optimizer") and id(optimizer) not in seen:
        seen.add(id(optimizer))
        optimizer = optimizer.optimizer
    return optimizer


def measure(module, optimizer) -> dict:
    """{"params": B, "grads": B, "optimizer": B, "other": B, "psi": Ψ} for this rank (see module doc).
    Ψ is the rank's parameter count before ZeRO partitioning (ZeRO-3: ds_numel)."""
    out = dict.fromkeys(BUCKETS, 0)
    seen: set[int] = set()

    other_names: list[str] = []

    def add(bucket: str, tensors, name: str | None = None) -> None:
        for t in tensors:
            if t is None or t.numel() == 0 or t.device.type == "meta":    # meta: shape only, no memory
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() in seen or storage.nbytes() == 0:
                continue
            seen.add(storage.data_ptr())
            out[bucket] += storage.nbytes()
            if name and name not in other_names:
                other_names.append(f"{bucket}:{name}")

    params = list(module.parameters())
    wrapper, inner = optimizer, inner_optimizer(optimizer)
    inner_params = [p for g in getattr(inner, "param_groups", ()) for p in g["params"]]
    own = vars(wrapper) if wrapper is not inner and hasattr(wrapper, "__dict__") else {}
    add("params", (getattr(p, "ds_tensor", None) for p in params))
    add("params", params)
    for name in _PARAM_ATTRS:
        add("params", _tensors(own.get(name)))
    add("grads", (p.grad for p in params + inner_params))
    for name, value in own.items():
        if "grad" in name.lower() or "ipg" in name.lower():
            add("grads", _tensors(value), name)
    add("optimizer", (t for state in getattr(inner, "state", {}).values() for t in _tensors(state)))
    add("optimizer", inner_params)
    for name in _MASTER_ATTRS:
        add("optimizer", _tensors(own.get(name)))
    for name, value in own.items():
        if name not in ("optimizer", "param_groups", "state"):
            add("other", _tensors(value), name)
    out["sources"] = other_names        # DeepSpeed optimizer attributes that held grads / other tensors
    out["psi"] = sum(getattr(p, "ds_numel", p.numel()) for p in params)
    # ZeRO-3 keeps parameters below param_persistence_threshold gathered on every rank (besides their
    # partition): that many weights are held whole.
    out["psi_persistent"] = sum(p.ds_numel for p in params if getattr(p, "ds_persist", False))
    return out


def bytes_per_param(precision: str, zero: int) -> tuple[int, int, int]:
    """(weights, gradients, optimizer states) bytes per parameter, see the module docstring."""
    if precision == "fp32":
        return 4, 4, 8 if zero == 0 else 12
    return 2, 2, 12


def formula(precision: str, zero: int, psi: float, d: int, persistent: float = 0) -> dict:
    """The ZeRO formula per rank: {"params", "grads", "optimizer", "total", "label"}; ZeRO-3 adds the
    `persistent` parameters DeepSpeed keeps whole on every rank (w bytes each, "+ wΨp")."""
    w, g, k = bytes_per_param(precision, zero)
    div = {"params": d if zero >= 3 else 1, "grads": d if zero >= 2 else 1, "optimizer": d if zero >= 1 else 1}
    persistent = persistent if zero >= 3 else 0
    out = {"params": w * psi / div["params"] + w * persistent, "grads": g * psi / div["grads"],
           "optimizer": k * psi / div["optimizer"]}
    out["total"] = sum(out.values())
    full = [f"{c}Ψ" for c, key in ((w, "params"), (g, "grads"), (k, "optimizer")) if div[key] == 1]
    part = [f"{c}" for c, key in ((w, "params"), (g, "grads"), (k, "optimizer")) if div[key] != 1]
    terms = []
    if full:
        terms.append(f"{sum(int(t[:-1]) for t in full)}Ψ")
    if part:
        terms.append(f"{sum(int(t) for t in part)}Ψ/d")
    if persistent:
        terms.append(f"{w}Ψp")
    out["label"] = f"ZeRO-{zero} {precision}: " + " + ".join(terms)
    return out


class StateProbe:
    """Wraps an engine's optimizer step: ``measure`` on entry from the second call on, until two calls in a
    row measure the same total; keeps the largest total."""

    def __init__(self) -> None:
        self.calls = 0
        self.peak: dict | None = None
        self.last_total: int | None = None
        self.steady = False

    def install(self, engine) -> "StateProbe":
        optimizer = engine.optimizer
        step = optimizer.step
        probe = self

        def measured_step(*args, **kwargs):
            probe.calls += 1
            if probe.calls >= 2 and not probe.steady:
                m = measure(engine.module, optimizer)
                total = sum(m[b] for b in BUCKETS)
                if probe.peak is None or total > sum(probe.peak[b] for b in BUCKETS):
                    probe.peak = m
                probe.steady, probe.last_total = total == probe.last_total, total
            return step(*args, **kwargs)

        optimizer.step = measured_step     # instance attribute: DeepSpeed calls self.optimizer.step()
        return self
