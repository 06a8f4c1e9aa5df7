"""Enumerate layouts for a model on a cluster, predict each, and rank the feasible ones.

Any knob the caller fixes (tp, pp, dp, microbatch, virtual_stages, zero_stage, recompute,
sequence_parallel) is held; the others range over every value that can work:
  t  divides the GPU count, the head count and the node size (TP across nodes is never
     competitive: its all-reduces would run over InfiniBand, PTD-P takeaway #1; a t that does not
     divide the node size would make some tensor groups straddle two nodes);
  p  divides n/t and the layer count; d = n/(t p);
  b  divides B/d (up to `max_microbatch`);
  pipeline schedule (p > 1): 1f1b and zb-h1 with v = 1, interleaved with v > 1 dividing l/p,
     dualpipev with v = 2 (fix `pipeline_schedule` to one name, or to a tuple of allowed names);
  ZeRO 0-3 (2-3 only with p = 1, DeepSpeed), recompute none/selective/full, SP on/off (t > 1);
  c  (context parallelism) divides n/t with s divisible by 2c; d = n/(t c p); comm type p2p, and a2a
     where the query and KV heads per TP rank divide by c; pipelines with c > 1 run 1f1b only.
     c > 1 is searched only when it is fixed, when s >= LONG_SEQUENCE, or when no c = 1 layout is
     feasible (then c > 1 alone is searched): at shorter sequences a layout without CP exists and is
     what the papers ran (the validated tables stay as they were), CP's gain there is small (its
     per-token compute equals the c = 1 layout's), and the search stays the size it was.
Layouts train.py refuses (the rulebook, mtds.plan.runnable) are left out; with runnable_only=False those it
refuses only for what is not built yet are ranked too and carry `not_runnable` reasons.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from mtds.parallel.choices import PIPELINE_SCHEDULES, RECOMPUTE_MODES
from mtds.parallel.cp_rules import chunks_problem, heads_problem
from mtds.plan.candidate import Candidate, Workload
from mtds.plan.hardware import Cluster
from mtds.plan.memory import GIB, predict_memory
from mtds.plan.model_spec import ModelSpec
from mtds.plan.predict import Prediction, predict, structural_problems
from mtds.plan.runnable import rule_problems

KNOBS = ("tp", "pp", "dp", "microbatch", "virtual_stages", "zero_stage", "recompute", "sequence_parallel",
         "pipeline_schedule", "cp", "cp_comm_type", "ep", "zero2_pipeline_reduce")

# Sequences from this length on are "long": context parallelism is searched beside c = 1 (see above).
LONG_SEQUENCE = 32768


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


@dataclass
class PlanResult:
    """Feasible predictions ranked by step time, and infeasible layouts with reasons."""

    feasible: list = field(default_factory=list)
    infeasible: list = field(default_factory=list)   # (Candidate, [reasons]) pairs

    @property
    def best(self) -> Prediction | None:
        return self.feasible[0] if self.feasible else None


def context_sizes(model: ModelSpec, cluster: Cluster, fixed: dict, long_only: bool = False) -> list[int]:
    """Context-parallel sizes to search: the fixed one, else 1 (and, for s >= LONG_SEQUENCE or with
    ``long_only`` -- the retry when nothing at c = 1 fits -- every c dividing the GPU count with s % 2c == 0)."""
    if fixed.get("cp"):
        return [fixed["cp"]]
    longer = [c for c in _divisors(cluster.gpus) if c > 1 and chunks_problem(model.seq, c) is None]
    if long_only:
        return longer
    return [1] + (longer if model.seq >= LONG_SEQUENCE else [])


def _comm_types(model: ModelSpec, fixed: dict, t: int, c: int) -> list[str]:
    """Ring always; Ulysses where the query and KV heads per TP rank divide by c (mtds.cp.ulysses)."""
    if fixed.get("cp_comm_type"):
        return [fixed["cp_comm_type"]]
    if c == 1:
        return ["p2p"]
    kv = model.kv_heads or model.heads
    return ["p2p"] + (["a2a"] if heads_problem(model.heads // t, kv // t, c) is None else [])


def candidate_layouts(model: ModelSpec, work: Workload, cluster: Cluster, fixed: dict, max_microbatch: int = 64,
                      cps: list[int] | None = None):
    """Yield every Candidate consistent with the fixed knobs (structural checks come later); ``cps``: the
    context-parallel sizes (default :func:`context_sizes`)."""
    n = cluster.gpus
    # t divides the node size so that no tensor-parallel group straddles two nodes (with rank
    # order t innermost, t=6 on 8-GPU nodes would put ranks 6-11 on two nodes, over InfiniBand)
    tps = [fixed["tp"]] if fixed.get("tp") else [t for t in _divisors(n) if cluster.per_node % t == 0
                                                   and model.heads % t == 0]
    for t, c in ((t, c) for t in tps for c in (cps or context_sizes(model, cluster, fixed))):
        tc = t * c
        pps = [fixed["pp"]] if fixed.get("pp") else \
            [p for p in _divisors(n // tc) if model.layers % p == 0] if n % tc == 0 else []
        for p in pps:
            d = fixed.get("dp") or max(1, n // (tc * p))
            per_pipe = work.global_batch // d if work.global_batch % d == 0 else 0
            if fixed.get("microbatch"):
                bs = [fixed["microbatch"]]
            else:
                bs = [b for b in _divisors(per_pipe) if b <= max_microbatch] if per_pipe else []
            vs = [fixed["virtual_stages"]] if fixed.get("virtual_stages") else (
                _divisors(model.layers // p) if p > 1 and model.layers % p == 0 else [1])
            schedules = _schedules(fixed.get("pipeline_schedule"), p)
            zs = [fixed["zero_stage"]] if fixed.get("zero_stage") is not None else (
                [0] if d * c == 1 else [0, 1] if p > 1 else [0, 1, 2, 3])
            rs = [fixed["recompute"]] if fixed.get("recompute") else list(RECOMPUTE_MODES)
            sps = [fixed["sequence_parallel"]] if fixed.get("sequence_parallel") is not None else (
                [False, True] if t > 1 else [False])
            comms = _comm_types(model, fixed, t, c)
            eps = _expert_sizes(model, fixed, d * c)     # e divides the d·c ranks of the data axis
            zero2_mode = fixed.get("zero2_pipeline_reduce") or "micro-batch"    # ZeRO-2 at p > 1
            for b in bs:
                for v, sched in ((v, sc) for sc in schedules for v in vs if _chunks_fit(sc, v)):
                    for z in zs:
                        for r in rs:
                            for sp in sps:
                                for ct, e in ((ct, e) for ct in comms for e in eps):
                                    yield Candidate(t, p, d, b, v, z, r, sp, sched, cp=c, cp_comm_type=ct, ep=e,
                                                    zero2_pipeline_reduce=zero2_mode)


def _expert_sizes(model: ModelSpec, fixed: dict, d: int) -> list[int]:
    """Expert-parallel sizes to try: the fixed one; for an MoE model the divisors of d (d·c) that divide the experts;
    1 for a dense model."""
    if fixed.get("ep"):
        return [fixed["ep"]]
    if not model.moe_blocks:
        return [1]
    return [e for e in _divisors(d) if model.num_experts % e == 0]


def _schedules(fixed, p: int) -> list[str]:
    """Schedules to try: the fixed one(s), else all; p = 1 has no pipeline (1f1b stands for none)."""
    if p == 1:
        return ["1f1b"]
    if fixed:
        return [fixed] if isinstance(fixed, str) else list(fixed)
    return list(PIPELINE_SCHEDULES)


def _chunks_fit(schedule: str, v: int) -> bool:
    """Chunks per rank each schedule runs (structural_problems says why others fail)."""
    return {"interleaved": v > 1, "dualpipev": v == 2}.get(schedule, v == 1)


def plan(model: ModelSpec, work: Workload, cluster: Cluster, *, max_microbatch: int = 64,
         keep_infeasible: bool = False, runnable_only: bool = True, **fixed) -> PlanResult:
    """Predict every candidate layout; rank feasible ones by step time (then memory).
    runnable_only: leave out layouts train.py cannot run (mtds.plan.runnable)."""
    unknown = set(fixed) - set(KNOBS)
    if unknown:
        raise TypeError(f"unknown layout knobs: {sorted(unknown)}")
    fixed = {k: v for k, v in fixed.items() if v is not None}
    result = _rank(model, work, cluster, fixed, max_microbatch, keep_infeasible, runnable_only,
                   context_sizes(model, cluster, fixed))
    if not result.feasible and not fixed.get("cp") and model.seq < LONG_SEQUENCE:
        # nothing fits without context parallelism: the one knob left that divides activations further
        longer = _rank(model, work, cluster, fixed, max_microbatch, keep_infeasible, runnable_only,
                       context_sizes(model, cluster, fixed, long_only=True))
        longer.infeasible = result.infeasible + longer.infeasible
        result = longer
    return result


def _rank(model, work, cluster, fixed: dict, max_microbatch: int, keep_infeasible: bool, runnable_only: bool,
          cps: list[int]) -> PlanResult:
    """Predict the candidates of these context-parallel sizes; feasible ones fastest first."""
    result = PlanResult()
    if not cps:
        return result
    capacity = cluster.gpu.hbm_gib * GIB
    for layout in candidate_layouts(model, work, cluster, fixed, max_microbatch, cps):
        found = rule_problems(model, layout, work, capacity)
        problems = structural_problems(model, layout, work, cluster, found=found)
        if runnable_only:     # every rule train.py asks, the "not built" ones too
            problems += [p.message for p in found if p.message not in problems]
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
        result.feasible.append(predict(model, layout, work, cluster, found=found))
    result.feasible.sort(key=lambda pr: (pr.step_time_s, pr.memory.total))
    return result


def evaluate(model: ModelSpec, work: Workload, cluster: Cluster, runnable_only: bool = True,
             **fixed) -> Prediction:
    """Predict one layout; knobs left as None are chosen by the planner (fastest feasible, runnable by
    train.py unless runnable_only=False).

    If no completion of the given knobs is feasible (or runnable), the fastest one is returned with
    its reasons (fits=False / feasible=False) and `not_runnable` flags, so a user still sees the numbers.
    """
    result = plan(model, work, cluster, runnable_only=runnable_only, **fixed)
    if result.best is not None:
        return result.best
    fixed = {k: v for k, v in fixed.items() if v is not None}
    tried = [predict(model, lay, work, cluster) for lay in candidate_layouts(model, work, cluster, fixed)]
    if not tried:
        # nothing to enumerate (e.g. non-divisible sizes): build the literal layout
        t, p, c = fixed.get("tp", 1), fixed.get("pp", 1), fixed.get("cp", 1)
        lay = Candidate(t, p, fixed.get("dp") or max(1, cluster.gpus // (t * p * c)), fixed.get("microbatch", 1),
                     fixed.get("virtual_stages", 1), fixed.get("zero_stage", 0),
                     fixed.get("recompute", "full"), fixed.get("sequence_parallel", False),
                     fixed.get("pipeline_schedule", "") if isinstance(fixed.get("pipeline_schedule", ""), str) else "",
                     cp=c, cp_comm_type=fixed.get("cp_comm_type", "p2p"), ep=fixed.get("ep", 1),
                     zero2_pipeline_reduce=fixed.get("zero2_pipeline_reduce", "micro-batch"))
        return predict(model, lay, work, cluster)
    return min(tried, key=lambda pr: (len(pr.reasons), len(pr.not_runnable), pr.step_time_s))
