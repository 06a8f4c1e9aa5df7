"""The parallel layout (t, c, p, d): one frozen, validated object that knows all rank arithmetic.

Rank order follows DeepSpeed's ``PipeModelDataParallelTopology`` (axes pipe, data, model): tensor
parallel ranks are innermost so that they share a node, then context parallel (c), then data, then
pipeline.

    rank = pp_rank * (dp * cp * tp) + dp_rank * (cp * tp) + cp_rank * tp + tp_rank

Context-parallel ranks hold the same parameters and see different parts of the same sequences, so their
gradients are summed like data-parallel ones: DeepSpeed is shown one data axis of d·c ranks (data
coordinate ``dp_rank * cp + cp_rank``, as Megatron's data-parallel group "with context parallel"), and
its gradient reduction, ZeRO partitions and loss averaging run over those d·c ranks; only the data loader
and the batch arithmetic count d alone.

Expert parallelism (e) splits a mixture-of-experts model's experts over e of the d·c ranks that hold the same
parameters: along that data axis (coordinate x = dp_rank·c + cp_rank, DeepSpeed's data-parallel rank) ranks
x = q·e + j form expert-parallel groups of e consecutive coordinates (j = x mod e, the expert shard this rank
holds) and expert-data-parallel groups of the d·c/e ranks with the same j (they hold the same experts and sum
their gradients). This is DeepSpeed's own arrangement (``deepspeed.utils.groups._get_expert_parallel_ranks``
over its data axis of d·c ranks, data before expert off), so its tools read mtds's expert groups alike; as in
Megatron-core, expert parallelism folds over data and context parallelism: with c > 1 the first e ≤ c of an
expert-parallel group are context-parallel peers (they route different tokens of one sequence). At c = 1 it is
e consecutive data ranks.

Everything else in mtds asks this module for groups and coordinates instead of doing arithmetic. What a layout
may combine with a model and the rest of a job is the rulebook's (mtds.rules), which asks this module for the
grid's own invariants.
"""
from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any


class LayoutError(ValueError):
    """A parallel layout that cannot work; the message says what to change."""


@dataclass(frozen=True)
class RankCoords:
    tp_rank: int
    dp_rank: int
    pp_rank: int
    cp_rank: int = 0


