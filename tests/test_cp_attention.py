"""Context-parallel attention (mtds.cp) against dense causal SDPA on the whole sequence.

Ranks: worlds 2 and 4 (pooled, gloo on CPU; NCCL on GPUs in the suite's CUDA mode), both comm types,
MHA and GQA, plain causal and packed documents. Each rank's output and dq/dk/dv must equal the
reference's rows at its load-balanced positions to 1e-5 relative / 1e-6 absolute in fp32: the
blocks are summed in another order than SDPA's (online softmax over ring steps), so not bit-exact.
"""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mtds.cp import (ContextParallelError, check_cp_sequence, cp_attention, gather_order, held_order, local_positions,
                     ring_attention, split_sequence, ulysses_attention)
from mtds.training.distributed import group_device
from tests.dist import spawn

TOL = dict(rtol=1e-5, atol=1e-6)
B, HQ, S, D = 2, 4, 64, 8


# ---- single process: the chunk layout -----------------------------------------------------------------

def test_local_positions():
    assert local_positions(8, 1, 0).tolist() == list(range(8))
    assert local_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert local_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert [local_positions(16, 4, r).tolist() for r in range(4)] == [
        [0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    assert local_positions(16, 4, 2).dtype == torch.int64


def test_split_then_gather_order_recovers_the_sequence():
    x = torch.randn(3, 48, 5)
    for cp in (1, 2, 3, 4):
        parts = [split_sequence(x, cp, r) for r in range(cp)]
        for r, part in enumerate(parts):
            assert part.is_contiguous()
            assert torch.equal(part, x.index_select(1, local_positions(48, cp, r)))
        stacked = torch.cat(parts, dim=1)
        assert torch.equal(stacked.index_select(1, gather_order(48, cp)), x)
        assert torch.equal(x.index_select(1, held_order(48, cp)), stacked)
    assert torch.equal(split_sequence(x.transpose(0, 1), 4, 1, dim=0), split_sequence(x, 4, 1).transpose(0, 1))


def test_check_cp_sequence_messages():
    check_cp_sequence(1000, 1)
    check_cp_sequence(1000, 4)
    with pytest.raises(ContextParallelError, match=r"--context-parallel-size 4 needs --seq-length divisible by "
                                                   r"2\*C = 8 .*got 1004: use a multiple of 8"):
        check_cp_sequence(1004, 4)
    with pytest.raises(ContextParallelError, match="divisible by 2\\*C = 4"):
        split_sequence(torch.zeros(1, 6), 2, 0)
    with pytest.raises(ContextParallelError, match="must be one of"):
        cp_attention("ring", torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2, 2))


def test_single_process_is_local_causal_attention():
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, h, 16, 8, generator=gen) for h in (4, 2, 2))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    for kernel in (ring_attention, ulysses_attention):
        assert torch.allclose(kernel(q, k, v), ref, **TOL)


# ---- ranks: both kernels against the dense reference ---------------------------------------------------

def _documents(gen):
    """[B, S] int64 document ids from random EOD positions (a new document after each)."""
    eod = torch.rand(B, S, generator=gen) < 0.15
    return torch.cumsum(eod.long(), dim=1) - eod.long()     # the EOD token closes its own document


def _reference(q, k, v, do, segments):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    mask = None
    if segments is not None:
        mask = (torch.ones(S, S, dtype=torch.bool).tril() & (segments[:, :, None] == segments[:, None, :]))[:, None]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                         enable_gqa=q.shape[1] != k.shape[1])
    out.backward(do)
    return out.detach(), q.grad, k.grad, v.grad


def _close(a, b):
    a, b = a.detach().cpu(), b.detach().cpu()
    return bool(torch.allclose(a, b, **TOL)), float((a - b).abs().max())


def _cp_worker():
    from mtds.training.distributed import init_distributed
    init_distributed()          # ulysses talks through deepspeed.comm; a no-op for torch.distributed here
    world, rank = dist.get_world_size(), dist.get_rank()
    group = dist.new_group(list(range(world)))
    dev = group_device()
    pos = local_positions(S, world, rank)
    results, errors = {}, {}
    gen = torch.Generator().manual_seed(0)
    for hkv in (4, 2):
        q, k, v, do = (torch.randn(B, h, S, D, generator=gen) for h in (HQ, hkv, hkv, HQ))
        for docs in (False, True):
            segments = _documents(gen) if docs else None
            ref = _reference(q, k, v, do, segments)
            for comm in ("p2p", "a2a"):
                name = f"{comm}_hkv{hkv}_{'docs' if docs else 'causal'}"
                mine = [split_sequence(t, world, rank, dim=2).to(dev).requires_grad_() for t in (q, k, v)]
                local_segments = None if segments is None else split_sequence(segments, world, rank).to(dev)
                try:
                    out = cp_attention(comm, *mine, group=group, segments=local_segments)
                except ContextParallelError as err:
                    errors[name] = str(err)
                    continue
                out.backward(split_sequence(do, world, rank, dim=2).to(dev))
                for what, got, want in zip(("out", "dq", "dk", "dv"), (out, *(t.grad for t in mine)), ref):
                    results[f"{name}_{what}"] = _close(got, want[:, :, pos])
    results.update(_tiled(q, k, v, do, group, dev, gen))
    if world == 2:
        results.update(_compiled(q, k, v, do, group, dev))
    return results, errors


