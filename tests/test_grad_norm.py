"""mtds.training.grad_norm.global_grad_norm on real gloo ranks at (t, p) = (2, 2) against the norm of
the dense single-process gradients: TP-sharded parameters count once per slice, TP-replicated ones
once (not t times), the pipeline-tied copy on the non-owning stage (``ds_pipe_replicated``) never."""
import math

import torch
import torch.distributed as dist

from mtds.parallel.layout import ParallelLayout
from mtds.training.grad_norm import clip_grad_norm, global_grad_norm
from tests.dist import spawn


def _dense_grads():
    """The model's gradients as one process would see them: per stage a sharded matrix and a replicated
    vector; the tied (vocab-parallel) embedding shared by the first and last stage."""
    g = torch.Generator().manual_seed(3)
    stages = [dict(sharded=torch.randn(8, 6, generator=g), replicated=torch.randn(5, generator=g))
              for _ in range(2)]
    return stages, torch.randn(4, 3, generator=g)


def _param(grad, **attrs):
    p = torch.nn.Parameter(torch.zeros_like(grad))
    p.grad = grad.clone()
    for name, value in attrs.items():
        setattr(p, name, value)
    return p


def _norm_worker():
    groups = ParallelLayout.for_world(dist.get_world_size(), tp=2, pp=2).build_groups()
    stages, tied = _dense_grads()
    mine, t = stages[groups.pp_rank], groups.tp_rank
    params = [
        _param(mine["sharded"].chunk(2, dim=0)[t], tensor_model_parallel=True),
        _param(mine["replicated"]),                                   # same on both TP ranks
        # the tied embedding: vocab-parallel, and on the last stage DeepSpeed's replicated copy
        _param(tied.chunk(2, dim=0)[t], tensor_model_parallel=True, ds_pipe_replicated=groups.pp_rank == 1),
        torch.nn.Parameter(torch.ones(3)),                            # no gradient: ignored
    ]
    norm = global_grad_norm(params, groups)
    before = [p.grad.clone() for p in params if p.grad is not None]
    returned = clip_grad_norm(params, norm / 2, groups)               # halves every gradient
    after = [p.grad for p in params if p.grad is not None]
    halved = all(torch.allclose(a, b / 2, rtol=1e-6) for a, b in zip(after, before))
    return norm, returned, halved


def test_global_norm_counts_every_distinct_parameter_once():
    stages, tied = _dense_grads()
    dense = math.sqrt(sum(float(s["sharded"].pow(2).sum() + s["replicated"].pow(2).sum()) for s in stages)
                      + float(tied.pow(2).sum()))
    for rank, (norm, returned, halved) in enumerate(spawn(_norm_worker, 4, timeout=120)):
        assert math.isclose(norm, dense, rel_tol=1e-6), (rank, norm, dense)
        assert returned == norm and halved, rank
