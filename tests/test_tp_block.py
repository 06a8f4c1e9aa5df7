"""A TP transformer block built from mtds.tp layers equals a dense block, with exactly the Megatron
communication: 2 all-reduces forward and 2 backward per block, each of b*s*h elements."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mtds.observe.comm_trace import CommTracer
from mtds.parallel.layout import ParallelLayout
from mtds.tp import (ColumnParallelLinear, RowParallelLinear, gather_from_sequence_parallel_region,
                     reduce_scatter_to_sequence_parallel_region, scatter_to_sequence_parallel_region, unshard_rows)
from tests.dist import spawn

B, S, H, HEADS = 2, 8, 32, 4


def _init(seed):
    def fill(t):
        t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(seed)) * 0.2)
    return fill


class TPBlock(nn.Module):
    """Pre-norm attention + GELU MLP: column-parallel in, row-parallel out (Megatron Fig. 3)."""

    def __init__(self, group):
        super().__init__()
        t = 1 if group is None else dist.get_world_size(group)
        self.local_heads = HEADS // t
        self.ln1, self.ln2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.qkv = ColumnParallelLinear(H, 3 * H, group=group, init_method=_init(1), output_segments=[H, H, H])
        self.proj = RowParallelLinear(H, H, group=group, init_method=_init(2))
        self.fc1 = ColumnParallelLinear(H, 4 * H, group=group, init_method=_init(3))
        self.fc2 = RowParallelLinear(4 * H, H, group=group, init_method=_init(4))

    def forward(self, x):
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        heads = [z.unflatten(-1, (self.local_heads, -1)).transpose(1, 2) for z in (q, k, v)]
        attn = F.scaled_dot_product_attention(*heads, is_causal=True).transpose(1, 2).flatten(2)
        x = x + self.proj(attn)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def _block_worker():
    t = dist.get_world_size()
    tracer = CommTracer().install()
    groups = ParallelLayout.for_world(t, tp=t).build_groups()
    tracer.name_group(groups.tp_group, "tp")
    block, dense = TPBlock(groups.tp_group), TPBlock(None)
    # Layout-independent init: the t=1 block built from the same seeds is the dense reference.
    gathered = {}
    for name, p in block.named_parameters():
        if getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(p) for _ in range(t)]
            dist.all_gather(parts, p.detach().contiguous(), group=groups.tp_group)
            gathered[name] = unshard_rows(parts, p.partition_dim, p.partition_segments)
        else:
            gathered[name] = p.detach()
    dense_params = dict(dense.named_parameters())
    init_equal = all(torch.equal(gathered[n], dense_params[n].detach()) for n in gathered)

    x = torch.randn(B, S, H, generator=torch.Generator().manual_seed(9))
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    tracer.reset()
    y = block(x1)
    fwd = tracer.summary()
    tracer.reset()
    grad_out = torch.randn(B, S, H, generator=torch.Generator().manual_seed(10))
    y.backward(grad_out)
    bwd = tracer.summary()
    y_ref = dense(x2)
    y_ref.backward(grad_out)
    grads_ok = []
    for name, p in block.named_parameters():
        g = p.grad
        if getattr(p, "tensor_model_parallel", False):
            parts = [torch.empty_like(g) for _ in range(t)]
            dist.all_gather(parts, g.contiguous(), group=groups.tp_group)
            g = unshard_rows(parts, p.partition_dim, p.partition_segments)
        ref = dense_params[name].grad
        grads_ok.append((name, float((g - ref).abs().max() / ref.abs().max())))
    tracer.uninstall()
    return dict(init_equal=init_equal, fwd_diff=float((y - y_ref).abs().max() / y_ref.abs().max()),
                dx_diff=float((x1.grad - x2.grad).abs().max() / x2.grad.abs().max()), grads=grads_ok, fwd=fwd, bwd=bwd)


@pytest.mark.parametrize("t", [2, 4])
def test_tp_block_matches_dense_and_communicates_as_megatron(t):
    for rank, r in enumerate(spawn(_block_worker, t, timeout=180)):
        assert r["init_equal"], "initial weights depend on the tensor parallel size"
        # relative to the largest reference element (fp32: summation order differs across layouts)
        assert r["fwd_diff"] < 1e-6 and r["dx_diff"] < 1e-6, r
        for name, diff in r["grads"]:
            assert diff < 1e-6, (rank, name, diff)
        elements = B * S * H * 4  # fp32 bytes of one b*s*h activation
        # ring all-reduce over t ranks: 2(t-1)/t of the tensor on each link
        expected = {"all_reduce/tp": {"calls": 2, "bytes": 2 * elements, "bus_bytes": 2 * elements * 2 * (t - 1) // t,
                                      "group_size": t}}
        assert r["fwd"] == expected, r["fwd"]
        assert r["bwd"] == expected, r["bwd"]


def _sequence_worker():
    t = dist.get_world_size()
    group = ParallelLayout.for_world(t, tp=t).build_groups().tp_group
    rank = dist.get_rank()
    # Each rank holds a partial sum of the same [b, s, h] tensor (as after a row-parallel matmul).
    partial = torch.randn(B, S, H, generator=torch.Generator().manual_seed(rank)).requires_grad_()
    total = sum(torch.randn(B, S, H, generator=torch.Generator().manual_seed(r)) for r in range(t))
    local = reduce_scatter_to_sequence_parallel_region(partial, group, dim=1)
    full = gather_from_sequence_parallel_region(local * (rank + 1), group, dim=1)
    weights = torch.arange(1.0, B * S * H + 1).reshape(B, S, H)
    (full * weights).sum().backward()
    # d/d partial of sum_r (rank r scales its sequence chunk by r+1) * weights:
    scale = torch.cat([torch.full((B, S // t, H), float(r + 1)) for r in range(t)], dim=1)
    expected_grad = weights * scale * t  # every rank's output sum is backpropagated: t copies
    # a replicated [s, h] tensor (position embeddings): each rank keeps its rows, and the backward
    # all-gather hands every rank the gradient of every row
    replicated = torch.arange(float(S * H)).reshape(S, H).requires_grad_()
    rows = scatter_to_sequence_parallel_region(replicated, group, dim=0)
    (rows * (rank + 1)).sum().backward()
    row_grad = torch.cat([torch.full((S // t, H), float(r + 1)) for r in range(t)], dim=0)
    return (torch.allclose(local, total.chunk(t, dim=1)[rank], atol=1e-5),
            torch.allclose(partial.grad, expected_grad, atol=1e-4),
            torch.equal(rows, replicated.detach().chunk(t, dim=0)[rank]) and torch.equal(replicated.grad, row_grad))


def test_sequence_parallel_mappings():
    for ok_forward, ok_backward, ok_scatter in spawn(_sequence_worker, 2, timeout=120):
        assert ok_forward and ok_backward and ok_scatter
