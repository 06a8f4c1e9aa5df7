"""Pipeline stage balance: what each virtual stage of a partition costs, and the partition that
minimises the costliest pipeline rank (``--pipeline-balance cost``; ``mtds-plan`` reports and recommends it).

A layer's cost is the planner's own per-micro-batch time of it, forward + backward (mtds.plan.compute:
a roofline of its FLOPs and of the bytes its memory-bound kernels move; pure FLOPs would price the
embedding lookup, the final norm and the fp32 vocab-parallel cross entropy at ~0), plus the tensor-parallel
collectives it issues (mtds.plan.tp_comm):

    E  embedding                         compute.embedding_time + the first stage's end collectives
    t  one transformer block             compute.layer_compute_time (recomputation included) + tp_comm.layer_time
    L  final norm + LM head + loss       compute.final_norm_time + compute.output_layer_time + the last
                                         stage's end collectives

Memory constraint: a balanced partition moves blocks off the last stage and onto earlier ones, which keep
more micro-batches in flight (1F1B: rank r holds min(p − r, m)). Every rank's predicted memory (model
states + in-flight activations + the last stage's fp32 logits, :func:`rank_memory`) must fit the device;
among the partitions that fit, the one with the cheapest costliest stage wins.
"""
from __future__ import annotations

from dataclasses import dataclass

from mtds.parallel.pipeline_layout import StageLayout, uniform_layout
from mtds.plan import compute, cp_comm, tp_comm
from mtds.plan.candidate import Candidate, Workload
from mtds.plan.hardware import Cluster
from mtds.plan.memory import activation_bytes_per_layer, model_state_bytes
from mtds.plan.model_spec import ModelSpec
from mtds.plan.pipeline import activation_factor

BALANCE_CHOICES = ("uniform", "cost")
# train.py and mtds-plan without --pipeline-balance: cost beat uniform in every repeat of the quiet
# measurement (docs/pipeline.md, run D: +13% tokens/s at p = 2).
DEFAULT_BALANCE = "cost"
# The cost model prices layers on one fixed device (the planner's A100 numbers) rather than the one
# the run happens to be on: every rank gets the same partition from the same config, and the ratio that
# matters (LM head + loss : block) is a property of the model shapes more than of the chip.
REFERENCE_GPU = "A100"


@dataclass(frozen=True)
class LayerCosts:
    """Seconds per micro-batch, forward + backward, of the three kinds of layer on one GPU."""

    embedding: float
    block: float
    head: float

    def stage(self, blocks: int, first: bool, last: bool) -> float:
        return blocks * self.block + (self.embedding if first else 0.0) + (self.head if last else 0.0)


def layer_costs(model: ModelSpec, layout: Candidate, work: Workload, cluster: Cluster) -> LayerCosts:
    t = layout.tp

    def ends(stage):
        return tp_comm.collectives_time(tp_comm.end_collectives(model, layout, work, stage), t, cluster)

    block = (compute.layer_compute_time(model, layout, work, cluster) + tp_comm.layer_time(model, layout, work, cluster)
             + cp_comm.layer_time(model, layout, work, cluster))
    embedding = compute.embedding_time(model, layout, work, cluster) + ends("first")
    head = (compute.final_norm_time(model, layout, work, cluster) + compute.output_layer_time(model, layout, work, cluster)
            + ends("last"))
    return LayerCosts(embedding=embedding, block=block, head=head)


def rank_of_stage(stage: int, p: int, schedule: str) -> int:
    """Pipeline rank running virtual stage ``stage``: k mod p (interleaved placement), or the V of
    dualpipev (stages k and 2p − 1 − k on rank k)."""
    if schedule == "dualpipev":
        return stage if stage < p else 2 * p - 1 - stage
    return stage % p


