"""The fused vocab-parallel cross entropy (mtds/tp/fused_cross_entropy.py, train.py's --cross-entropy-loss-fusion)
against the float32 path (mtds/tp/cross_entropy.py), on test_cross_entropy_16bit's cases (six padded vocabulary
columns at vocab 250, three ignored targets).

Inductor's CPU compile of the pieces costs seconds (docs/training.md), so the numerics at every case, at t = 1
and t = 2, run the same Python functions under torch.compile's "aot_eager" backend (the graphs as traced, no
fusion): equal to the float32 path bit for bit, as the arithmetic and its order are the same; at t = 2 with two
all-reduces instead of three. The Inductor-compiled pieces -- what fuses, and what train.py runs -- are held on
bf16 logits at t = 1 (MTDS_TEST_INDUCTOR=1 adds fp32 logits and t = 2): values within float32 rounding of the
float32 path; at most 8 operators and kernels per micro-batch, forward + backward (measured: one C++ kernel each
way and no eager operator at t = 1, 4 kernels and 2 all-reduces at t = 2; the float32 path: 43-48 operators);
one graph per piece; no float32 tensor of the logits' size."""
import os

import pytest
import torch

import mtds.tp.cross_entropy as ce
import mtds.tp.fused_cross_entropy as fused
from lab.testing import spawn
from lab.testing.op_counts import CompiledGraphs, OpCounts
from tests.bounds import within
from tests.test_cross_entropy_16bit import _case, _LargestFloat32

# Inductor's C++ loops sum in another order (vectorised lanes) than ATen's. Measured against the float32 path on
# the Inductor case (rows = 256, vocab 250 of 256), largest under native (AVX-512), avx2 and default kernels
# (docs/testing.md, "16-bit bounds"): the loss within 3.8e-7 relative (default; native 9.6e-8); the gradient of
# fp32 logits within 5.3e-7 of its largest entry (default; native 2.4e-7), of bf16 logits within one bf16 ulp
# under all three (a sum that rounds the other way). Held at 3.9x and 3.8x those; bf16 at one ulp (two fail). A
# sum of exponentials one bf16 ulp high (S_i x (1 + 2^-8)) moves the loss 3.9e-4 and the fp32 gradient 3.8e-3
# (bf16's stays within one ulp: the loss check catches it).
LOSS_RTOL = 1.5e-6
GRAD_RTOL = {torch.float32: 2e-6, torch.bfloat16: 1.5}    # of the largest entry; bf16: in ulps of each entry (one)


def _bf16_ulps(got, want):
    """|got - want| in units of the last place of each bf16 ``want`` (2^(e-8) for |want| in [2^(e-1), 2^e)); where
    ``want`` is 0 any difference counts as huge."""
    _, exponent = torch.frexp(want.float())
    ulp = torch.where(want == 0, 2.0 ** -133, torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), exponent - 8))
    return (got.float() - want.float()).abs() / ulp


@pytest.fixture(autouse=True)
def _graphs_for_every_case(monkeypatch):
    import torch._dynamo
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    # Inductor writes C++ for the vector ISA ATEN_CPU_CAPABILITY picks (pick_vec_isa), but its FX graph cache key
    # leaves that ISA out: run under another ATEN_CPU_CAPABILITY on one cache, it loads the C++ written for the
    # other width and compiles it with this one's flags (AVX-512 loops over AVX2 vectors skip half the vocabulary:
    # loss -inf vs 9.96; AVX2 code without a vector ISA does not compile). One cache per ISA.
    vec = pick_vec_isa()
    isa = str(vec).replace(" ", "+") if vec else "none"
    base = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", os.path.join(base, f"vec-isa-{isa}"))
    # a graph per piece, dtype, vocabulary and reduction: more than Dynamo's 8 per function in one process
    with torch._dynamo.config.patch(recompile_limit=64):
        yield


def _float32_path(logits, target, weight, vocab, reduction, group=None):
    """The float32 path's loss and gradient on ``logits`` (an upcast copy for 16-bit ones, as it makes itself)."""
    z = logits.detach().clone().requires_grad_()
    loss = ce.vocab_parallel_cross_entropy(z, target, group, vocab_size=vocab, reduction=reduction)
    (loss * weight if reduction == "none" else loss).sum().backward()
    return loss.detach(), z.grad


