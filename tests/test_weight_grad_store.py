"""WeightGradStore: a TP linear with the store attached leaves its weight/bias grads out of backward
(input grad exact) and the queued W adds them, FIFO per key, equal to plain autograd; with
non-reentrant recomputation too (the grads land on the parameters, not on recomputed aliases)."""
import torch

from mtds.tp import ColumnParallelLinear, RowParallelLinear
from mtds.tp import checkpoint
from mtds.tp.weight_grad_store import WeightGradStore


def _grads(layer, x, store=None, recompute=False):
    layer.zero_grad(set_to_none=True)
    layer.weight_grad_store = store
    x = x.clone().requires_grad_(True)
    y = checkpoint(layer, None, x) if recompute else layer(x)
    if store is not None:
        store.key = ("c", 0)
    (y * torch.arange(y.numel(), dtype=y.dtype).reshape(y.shape)).sum().backward()
    deferred = [p.grad for p in layer.parameters()]
    if store is not None:
        store.key = None
        store.run(("c", 0))
        assert store.pending() == 0
    return x.grad, deferred, [p.grad.clone() for p in layer.parameters()]


def test_deferred_weight_grads_equal_autograd():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8)
    for layer in (ColumnParallelLinear(8, 6), RowParallelLinear(8, 6, input_is_parallel=True)):
        ref_input, _, ref = _grads(layer, x)
        for recompute in (False, True):
            grad_input, in_backward, grads = _grads(layer, x, WeightGradStore(), recompute)
            assert torch.equal(grad_input, ref_input)
            assert in_backward[0] is None                       # the weight GEMM waited for W
            for got, want in zip(grads, ref):
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_store_refuses_grads_outside_b():
    layer = ColumnParallelLinear(4, 4)
    layer.weight_grad_store = WeightGradStore()
    try:
        layer(torch.randn(2, 4, requires_grad=True)).sum().backward()
    except RuntimeError as err:
        assert "outside a B pass" in str(err)
    else:
        raise AssertionError("no error")


def _sequence_parallel_worker():
    import torch.distributed as dist
    group = dist.new_group([0, 1])
    torch.manual_seed(0)
    inputs = torch.Generator().manual_seed(dist.get_rank())   # each rank its own slice: W must gather them
    out = []
    for layer, x in ((ColumnParallelLinear(8, 6, group=group, sequence_parallel=True),
                      torch.randn(2, 3, 8, generator=inputs)),
                     (RowParallelLinear(8, 6, group=group, sequence_parallel=True),
                      torch.randn(2, 4, 4, generator=inputs))):
        ref_input, _, ref = _grads(layer, x)
        for recompute in (False, True):
            grad_input, in_backward, grads = _grads(layer, x, WeightGradStore(), recompute)
            out.append((torch.equal(grad_input, ref_input), in_backward[0] is None,
                        all(torch.equal(g, r) for g, r in zip(grads, ref))))
    return out


def test_sequence_parallel_linears_defer_exactly():
    """Under sequence parallelism (2 ranks) too: B leaves the weight grad out, W (which all-gathers the
    column-parallel input slice again) adds it, bit-identical to autograd, with and without recompute."""
    from tests.dist import spawn
    for rank_results in spawn(_sequence_parallel_worker, 2, timeout=120):
        assert rank_results == [(True, True, True)] * 4, rank_results
