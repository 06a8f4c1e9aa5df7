"""The experts of one MoE block, each a SwiGLU MLP tensor-parallel like the dense one (Megatron's
expert-tensor-parallel size = t): gate|up column-parallel, down row-parallel, its partial sums
all-reduced over the TP group. Stored as transformers' 3-D tensors, ``gate_up`` [E, 2F, h] (each
expert's [gate | up] split separately over TP, dim 1) and ``down`` [E, h, F] (split on dim 2).

Expert parallelism (e ranks): this rank holds experts [j·E/e, (j+1)·E/e) of both tensors (j its expert
shard), dim 0 sliced; their values are those of the same experts at e = 1 (the init draws the full tensor's
sequence and keeps this rank's rows). Such parameters carry ``expert_parallel`` (DeepSpeed reduces their
gradient over the expert-data-parallel group only, mtds.deepspeed_compat.expert_groups, and the global
norm sums their squares over the EP group) and ``expert_rows`` (the slice of dim 0 they hold, for loading
full tensors).

The local experts run as one grouped GEMM per projection (``torch.nn.functional.grouped_mm``: every
expert's rows against its own weight in one call, then one TP all-reduce for all of them) where torch has
one for the device and dtype and the row strides are 16-byte multiples (it asks for that); elsewhere as a
loop, one pair of GEMMs and one all-reduce per expert that got rows. ``grouped_gemm_works`` probes once per
(device type, dtype) with a tiny call, so a build of torch without the kernel falls back to the loop rather
than failing the step. Checked on CPU (fp32: forward and both gradients equal the loop's on this machine);
the CUDA kernel (bf16, Hopper) is taken by the same probe and has not been run by mtds's tests.
"""
from __future__ import annotations

import itertools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mtds.model.config import ModelConfig
from mtds.tp import reduce_from_tensor_parallel_region
from mtds.tp.layers import sharded_parameter

from mtds.model.glu import gated_activation
from mtds.model.init import normal_init, output_init

_GROUPED: dict = {}      # (device type, dtype) -> does F.grouped_mm run there


def grouped_gemm_works(device: torch.device, dtype: torch.dtype) -> bool:
    key = (device.type, dtype)
    if key not in _GROUPED:
        try:
            x, w = torch.zeros(8, 16, device=device, dtype=dtype), torch.zeros(2, 16, 16, device=device, dtype=dtype)
            F.grouped_mm(x, w, offs=torch.tensor([3, 8], dtype=torch.int32, device=device))
            _GROUPED[key] = True
        except (RuntimeError, NotImplementedError, AttributeError):
            _GROUPED[key] = False
    return _GROUPED[key]


def expert_parallel_parameters(module: nn.Module) -> list:
    """The parameters of ``module`` split over expert-parallel ranks (each rank holds other values)."""
    return [p for p in module.parameters() if getattr(p, "expert_parallel", False)]


def expert_range(num_experts: int, ep_group) -> tuple[int, int]:
    """The experts [a, b) this rank holds."""
    if ep_group is None:
        return 0, num_experts
    e, j = dist.get_world_size(ep_group), dist.get_rank(ep_group)
    local = num_experts // e
    return j * local, (j + 1) * local


def _expert_parameter(shape, dim, tp_group, init, segments, rows: tuple[int, int], expert_parallel: bool):
    param = sharded_parameter(shape, dim, tp_group, init, segments, None, None, rows=rows)
    if expert_parallel:
        param.expert_parallel = True
        param.expert_rows = rows
    return param


class TensorParallelExperts(nn.Module):
    def __init__(self, cfg: ModelConfig, *, tp_group=None, ep_group=None):
        super().__init__()
        E, ffn, h = cfg.num_experts, cfg.moe_ffn_size, cfg.hidden_size
        self.group = tp_group
        rows = expert_range(E, ep_group)
        split = ep_group is not None
        self.gate_up = _expert_parameter((E, 2 * ffn, h), 1, tp_group, normal_init(cfg.init_std), (ffn, ffn), rows,
                                         split)
        self.down = _expert_parameter((E, h, ffn), 2, tp_group, output_init(cfg), None, rows, split)
        self.activation = gated_activation(cfg)
        # GPT-OSS's biases (linear_bias), zero at init, registered last (the weights' init draws stay the same):
        # gate|up's split over TP like its rows; down's whole on every TP rank, added once after the all-reduce
        self.gate_up_bias = self.down_bias = None
        if cfg.linear_bias:
            self.gate_up_bias = _expert_parameter((E, 2 * ffn), 1, tp_group, nn.init.zeros_, (ffn, ffn), rows, split)
            self.down_bias = nn.Parameter(torch.zeros(rows[1] - rows[0], h))
            if split:
                self.down_bias.expert_parallel, self.down_bias.expert_rows = True, rows

    def grouped(self, rows: torch.Tensor) -> bool:
        """Whether this forward takes the grouped GEMM (see the module docstring)."""
        size = rows.element_size()
        aligned = all(n * size % 16 == 0 for n in (rows.shape[-1], self.gate_up.shape[1], self.down.shape[2]))
        return aligned and rows.dtype == self.gate_up.dtype and grouped_gemm_works(rows.device, rows.dtype)

    def forward(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """``rows`` [sum(counts), h] grouped by local expert (``counts[e]`` rows for expert e), replicated
        over TP and entered into the region by the caller; the full outputs, same order."""
        if not rows.shape[0]:
            # No rows for any local expert (with expert parallelism: the router sent every token elsewhere).
            # The empty output still derives from ``rows``: the all-to-all that brought them runs its backward
            # only where its output is in the loss's graph, and it is a collective -- skipped on this rank
            # alone, the group's next exchanges pair up wrongly (gloo: mismatched or garbage sizes).
            return rows.clone()
        if self.grouped(rows):
            ends = torch.tensor(list(itertools.accumulate(counts)), dtype=torch.int32, device=rows.device)
            gate_up = F.grouped_mm(rows, self.gate_up.transpose(1, 2), offs=ends)
            expert = None
            if self.gate_up_bias is not None:   # each row's expert, to pick its biases
                expert = torch.repeat_interleave(torch.arange(len(counts), device=rows.device),
                                                 torch.tensor(counts, device=rows.device))
                gate_up = gate_up + self.gate_up_bias.index_select(0, expert)
            gate, up = gate_up.chunk(2, dim=-1)
            y = F.grouped_mm(self.activation(gate, up), self.down.transpose(1, 2), offs=ends)
            # one all-reduce for every expert's rows; before the routing weight multiplies them (as below)
            y = reduce_from_tensor_parallel_region(y, self.group)
            return y if expert is None else y + self.down_bias.index_select(0, expert)
        outputs = []
        for e, x in enumerate(rows.split(counts)):
            if not counts[e]:
                continue
            bias = None if self.gate_up_bias is None else self.gate_up_bias[e]
            gate, up = F.linear(x, self.gate_up[e], bias).chunk(2, dim=-1)
            y = F.linear(self.activation(gate, up), self.down[e])
            # Reduced per expert, before the routing weight multiplies it: the weight's gradient (and so the
            # router's) then sees the whole output on every rank, not this rank's partial sum.
            y = reduce_from_tensor_parallel_region(y, self.group)
            outputs.append(y if self.down_bias is None else y + self.down_bias[e])
        return torch.cat(outputs) if outputs else rows.new_zeros(0, rows.shape[-1])