def _tiled(q, k, v, do, group, dev, gen):
    """The ring with its blocks cut into tiles of one query row (mtds.cp.blocks.SCORE_ELEMENTS, which bounds
    a block's scores at long sequences), causal and with documents, against the same dense reference."""
    from mtds.cp import blocks
    world, rank = dist.get_world_size(), dist.get_rank()
    pos, found, saved = local_positions(S, world, rank), {}, blocks.SCORE_ELEMENTS
    blocks.SCORE_ELEMENTS = 1
    try:
        for docs in (False, True):
            segments = _documents(gen) if docs else None
            ref = _reference(q, k, v, do, segments)
            mine = [split_sequence(t, world, rank, dim=2).to(dev).requires_grad_() for t in (q, k, v)]
            local_segments = None if segments is None else split_sequence(segments, world, rank).to(dev)
            assert len(blocks.row_tiles(mine[0].view(B, k.shape[1], -1, *mine[0].shape[2:]), 8)) == S // world
            out = cp_attention("p2p", *mine, group=group, segments=local_segments)
            out.backward(split_sequence(do, world, rank, dim=2).to(dev))
            for what, got, want in zip(("out", "dq", "dk", "dv"), (out, *(t.grad for t in mine)), ref):
                found[f"tiled_p2p_{'docs' if docs else 'causal'}_{what}"] = _close(got, want[:, :, pos])
    finally:
        blocks.SCORE_ELEMENTS = saved
    return found


def _compiled(q, k, v, do, group, dev):
    """Inside a torch.compile'd function (as --compile compiles a layer; "aot_eager" like tests/test_compile.py)
    the kernels run eagerly (torch.compiler.disable) and give the eager output and gradients exactly."""
    world, rank = dist.get_world_size(), dist.get_rank()
    found = {}
    for comm in ("p2p", "a2a"):
        def layer(q, k, v):
            return cp_attention(comm, q * 2, k, v, group=group) + 1
        runs = []
        for fn in (layer, torch.compile(layer, backend="aot_eager")):
            mine = [split_sequence(t, world, rank, dim=2).to(dev).requires_grad_() for t in (q, k, v)]
            out = fn(*mine)
            out.backward(split_sequence(do, world, rank, dim=2).to(dev))
            runs.append([out.detach(), *(t.grad for t in mine)])
        for what, eager, compiled in zip(("out", "dq", "dk", "dv"), *runs):
            found[f"compiled_{comm}_{what}"] = (bool(torch.equal(eager, compiled)),
                                                float((eager - compiled).abs().max()))
    return found


@pytest.mark.parametrize("world", [2, 4])
def test_cp_attention_matches_dense(world):
    for rank, (results, errors) in enumerate(spawn(_cp_worker, world)):
        bad = {key: err for key, (ok, err) in results.items() if not ok}
        assert not bad, f"rank {rank}: {bad}"
        expected = {f"{comm}_hkv{hkv}_{kind}_{what}" for comm in ("p2p", "a2a") for hkv in (4, 2)
                    for kind in ("causal", "docs") for what in ("out", "dq", "dk", "dv")
                    if not (comm == "a2a" and hkv == 2 and world == 4)}
        expected |= {f"tiled_p2p_{kind}_{what}" for kind in ("causal", "docs") for what in ("out", "dq", "dk", "dv")}
        if world == 2:
            expected |= {f"compiled_{comm}_{what}" for comm in ("p2p", "a2a") for what in ("out", "dq", "dk", "dv")}
        assert set(results) == expected
        if world == 4:       # 2 kv heads cannot split over 4 ranks
            assert set(errors) == {"a2a_hkv2_causal", "a2a_hkv2_docs"}
            assert errors["a2a_hkv2_causal"] == (
                "--cp-comm-type a2a needs the 4 query heads per TP rank and 2 key/value heads per TP rank "
                "divisible by C=4: use --cp-comm-type p2p or a C dividing both")
        else:
            assert not errors
