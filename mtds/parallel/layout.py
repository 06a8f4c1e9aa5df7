"""The 3D parallel layout: one frozen, validated object that knows all rank arithmetic.

Rank order follows DeepSpeed's ``PipeModelDataParallelTopology`` (axes pipe, data, model): tensor
parallel ranks are innermost so that they share a node, then data, then pipeline.

    rank = pp_rank * (dp * tp) + dp_rank * tp + tp_rank

Everything else in mtds asks this module for groups and coordinates instead of doing arithmetic.
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


@dataclass(frozen=True)
class ParallelLayout:
    """Tensor (t), pipeline (p), data (d) parallel sizes and virtual pipeline stages (v)."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    vp: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "vp"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"{name} must be a positive integer, got {value!r}")
        if self.vp > 1 and self.pp == 1:
            raise LayoutError(f"virtual stages (vp={self.vp}) need pipeline parallelism: set pp > 1 or vp = 1")

    @classmethod
    def for_world(cls, world_size: int, tp: int = 1, pp: int = 1, dp: int | None = None, vp: int = 1) -> "ParallelLayout":
        """Build a layout for ``world_size`` ranks, deriving d = world / (t*p) when not given."""
        if tp < 1 or pp < 1:
            raise LayoutError(f"tp and pp must be >= 1, got tp={tp} pp={pp}")
        if dp is None:
            if world_size % (tp * pp) != 0:
                raise LayoutError(
                    f"world size {world_size} is not divisible by tp*pp = {tp}*{pp} = {tp * pp}: "
                    f"launch a multiple of {tp * pp} ranks or change --tp/--pp")
            dp = world_size // (tp * pp)
        layout = cls(tp=tp, pp=pp, dp=dp, vp=vp)
        if layout.world_size != world_size:
            raise LayoutError(
                f"world size {world_size} != tp*pp*dp = {tp}*{pp}*{dp} = {layout.world_size}: "
                f"launch {layout.world_size} ranks or change the sizes")
        return layout

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp

    def __str__(self) -> str:
        extra = f", vp={self.vp}" if self.vp > 1 else ""
        return f"(tp={self.tp}, pp={self.pp}, dp={self.dp}{extra})"

    # ---- validation against a model ------------------------------------------------------------
    def check_model(self, *, num_heads: int, hidden_size: int, num_layers: int,
                    num_kv_heads: int | None = None, ffn_hidden_size: int | None = None) -> None:
        """Refuse model shapes this layout cannot shard evenly."""
        t = self.tp
        kv = num_kv_heads or num_heads
        if num_heads % t:
            raise LayoutError(f"tensor parallel size {t} does not divide the {num_heads} attention heads: "
                              f"choose --tp from {_divisors(num_heads)}")
        if kv % t:
            raise LayoutError(f"tensor parallel size {t} does not divide the {kv} key/value heads: "
                              f"choose --tp from {_divisors(kv)}")
        if hidden_size % t:
            raise LayoutError(f"tensor parallel size {t} does not divide hidden size {hidden_size}")
        if ffn_hidden_size is not None and ffn_hidden_size % t:
            raise LayoutError(f"tensor parallel size {t} does not divide FFN size {ffn_hidden_size}")
        stages = self.pp * self.vp
        if num_layers < stages:
            raise LayoutError(f"{num_layers} layers cannot fill pp*vp = {stages} pipeline stages: "
                              f"use --pp <= {num_layers}")

    def check_sequence_parallel(self, seq_length: int) -> None:
        """Sequence parallelism splits every sequence into t equal slices."""
        if self.tp == 1:
            raise LayoutError("--sequence-parallel needs tensor parallelism (--tp > 1): it splits the "
                              "sequence over the tensor-parallel group")
        if seq_length % self.tp:
            raise LayoutError(f"--sequence-parallel needs --seq-length divisible by --tp {self.tp}, got "
                              f"{seq_length}: use a multiple of {self.tp}")

    # ---- rank arithmetic ---------------------------------------------------------------------------
    def coords(self, rank: int) -> RankCoords:
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} outside world of size {self.world_size}")
        return RankCoords(tp_rank=rank % self.tp, dp_rank=(rank // self.tp) % self.dp,
                          pp_rank=rank // (self.tp * self.dp))

    def rank_of(self, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
        return pp_rank * self.dp * self.tp + dp_rank * self.tp + tp_rank

    def tp_groups(self) -> list[list[int]]:
        return [[self.rank_of(t, d, p) for t in range(self.tp)] for p in range(self.pp) for d in range(self.dp)]

    def dp_groups(self) -> list[list[int]]:
        return [[self.rank_of(t, d, p) for d in range(self.dp)] for p in range(self.pp) for t in range(self.tp)]

    def pp_groups(self) -> list[list[int]]:
        return [[self.rank_of(t, d, p) for p in range(self.pp)] for d in range(self.dp) for t in range(self.tp)]

    def mp_groups(self) -> list[list[int]]:
        """Model-parallel groups (tensor x pipeline): all ranks that hold one model replica."""
        return [[self.rank_of(t, d, p) for p in range(self.pp) for t in range(self.tp)] for d in range(self.dp)]

    def topology(self):
        """DeepSpeed's topology for this layout (same rank order as :meth:`coords`)."""
        from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
        return PipeModelDataParallelTopology(num_pp=self.pp, num_mp=self.tp, num_dp=self.dp)

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
        return ParallelGroups(layout=self, rank=rank, coords=c,
                              tp_group=mine(self.tp_groups()), dp_group=mine(self.dp_groups()),
                              pp_group=mine(self.pp_groups()), mp_group=mine(self.mp_groups()))


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

    @property
    def tp_rank(self) -> int:
        return self.coords.tp_rank

    @property
    def dp_rank(self) -> int:
        return self.coords.dp_rank

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

    def get_data_parallel_rank(self) -> int:
        return self.dp_rank

    def get_data_parallel_world_size(self) -> int:
        return self.layout.dp

    def get_data_parallel_group(self):
        return self.dp_group

    def get_pipe_parallel_rank(self) -> int:
        return self.pp_rank

    def get_pipe_parallel_world_size(self) -> int:
        return self.layout.pp

    def get_pipe_parallel_group(self):
        return self.pp_group

    get_pipeline_model_parallel_rank = get_pipe_parallel_rank
    get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size
    get_pipeline_model_parallel_group = get_pipe_parallel_group


def _divisors(n: int) -> str:
    return ", ".join(str(k) for k in range(1, n + 1) if n % k == 0)