@dataclass(frozen=True)
class ParallelLayout:
    """Tensor (t), pipeline (p), data (d), context (c) parallel sizes, virtual pipeline stages (v) and
    expert parallel size (e, a divisor of d·c: the experts of an MoE model split over e of the d·c ranks)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    vp: int = 1
    cp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "vp", "cp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"{name} must be a positive integer, got {value!r}")
        if self.vp > 1 and self.pp == 1:
            raise LayoutError(f"virtual stages (vp={self.vp}) need pipeline parallelism: set pp > 1 or vp = 1")
        if self.dp_cp % self.ep:
            of = f"the data-parallel size {self.dp}" if self.cp == 1 else \
                f"d·c = {self.dp}·{self.cp} = {self.dp_cp} (data- times context-parallel size)"
            raise LayoutError(f"--expert-model-parallel-size {self.ep} does not divide {of}: the experts are "
                              f"split over those ranks; choose it from {divisors(self.dp_cp)}")

    @classmethod
    def for_world(cls, world_size: int, tp: int = 1, pp: int = 1, dp: int | None = None, vp: int = 1,
                  cp: int = 1, ep: int = 1) -> "ParallelLayout":
        """Build a layout for ``world_size`` ranks, deriving d = world / (t*c*p) when not given."""
        if tp < 1 or pp < 1:
            raise LayoutError(f"tp and pp must be >= 1, got tp={tp} pp={pp}")
        if cp < 1:
            raise LayoutError(f"--context-parallel-size must be >= 1, got {cp}")
        names, sizes = ("tp*cp*pp", f"{tp}*{cp}*{pp}") if cp > 1 else ("tp*pp", f"{tp}*{pp}")
        flags = "--tp/--cp/--pp" if cp > 1 else "--tp/--pp"
        if dp is None:
            if world_size % (tp * pp * cp) != 0:
                raise LayoutError(
                    f"world size {world_size} is not divisible by {names} = {sizes} = {tp * pp * cp}: "
                    f"launch a multiple of {tp * pp * cp} ranks or change {flags}")
            dp = world_size // (tp * pp * cp)
        layout = cls(tp=tp, pp=pp, dp=dp, vp=vp, cp=cp, ep=ep)
        if layout.world_size != world_size:
            raise LayoutError(
                f"world size {world_size} != {names}*dp = {sizes}*{dp} = {layout.world_size}: "
                f"launch {layout.world_size} ranks or change the sizes")
        return layout

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def dp_cp(self) -> int:
        """Ranks that hold the same parameters and sum their gradients (ZeRO partitions over them): d·c."""
        return self.dp * self.cp

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp

    def __str__(self) -> str:
        extra = f", vp={self.vp}" if self.vp > 1 else ""
        extra += f", cp={self.cp}" if self.cp > 1 else ""
        extra += f", ep={self.ep}" if self.ep > 1 else ""
        return f"(tp={self.tp}, pp={self.pp}, dp={self.dp}{extra})"

    # ---- rank arithmetic ---------------------------------------------------------------------------
    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} outside world of size {self.world_size}")
        t, c, d = self.tp, self.cp, self.dp
        return RankCoords(tp_rank=rank % t, cp_rank=(rank // t) % c, dp_rank=(rank // (t * c)) % d,
                          pp_rank=rank // (t * c * d))

    def rank_of(self, tp_rank: int, dp_rank: int, pp_rank: int, cp_rank: int = 0) -> int:
        return ((pp_rank * self.dp + dp_rank) * self.cp + cp_rank) * self.tp + tp_rank

    def _ranks(self):
        """Every rank's (t, c, d, p) coordinates."""
        return [(t, c, d, p) for p in range(self.pp) for d in range(self.dp) for c in range(self.cp)
                for t in range(self.tp)]

    def _axis_groups(self, varying: str) -> list[list[int]]:
        """The groups of ranks that differ only in the axes named in ``varying`` (letters of "tcdp")."""
        out: dict[tuple, list[int]] = {}
        for coords in self._ranks():
            key = tuple(x for x, axis in zip(coords, "tcdp") if axis not in varying)
            t, c, d, p = coords
            out.setdefault(key, []).append(self.rank_of(t, d, p, c))
        return list(out.values())

    def tp_groups(self) -> list[list[int]]:
        return self._axis_groups("t")

    def cp_groups(self) -> list[list[int]]:
        """Context-parallel groups: the c ranks that split one sequence (same t, d and p coordinates)."""
        return self._axis_groups("c")

    def dp_groups(self) -> list[list[int]]:
        """Data-parallel groups (d ranks; the data loader's)."""
        return self._axis_groups("d")

    def dp_cp_groups(self) -> list[list[int]]:
        """The d·c ranks that sum their gradients (DeepSpeed's data-parallel group); the dp groups when c = 1."""
        return self._axis_groups("cd")

    def ep_groups(self) -> list[list[int]]:
        """Expert-parallel groups: e consecutive coordinates x = d·c + c of the data axis (same t, p) that split
        the experts between them."""
        return self._expert_groups(lambda x: x // self.ep)

    def expert_dp_groups(self) -> list[list[int]]:
        """Expert-data-parallel groups: the d·c/e ranks of the data axis (same t, p) holding the same experts."""
        return self._expert_groups(lambda x: x % self.ep)

    def _expert_groups(self, key) -> list[list[int]]:
        out: dict[tuple, list[int]] = {}
        for t, c, d, p in self._ranks():      # ordered by rank: x ascending within a (t, p)
            out.setdefault((t, p, key(d * self.cp + c)), []).append(self.rank_of(t, d, p, c))
        return list(out.values())

    def pp_groups(self) -> list[list[int]]:
        return self._axis_groups("p")

    def mp_groups(self) -> list[list[int]]:
        """Model-parallel groups (tensor x pipeline): all ranks that hold one model replica."""
        return self._axis_groups("tp")

    def topology(self):
        """DeepSpeed's topology for this layout (same rank order as :meth:`coords`): its data axis is d·c."""
        from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
        return PipeModelDataParallelTopology(num_pp=self.pp, num_mp=self.tp, num_dp=self.dp * self.cp)

    def build_groups(self, rank: int | None = None, timeout_s: float = 600.0) -> "ParallelGroups":
        """Create every process group this layout needs; collective, so all ranks must call it."""
        import torch.distributed as dist     # here only: the planner validates layouts without torch
        if not dist.is_initialized():
            raise LayoutError("torch.distributed is not initialised: launch with deepspeed/torchrun first")
        world = dist.get_world_size()
        if world != self.world_size:
            raise LayoutError(f"launched {world} ranks but layout {self} needs {self.world_size}: "
                              f"change --tp/--pp or the number of processes")
        rank = dist.get_rank() if rank is None else rank
        timeout = datetime.timedelta(seconds=timeout_s)

        def mine(all_groups: list[list[int]]):
            # new_group is collective over the world: every rank creates every group, keeps its own.
            chosen = None
            for ranks in all_groups:
                group = dist.new_group(ranks, timeout=timeout)
                if rank in ranks:
                    chosen = group
            return chosen

        c = self.coords(rank)
        dp_group = mine(self.dp_groups())
        # with c = 1 the d·c group is the dp group: no second group (nor its gloo threads)
        cp_group, dp_cp_group = (mine(self.cp_groups()), mine(self.dp_cp_groups())) if self.cp > 1 else (None, dp_group)
        ep_group, expert_dp_group = (mine(self.ep_groups()), mine(self.expert_dp_groups())) if self.ep > 1 else \
            (None, None)
        return ParallelGroups(layout=self, rank=rank, coords=c,
                              tp_group=mine(self.tp_groups()), dp_group=dp_group,
                              pp_group=mine(self.pp_groups()), mp_group=mine(self.mp_groups()),
                              cp_group=cp_group, dp_cp_group=dp_cp_group,
                              ep_group=ep_group, expert_dp_group=expert_dp_group)


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's process groups, plus the ``mpu`` interface DeepSpeed expects.

    In mtds "model parallel" for DeepSpeed means *tensor* parallel: DeepSpeed uses the mpu to skip
    double-counting TP-replicated parameters in gradient norms and to partition activations.
    """

    layout: ParallelLayout
    rank: int
    coords: RankCoords
    tp_group: Any = field(repr=False)
    dp_group: Any = field(repr=False)
    pp_group: Any = field(repr=False)
    mp_group: Any = field(repr=False)
    cp_group: Any = field(default=None, repr=False)     # None when c = 1
    dp_cp_group: Any = field(default=None, repr=False)  # gradient replicas, d·c ranks (the dp group when c = 1)
    ep_group: Any = field(default=None, repr=False)     # e ranks splitting the experts (None when e = 1)
    expert_dp_group: Any = field(default=None, repr=False)  # d/e ranks holding the same experts (None when e = 1)

    @property
    def tp_rank(self) -> int:
        return self.coords.tp_rank

    @property
    def cp_rank(self) -> int:
        return self.coords.cp_rank

    @property
    def dp_cp_rank(self) -> int:
        """This rank's place among the d·c gradient replicas (DeepSpeed's data-parallel rank)."""
        return self.coords.dp_rank * self.layout.cp + self.coords.cp_rank

    @property
    def dp_rank(self) -> int:
        return self.coords.dp_rank

    @property
    def ep_rank(self) -> int:
        """Which of the e expert shards this rank holds."""
        return self.dp_cp_rank % self.layout.ep

    @property
    def pp_rank(self) -> int:
        return self.coords.pp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp - 1

    # DeepSpeed mpu interface --------------------------------------------------------------------
    def get_model_parallel_rank(self) -> int:
        return self.tp_rank

    def get_model_parallel_world_size(self) -> int:
        return self.layout.tp

    def get_model_parallel_group(self):
        return self.tp_group

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    # DeepSpeed's "data parallel" is every rank it sums gradients over: d·c (module docstring)
    def get_data_parallel_rank(self) -> int:
        return self.dp_cp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.layout.dp_cp

    def get_data_parallel_group(self):
        return self.dp_cp_group

    def get_pipe_parallel_rank(self) -> int:
        return self.pp_rank

    def get_pipe_parallel_world_size(self) -> int:
        return self.layout.pp

    def get_pipe_parallel_group(self):
        return self.pp_group

    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size
    get_pipeline_model_parallel_group = get_pipe_parallel_group


def divisors(n: int) -> str:
    return ", ".join(str(k) for k in range(1, n + 1) if n % k == 0)