@dataclass(frozen=True)
class StageReport:
    """A partition as the planner sees it: per virtual stage and per rank, and the critical rank."""

    layout: StageLayout
    stage_s: tuple[float, ...]       # per virtual stage, one micro-batch, forward + backward
    rank_s: tuple[float, ...]        # per pipeline rank: its stages summed
    rank_memory: tuple[float, ...]   # bytes per GPU of each pipeline rank

    @property
    def critical_rank(self) -> int:
        return max(range(len(self.rank_s)), key=lambda r: self.rank_s[r])

    @property
    def critical_s(self) -> float:
        return max(self.rank_s)

    @property
    def imbalance(self) -> float:
        """Critical rank's time over the mean rank's (1.0: perfectly balanced)."""
        return self.critical_s / (sum(self.rank_s) / len(self.rank_s))

    def as_dict(self) -> dict:
        return {"pipeline_layout": str(self.layout), "stage_ms": [round(x * 1e3, 4) for x in self.stage_s],
                "rank_ms": [round(x * 1e3, 4) for x in self.rank_s],
                "rank_memory_gib": [round(x / 1024 ** 3, 4) for x in self.rank_memory],
                "critical_rank": self.critical_rank, "imbalance": round(self.imbalance, 4)}


def rank_memory(model: ModelSpec, layout: Candidate, work: Workload, cluster: Cluster, stages: StageLayout) -> list[float]:
    """Predicted bytes per GPU of each pipeline rank for ``stages`` (mtds.plan.memory's terms, per rank)."""
    p, t, h = layout.pp, layout.tp, model.hidden
    m = max(1, layout.microbatches(work.global_batch))
    per_layer = model.sharded_params_per_layer() / t + model.replicated_params_per_layer()
    embed = model.padded_vocab(t) * h / t
    act = activation_bytes_per_layer(model, layout, work, attention=cluster.calib.attention_kernel)
    factor = activation_factor(layout.pipeline_schedule, p, layout.virtual_stages)
    first, last = 0, rank_of_stage(stages.stages - 1, p, layout.pipeline_schedule)
    params = [0.0] * p
    activations = [0.0] * p
    for k, n in enumerate(stages.blocks):
        r = rank_of_stage(k, p, layout.pipeline_schedule)
        params[r] += n * per_layer
        activations[r] += n * act * min(p - r, m) * factor
    params[first] += embed + (0 if model.rotary else model.seq * h)
    # the head: a tied copy of the table (one module when E and L share a rank) or an untied matrix
    params[last] += model.norm_params + (embed if (model.untied_head or last != first) else 0.0)
    activations[last] += 8.0 * model.seq * layout.microbatch * model.padded_vocab(t) / t   # fp32 logits + grad
    return [sum(model_state_bytes(n, layout, work, cluster.calib.main_grad_bytes)) + a
            for n, a in zip(params, activations)]


def stage_report(model: ModelSpec, layout: Candidate, work: Workload, cluster: Cluster, stages: StageLayout,
                 costs: LayerCosts | None = None) -> StageReport:
    costs = costs or layer_costs(model, layout, work, cluster)
    last = stages.stages - 1
    stage_s = [costs.stage(n, k == 0, k == last) for k, n in enumerate(stages.blocks)]
    rank_s = [0.0] * layout.pp
    for k, c in enumerate(stage_s):
        rank_s[rank_of_stage(k, layout.pp, layout.pipeline_schedule)] += c
    return StageReport(stages, tuple(stage_s), tuple(rank_s),
                       tuple(rank_memory(model, layout, work, cluster, stages)))