def _fused(logits, target, weight, vocab, reduction, group=None, backend="aot_eager"):
    z = logits.detach().clone().requires_grad_()
    loss = fused.fused_cross_entropy(z, target, group, vocab_size=vocab, reduction=reduction, backend=backend)
    (loss * weight if reduction == "none" else loss).sum().backward()
    return loss.detach(), z.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_equals_the_float32_path(dtype):
    # per-token losses (each row's gradient weighed apart) with and without padding; the reductions padded
    for vocab, reduction in ((250, "none"), (256, "none"), (250, "sum"), (250, "mean")):
        logits, target, weight = _case(dtype, vocab, 256)
        want, want_grad = _float32_path(logits, target, weight, vocab, reduction)
        got, grad = _fused(logits, target, weight, vocab, reduction)
        assert got.dtype == torch.float32 and grad.dtype == dtype
        assert torch.equal(got, want), (vocab, reduction, (got - want).abs().max())
        assert torch.equal(grad, want_grad), (vocab, reduction, (grad.float() - want_grad.float()).abs().max())
        if vocab == 250:
            assert not grad[..., 250:].any()       # padded columns take no probability, get no gradient


def _two_ranks():
    """At t = 2 (each rank the half of the vocabulary its shard holds): the fused loss and gradient equal the
    float32 path's at t = 2, with two all-reduces instead of three."""
    import torch.distributed as dist
    group = dist.new_group([0, 1])
    rank = dist.get_rank()
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        for reduction in ("none", "mean"):
            logits, target, weight = _case(dtype, 250, 256)
            shard = logits[..., rank * 128:(rank + 1) * 128]
            with OpCounts() as ops:
                want, want_grad = _float32_path(shard, target, weight, 250, reduction, group)
            reduces = [ops.counts["c10d.allreduce_.default"]]
            with OpCounts() as ops:
                got, grad = _fused(shard, target, weight, 250, reduction, group)
            reduces.append(ops.counts["c10d.allreduce_.default"])
            out[(str(dtype), reduction)] = (torch.equal(got, want), torch.equal(grad, want_grad),
                                            (got - want).abs().max().item(), reduces)
    return out


def test_two_tensor_parallel_ranks():
    for rank in spawn(_two_ranks, 2):
        for case, (loss_equal, grad_equal, diff, reduces) in rank.items():
            assert loss_equal and grad_equal, (case, diff)
            assert reduces == [3, 2], (case, reduces)      # max, target logit, sum of exp -> max, [sum; target]


class _Float32Outputs(_LargestFloat32):
    """test_cross_entropy_16bit's watch, with compiled code run compiled (CompiledGraphs sees its buffers)."""

    @classmethod
    def ignore_compile_internals(cls):
        return True


def _count(fn, logits, target, seed):
    """Operators and Inductor kernels of one micro-batch's loss forward and backward (the gradient seed made
    outside: autograd's own ones_like is no operator of the loss), and the largest float32 tensor made."""
    z = logits.detach().clone().requires_grad_()
    with OpCounts() as ops, CompiledGraphs() as graphs, _Float32Outputs() as f32:
        loss = fn(z, target)
        grad, = torch.autograd.grad(loss, z, seed)
    compiled_f32 = [s for s, dtype in graphs.buffers if dtype == torch.float32]
    largest = max([f32.largest] + [torch.Size(s).numel() for s in compiled_f32])
    return sum(ops.counts.values()) + graphs.kernels, largest, graphs, loss.detach(), grad


