"""Enumerate layouts for a model on a cluster, predict each, and rank the feasible ones.

Any knob the caller fixes (tp, pp, dp, microbatch, virtual_stages, zero_stage, recompute,
sequence_parallel) is held; the others range over every value that can work:
  t  divides the GPU count, the head count and the node size (TP across nodes is never
     competitive: its all-reduces would run over InfiniBand, PTD-P takeaway #1; a t that does not
     divide the node size would make some tensor groups straddle two nodes);
  p  divides n/t and the layer count; d = n/(t p);
  b  divides B/d (up to `max_microbatch`);  v divides l/p (v > 1 only with p > 1);
  ZeRO 0-3 (2-3 only with p = 1, DeepSpeed), recompute none/selective/full, SP on/off (t > 1).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from mtds.plan.candidate import RECOMPUTE_CHOICES, Layout, Workload
from mtds.plan.hardware import Cluster
from mtds.plan.memory import GIB, predict_memory
from mtds.plan.model_spec import ModelSpec
from mtds.plan.predict import Prediction, predict, structural_problems

KNOBS = ("tp", "pp", "dp", "microbatch", "virtual_stages", "zero_stage", "recompute", "sequence_parallel")


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


@dataclass
class PlanResult:
    """Feasible predictions ranked by step time, and infeasible layouts with reasons."""

    feasible: list = field(default_factory=list)
    infeasible: list = field(default_factory=list)   # (Layout, [reasons]) pairs

    @property
    def best(self) -> Prediction | None:
        return self.feasible[0] if self.feasible else None


def candidate_layouts(model: ModelSpec, work: Workload, cluster: Cluster, fixed: dict, max_microbatch: int = 64):
    """Yield every Layout consistent with the fixed knobs (structural checks come later)."""
    n = cluster.gpus
    # t divides the node size so that no tensor-parallel group straddles two nodes (with rank
    # order t innermost, t=6 on 8-GPU nodes would put ranks 6-11 on two nodes, over InfiniBand)
    tps = [fixed["tp"]] if fixed.get("tp") else [t for t in _divisors(n) if cluster.per_node % t == 0
                                                   and model.heads % t == 0]
    for t in tps:
        pps = [fixed["pp"]] if fixed.get("pp") else [p for p in _divisors(n // t) if model.layers % p == 0] if n % t == 0 else []
        for p in pps:
            d = fixed.get("dp") or max(1, n // (t * p))
            per_pipe = work.global_batch // d if work.global_batch % d == 0 else 0
            if fixed.get("microbatch"):
                bs = [fixed["microbatch"]]
            else:
                bs = [b for b in _divisors(per_pipe) if b <= max_microbatch] if per_pipe else []
            vs = [fixed["virtual_stages"]] if fixed.get("virtual_stages") else (
                _divisors(model.layers // p) if p > 1 and model.layers % p == 0 else [1])
            zs = [fixed["zero_stage"]] if fixed.get("zero_stage") is not None else (
                [0] if d == 1 else [0, 1] if p > 1 else [0, 1, 2, 3])
            rs = [fixed["recompute"]] if fixed.get("recompute") else list(RECOMPUTE_CHOICES)
            sps = [fixed["sequence_parallel"]] if fixed.get("sequence_parallel") is not None else (
                [False, True] if t > 1 else [False])
            for b in bs:
                for v in vs:
                    for z in zs:
                        for r in rs:
                            for sp in sps:
                                yield Layout(t, p, d, b, v, z, r, sp)


def plan(model: ModelSpec, work: Workload, cluster: Cluster, *, max_microbatch: int = 64,
         keep_infeasible: bool = False, **fixed) -> PlanResult:
    """Predict every candidate layout; rank feasible ones by step time (then memory)."""
    unknown = set(fixed) - set(KNOBS)
    if unknown:
        raise TypeError(f"unknown layout knobs: {sorted(unknown)}")
    fixed = {k: v for k, v in fixed.items() if v is not None}
    result = PlanResult()
    for layout in candidate_layouts(model, work, cluster, fixed, max_microbatch):
        problems = structural_problems(model, layout, work, cluster)
        if problems:
            if keep_infeasible:
                result.infeasible.append((layout, problems))
            continue
        # cheap memory screen before timing
        mem = predict_memory(model, layout, work, cluster)
        if mem.total > cluster.gpu.hbm_gib * GIB:
            if keep_infeasible:
                result.infeasible.append((layout, [f"needs {mem.total / GIB:.1f} GiB per GPU > "
                                                   f"{cluster.gpu.hbm_gib:.0f} GiB"]))
            continue
        result.feasible.append(predict(model, layout, work, cluster))
    result.feasible.sort(key=lambda pr: (pr.step_time_s, pr.memory.total))
    return result


def evaluate(model: ModelSpec, work: Workload, cluster: Cluster, **fixed) -> Prediction:
    """Predict one layout; knobs left as None are chosen by the planner (fastest feasible).

    If no completion of the given knobs is feasible, the fastest infeasible one is returned
    with its reasons (fits=False / feasible=False), so a user still sees the numbers.
    """
    result = plan(model, work, cluster, **fixed)
    if result.best is not None:
        return result.best
    fixed = {k: v for k, v in fixed.items() if v is not None}
    tried = [predict(model, lay, work, cluster) for lay in candidate_layouts(model, work, cluster, fixed)]
    if not tried:
        # nothing to enumerate (e.g. non-divisible sizes): build the literal layout
        t, p = fixed.get("tp", 1), fixed.get("pp", 1)
        lay = Layout(t, p, fixed.get("dp") or max(1, cluster.gpus // (t * p)), fixed.get("microbatch", 1),
                     fixed.get("virtual_stages", 1), fixed.get("zero_stage", 0),
                     fixed.get("recompute", "full"), fixed.get("sequence_parallel", False))
        return predict(model, lay, work, cluster)
    return min(tried, key=lambda pr: (len(pr.reasons), pr.step_time_s))