def _allocations(extra: list[float], floor: list[int], block: float, total: int):
    """Block counts per bin (a stage, or a rank's stages together) minimising the costliest bin, bin cost
    = extra + blocks x block: for each target T in increasing order, every bin takes as many blocks as fit
    under T (at least its floor); blocks beyond ``total`` come off the costliest bin, the earliest on a
    tie (it keeps the most micro-batches in flight). Yields one allocation per feasible T."""
    bins = len(extra)
    targets = sorted({extra[k] + n * block for k in range(bins) for n in range(total + 1)})
    for target in targets:
        if any(e > target * (1 + 1e-12) for e in extra):
            continue
        caps = [min(total, int((target * (1 + 1e-12) - extra[k]) // block)) if block > 0 else total
                for k in range(bins)]
        if any(c < f for c, f in zip(caps, floor)) or sum(caps) < total:
            continue
        blocks = list(caps)
        for _ in range(sum(caps) - total):
            k = max((k for k in range(bins) if blocks[k] > floor[k]), key=lambda k: (extra[k] + blocks[k] * block, -k))
            blocks[k] -= 1
        yield blocks


def cost_layout(costs: LayerCosts, num_layers: int, stages: int, fits=lambda layout: True,
                rank_of=None) -> StageLayout | None:
    """The partition minimising the costliest pipeline rank (``rank_of(stage)``; default one stage per
    rank), among those ``fits`` accepts (None: none does); the smallest such target wins
    (:func:`_allocations`). Every stage holds something: the middle ones at least one block. A rank's
    blocks are then spread over its stages (v > 1) cheapest stage first, so its chunks are as even as
    they can be."""
    last = stages - 1
    rank_of = rank_of or (lambda k: k)
    ranks = max(rank_of(k) for k in range(stages)) + 1
    extra = [costs.stage(0, k == 0, k == last) for k in range(stages)]
    floor = [0 if k in (0, last) else 1 for k in range(stages)]
    mine = [[k for k in range(stages) if rank_of(k) == r] for r in range(ranks)]
    for per_rank in _allocations([sum(extra[k] for k in ks) for ks in mine], [sum(floor[k] for k in ks) for ks in mine],
                                 costs.block, num_layers):
        blocks = list(floor)
        for ks, n in zip(mine, per_rank):
            for _ in range(n - sum(floor[k] for k in ks)):
                k = min(ks, key=lambda k: (extra[k] + blocks[k] * costs.block, -k))
                blocks[k] += 1
        layout = StageLayout(tuple(blocks))
        if fits(layout):
            return layout
    return None


def balanced_layout(model: ModelSpec, layout: Candidate, work: Workload, cluster: Cluster,
                    capacity_bytes: float | None = None) -> StageLayout:
    """``--pipeline-balance cost``: :func:`cost_layout` with every rank's predicted memory within
    ``capacity_bytes`` (default: the cluster GPU's), or the uniform partition where that is no faster."""
    stages = layout.pp * layout.virtual_stages
    uniform = uniform_layout(model.layers, stages)
    costs = layer_costs(model, layout, work, cluster)
    capacity = cluster.gpu.hbm_gib * 1024 ** 3 if capacity_bytes is None else capacity_bytes
    best = cost_layout(costs, model.layers, stages,
                       fits=lambda s: max(rank_memory(model, layout, work, cluster, s)) <= capacity,
                       rank_of=lambda k: rank_of_stage(k, layout.pp, layout.pipeline_schedule))
    if best is None:
        return uniform
    if stage_report(model, layout, work, cluster, best, costs).critical_s >= \
            stage_report(model, layout, work, cluster, uniform, costs).critical_s:
        return uniform
    return best


__all__ = ["BALANCE_CHOICES", "DEFAULT_BALANCE", "REFERENCE_GPU", "run_partition", "LayerCosts", "StageReport", "balanced_layout", "cost_layout", "layer_costs",
           "rank_of_stage", "rank_memory", "stage_report"]


def run_partition(model: ModelSpec, layout: Candidate, work: Workload, world: int, balance: str | None,
                  capacity_bytes: float) -> StageLayout:
    """The partition train.py builds without ``--pipeline-layout``: ``balance`` (None: DEFAULT_BALANCE),
    priced on REFERENCE_GPU, each rank's memory within ``capacity_bytes``. The one rule train.py,
    compare and check_local share."""
    if (balance or DEFAULT_BALANCE) == "uniform":
        return uniform_layout(model.layers, layout.pp * layout.virtual_stages)
    from mtds.plan.hardware import get_gpu
    return balanced_layout(model, layout, work, Cluster(get_gpu(REFERENCE_GPU, work.precision), gpus=world),
                           capacity_bytes=capacity_bytes)