def _inductor_failures(dtype, group=None) -> str:
    """The Inductor pieces against the float32 path on this rank's shard of one case (rows = 256, vocabulary 250
    of 256), one micro-batch forward + backward: the checks that failed, with the numbers; "" when none."""
    import torch.distributed as dist
    world, rank = (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))
    logits, target, _ = _case(dtype, 250, 256, rows=256)
    width = 256 // world
    logits = logits[..., rank * width:(rank + 1) * width].contiguous()
    seed, flat = torch.ones(()), logits.numel()

    def float32_path(z, t):
        return ce.vocab_parallel_cross_entropy(z, t, group, vocab_size=250)

    def inductor(z, t):
        return fused.fused_cross_entropy(z, t, group, vocab_size=250)

    before, before_f32, _, want, want_grad = _count(float32_path, logits, target, seed)
    inductor(logits.detach().clone().requires_grad_(), target).backward()      # compiles (not counted)
    after, after_f32, graphs, got, grad = _count(inductor, logits, target, seed)
    kernels = 2 if world == 1 else 4
    error = (grad.float() - want_grad.float()).abs()
    grad_error = (_bf16_ulps(grad, want_grad) if dtype == torch.bfloat16 else error / want_grad.abs().max()).max()
    name = f"fused_cross_entropy.inductor.{str(dtype).split('.')[-1]}.t{world}"
    checks = {
        # t = 1: one C++ kernel forward, one backward, nothing eager; t = 2: three forward (max, sums, loss) and
        # the two all-reduces. The float32 path: 43-48 operators.
        "operators + kernels <= 8, one graph per piece": after <= 8 and graphs.kernels == graphs.runs == kernels
        and before > 8,
        # the compiled code's buffers are seen (the gradient, in the logits' dtype) ...
        "the gradient buffer seen": ((flat // width, width), dtype) in graphs.buffers,
        # ... and none is a float32 one of the logits' size (the float32 path's is)
        "no float32 [N, V]": dtype != torch.bfloat16 or after_f32 < flat <= before_f32,
        "loss": within(f"{name}.loss", ((got - want).abs() / want.abs()).item(), LOSS_RTOL),
        "gradient": grad.dtype == dtype and within(f"{name}.gradient", grad_error.item(), GRAD_RTOL[dtype]),
    }
    failed = [name for name, ok in checks.items() if not ok]
    return failed and (f"{failed}: {after} operators + kernels in {graphs.runs} graphs (the float32 path: "
                       f"{before}), largest float32 tensor {after_f32} (logits {flat}), loss {got.item():.7g} vs "
                       f"{want.item():.7g}, gradient error {error.max().item():.3g}")


# Inductor's C++ compile costs seconds a graph the first time (docs/training.md): the suite compiles the case the
# claims are about, bf16 at t = 1; MTDS_TEST_INDUCTOR=1 (as for tests/test_compile.py) adds fp32 and t = 2.
# (A mode of the suite, as test_compile.py's backend: the extra cases are not collected otherwise, not skipped.)
EVERY_INDUCTOR_CASE = bool(os.environ.get("MTDS_TEST_INDUCTOR"))


@pytest.mark.parametrize("dtype", [torch.bfloat16] + [torch.float32] * EVERY_INDUCTOR_CASE, ids=str)
def test_inductor_pieces_fuse_the_loss(dtype):
    failures = _inductor_failures(dtype)
    assert not failures, failures


def _two_ranks_inductor():
    import torch.distributed as dist
    group = dist.new_group([0, 1])
    return [_inductor_failures(dtype, group) for dtype in (torch.bfloat16, torch.float32)]


def _inductor_pieces_at_two_ranks():
    # fresh ranks: Inductor's compile leaves a thread pool running, which a pooled rank's reset refuses
    for rank in spawn(_two_ranks_inductor, 2, fresh=True, timeout=600):
        assert not any(rank), rank


if EVERY_INDUCTOR_CASE:
    test_inductor_pieces_at_two_ranks = _inductor_pieces_at_two_ranks


def _train_losses():
    """A tiny run's losses without and with --cross-entropy-loss-fusion (the pieces under aot_eager here: the
    flag's way from TrainConfig to the loss is what is held), and how often the fused loss ran."""
    from mtds.training import run
    from tests.training_helpers import ds_config, train_config
    calls = []
    compiled = fused.pieces

    def counted(backend):
        calls.append(backend)
        return compiled("aot_eager")

    fused.pieces = counted      # the rank's pool puts the module back after the body
    config = dict(steps=2, deepspeed_config=ds_config(train_batch_size=2))
    return [run(train_config(**config, cross_entropy_loss_fusion=on)).losses for on in (False, True)], calls


def test_the_flag_reaches_the_loss():
    (plain, fusion), calls = spawn(_train_losses, 1)[0]
    assert calls == ["inductor"] * 2, calls      # one micro-batch a step, the pieces --cross-entropy-fusion-impl names
    assert plain == pytest.approx(fusion, rel=1e-6, abs=0), (plain, fusion)      # measured: equal


def test_only_the_native_impl():
    """train.py refuses --cross-entropy-fusion-impl te by its choices (tests/test_bad_input.py); a Python caller
    gets the same one line from TrainConfig, and the loss refuses what it does not build."""
    from mtds.training import TrainConfig
    with pytest.raises(ValueError, match=r"^--cross-entropy-fusion-impl must be native \(te is not built\), got 'te'$"):
        TrainConfig("x.json", cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="te")
    logits, target, _ = _case(torch.float32, 250, 256)
    with pytest.raises(ValueError, match="cross entropy impl must be 'native'"):
        ce.vocab_parallel_cross_entropy(logits, target, vocab_size=250, impl="te")
