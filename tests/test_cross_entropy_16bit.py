"""The vocab-parallel cross entropy of 16-bit logits without a float32 copy (``CHUNKED_16BIT``, off by default:
slower on an H200, see mtds/tp/cross_entropy.py): float32 arithmetic, no float32 copy of the logits.

Its values and gradients equal the float32 path run on an upcast copy (the arithmetic per element is the
same, in the same order), whatever the block of rows; and no float32 tensor larger than one block is made
(the float32 path makes one of the logits' size). Multi-rank TP runs of it are the bf16 parity tests."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import mtds.tp.cross_entropy as ce


def _case(dtype, vocab, padded, rows=64):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(rows // 8, 8, padded, generator=gen) * 3).to(dtype)
    target = torch.randint(0, vocab, (rows // 8, 8), generator=gen)
    target[0, :3] = -100
    return logits, target, torch.randn(rows // 8, 8, generator=gen)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [250, 256])          # 250: six padded columns
@pytest.mark.parametrize("block_rows", [1, 5, 1000])
def test_equals_the_float32_path_on_an_upcast_copy(monkeypatch, dtype, vocab, block_rows):
    logits, target, weight = _case(dtype, vocab, 256)
    upcast = logits.float().requires_grad_()
    want = ce._VocabParallelCrossEntropy.apply(upcast, target, None, vocab, -100, False)
    (want * weight).sum().backward()
    monkeypatch.setattr(ce, "_CHUNK_ELEMENTS", block_rows * 256)
    monkeypatch.setattr(ce, "CHUNKED_16BIT", True)
    logits.requires_grad_()
    got = ce.vocab_parallel_cross_entropy(logits, target, None, vocab_size=vocab, reduction="none")
    (got * weight).sum().backward()
    assert got.dtype == torch.float32 and logits.grad.dtype == dtype
    assert torch.equal(got, want)
    assert torch.equal(logits.grad, upcast.grad.to(dtype))


class _LargestFloat32(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_no_float32_tensor_of_the_logits_size(monkeypatch, dtype):
    logits, target, weight = _case(dtype, 250, 256, rows=256)
    monkeypatch.setattr(ce, "_CHUNK_ELEMENTS", 16 * 256)     # blocks of at least 16 rows of 256 ...
    monkeypatch.setattr(ce, "CHUNKED_16BIT", True)
    logits.requires_grad_()
    with _LargestFloat32() as watch:
        loss = ce.vocab_parallel_cross_entropy(logits, target, None, vocab_size=250)
        loss.backward()
    # ... and at most _MAX_BLOCKS (4) of them: 64 rows
    assert logits.numel() == 256 * 256 and watch.largest <= 64 * 256, watch.largest


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bench_switch_off_takes_the_float32_path_on_an_upcast(monkeypatch, dtype):
    """``CHUNKED_16BIT = False`` (the default, measured faster on an H200; benchmarks/gpu_bench.py's A/B sets
    it): the float32 path on a copy of the logits' size, with the same values as the chunked path."""
    logits, target, _ = _case(dtype, 250, 256, rows=256)
    monkeypatch.setattr(ce, "CHUNKED_16BIT", True)
    want = ce.vocab_parallel_cross_entropy(logits, target, None, vocab_size=250)
    monkeypatch.setattr(ce, "CHUNKED_16BIT", False)
    with _LargestFloat32() as watch:
        got = ce.vocab_parallel_cross_entropy(logits, target, None, vocab_size=250)
    assert watch.largest >= logits.numel(), watch.largest
    assert torch.equal(got, want)
