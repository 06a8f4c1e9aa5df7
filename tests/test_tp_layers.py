"""Every TP layer against its dense torch.nn reference, for t in {1, 2, 4} on real gloo ranks (fp32)."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mtds.parallel.layout import ParallelLayout
from mtds.tp import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, gather_vocab_parallel_logits,
                     parallel_lm_logits, shard_rows, unshard_rows, vocab_parallel_cross_entropy)
from mtds.training.distributed import group_device
from tests.dist import spawn

TOL = dict(rtol=1e-6, atol=1e-6)


def _seeded_init(seed):
    def init(t):
        gen = torch.Generator().manual_seed(seed)
        t.copy_(torch.randn(t.shape, generator=gen) * 0.1)
    return init


def _gather_rows(shard, group, dim, segments=None):
    parts = [torch.empty_like(shard) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, shard.contiguous(), group=group)
    return unshard_rows(parts, dim, segments)


def _close(a, b):
    a, b = a.detach().cpu(), b.detach().cpu()
    return torch.allclose(a, b, **TOL), float((a - b).abs().max())


def _layers_worker():
    t = dist.get_world_size()
    group = ParallelLayout.for_world(t, tp=t).build_groups().tp_group
    results = {}
    dev = group_device()        # the suite's CUDA mode runs the same check on the rank's GPU under NCCL
    x_full = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(0)).to(dev)

    # Column parallel, fused segments (like q|k|v with 2 kv heads), gather_output both ways.
    for gather in (False, True):
        segments = [16, 8, 8]
        col = ColumnParallelLinear(16, 32, group=group, init_method=_seeded_init(1), output_segments=segments,
                                   gather_output=gather).to(dev)
        with torch.no_grad():
            col.bias.copy_(shard_rows(torch.arange(32.0) / 32, 0, t, dist.get_rank(), segments))
        dense = torch.nn.Linear(16, 32).to(dev)
        with torch.no_grad():
            dense.weight.copy_(_gather_rows(col.weight.detach(), group, 0, segments))
            dense.bias.copy_(torch.arange(32.0) / 32)
        _init_check = torch.empty(32, 16)
        _seeded_init(1)(_init_check)
        results[f"col_init_layout_free_{gather}"] = _close(dense.weight, _init_check)
        x1, x2 = x_full.clone().requires_grad_(), x_full.clone().requires_grad_()
        y = col(x1)
        y_ref = dense(x2)
        y_full = y if gather else _gather_rows(y.detach().transpose(0, -1), group, 0, segments).transpose(0, -1)
        results[f"col_fwd_{gather}"] = _close(y_full, y_ref)
        grad_out = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(3)).to(dev)
        y.backward(grad_out if gather else shard_rows(grad_out.transpose(0, -1), 0, t, dist.get_rank(),
                                                      segments).transpose(0, -1))
        y_ref.backward(grad_out)
        results[f"col_dx_{gather}"] = _close(x1.grad, x2.grad)
        results[f"col_dw_{gather}"] = _close(_gather_rows(col.weight.grad, group, 0, segments), dense.weight.grad)
        results[f"col_db_{gather}"] = _close(_gather_rows(col.bias.grad, group, 0, segments), dense.bias.grad)

    # Row parallel, parallel input and scattered input; bias added once.
    for parallel_in in (True, False):
        row = RowParallelLinear(16, 12, group=group, init_method=_seeded_init(2), input_is_parallel=parallel_in).to(dev)
        with torch.no_grad():
            row.bias.copy_(torch.linspace(-1, 1, 12))
        dense = torch.nn.Linear(16, 12).to(dev)
        with torch.no_grad():
            dense.weight.copy_(_gather_rows(row.weight.detach(), group, 1))
            dense.bias.copy_(row.bias)
        x2 = x_full.clone().requires_grad_()
        x_in = x_full.chunk(t, dim=-1)[dist.get_rank()] if parallel_in else x_full
        x1 = x_in.clone().requires_grad_()
        y, y_ref = row(x1), dense(x2)
        results[f"row_fwd_{parallel_in}"] = _close(y, y_ref)
        grad_out = torch.randn(y_ref.shape, generator=torch.Generator().manual_seed(4)).to(dev)
        y.backward(grad_out)
        y_ref.backward(grad_out)
        dx_ref = x2.grad.chunk(t, dim=-1)[dist.get_rank()] if parallel_in else x2.grad
        results[f"row_dx_{parallel_in}"] = _close(x1.grad, dx_ref)
        results[f"row_dw_{parallel_in}"] = _close(_gather_rows(row.weight.grad, group, 1), dense.weight.grad)
        results[f"row_db_{parallel_in}"] = _close(row.bias.grad, dense.bias.grad)

    # Vocab-parallel embedding + tied LM head + cross entropy; vocab 250 is not divisible by t,
    # padding to a multiple of 8*t makes shards that hold padding only (t=4: 256/4 = 64 rows each).
    vocab, hidden = 250, 16
    emb = VocabParallelEmbedding(vocab, hidden, group=group, init_method=_seeded_init(5), pad_to_multiple_of=8).to(dev)
    results["padded_size"] = emb.padded_vocab_size
    full_w = _gather_rows(emb.weight.detach(), group, 0)
    results["padding_rows_zero"] = bool((full_w[vocab:] == 0).all())
    dense_emb = torch.nn.Embedding(vocab, hidden).to(dev)
    with torch.no_grad():
        dense_emb.weight.copy_(full_w[:vocab])
    ids = torch.randint(0, vocab, (3, 7), generator=torch.Generator().manual_seed(6))
    ids[0, 0], ids[1, 1] = vocab - 1, 0
    labels = torch.randint(0, vocab, (3, 7), generator=torch.Generator().manual_seed(7))
    labels[0, :3] = -100
    labels[2, 6] = vocab - 1
    ids, labels = ids.to(dev), labels.to(dev)

    h1 = emb(ids)
    logits = parallel_lm_logits(h1, emb.weight, group)
    loss = vocab_parallel_cross_entropy(logits, labels, group, vocab_size=vocab)
    loss.backward()
    h2 = dense_emb(ids)
    logits_ref = h2 @ dense_emb.weight.t()
    loss_ref = F.cross_entropy(logits_ref.reshape(-1, vocab), labels.reshape(-1), ignore_index=-100)
    loss_ref.backward()
    results["emb_fwd"] = _close(h1.detach(), h2.detach())
    results["logits"] = _close(gather_vocab_parallel_logits(logits.detach(), group, vocab), logits_ref.detach())
    results["loss"] = _close(loss.detach(), loss_ref.detach())
    grad_full = _gather_rows(emb.weight.grad, group, 0)
    results["emb_dw"] = _close(grad_full[:vocab], dense_emb.weight.grad)
    results["padding_grad_zero"] = bool((grad_full[vocab:] == 0).all())

    # Per-token losses and a sum reduction, bf16 logits stay finite and close.
    per_token = vocab_parallel_cross_entropy(logits.detach(), labels, group, vocab_size=vocab, reduction="none")
    ref_tok = F.cross_entropy(logits_ref.detach().reshape(-1, vocab), labels.reshape(-1), reduction="none")
    results["per_token"] = _close(per_token.reshape(-1), ref_tok)
    big = logits.detach() * 1000  # stability: huge logits must not overflow exp
    results["stable"] = bool(torch.isfinite(vocab_parallel_cross_entropy(big, labels, group, vocab_size=vocab)))
    return results


@pytest.mark.parametrize("t", [1, 2, 4])
def test_tp_layers_match_dense_reference(t):
    for rank, results in enumerate(spawn(_layers_worker, t, timeout=180)):
        assert results.pop("padded_size") == 256     # 250 rounded up to a multiple of 8 t (t = 1, 2, 4)
        for name, value in results.items():
            ok = value[0] if isinstance(value, tuple) else value
            assert ok, f"t={t} rank={rank} {name}: max abs diff {value}"


def test_shard_unshard_roundtrip_with_segments():
    full = torch.arange(48.0).reshape(12, 4)
    shards = [shard_rows(full, 0, 2, r, [8, 2, 2]) for r in range(2)]
    assert shards[0][:, 0].tolist() == [0, 4, 8, 12, 32, 40]
    assert torch.equal(unshard_rows(shards, 0, [8, 2, 2]), full)
    with pytest.raises(ValueError, match="not divisible by tensor parallel size 4"):
        shard_rows(full, 0, 4, 0, [6, 3, 3])
