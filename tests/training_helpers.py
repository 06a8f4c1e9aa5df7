"""Shared pieces of the training tests: a tiny model, DeepSpeed configs, runs on spawned ranks, and
the single-process HuggingFace reference (the transformers model of the config's family + torch.optim.AdamW on
the same batches)."""
from __future__ import annotations

import contextlib
import functools
import os

import torch

from mtds.model.config import ModelConfig
from lab.testing import spawn
from mtds.gpucheck.hf_reference import Reference, hf_with_mtds_weights, lr_factor, mtds_batches, train_reference

TINY = ModelConfig(vocab_size=8192, hidden_size=64, num_layers=4, num_heads=4, max_position_embeddings=64)
SEQ = 32
STEPS = 10
LR = 2e-3
CLIP = 0.5    # low enough that most steps are clipped: tests the global norm across layouts
SEED = 1234
BATCH = dict(train_batch_size=8, train_micro_batch_size_per_gpu=2)


SGD_LR = 0.5  # plain SGD needs a large step to move this tiny model; no Adam normalisation hides scale


def ds_config(zero: int = 1, precision: str = "fp32", clip: float = CLIP, optimizer: str = "adamw", **extra) -> dict:
    """``optimizer``: "adamw" (scale-invariant updates) or "sgd" (updates proportional to the gradient)."""
    if optimizer == "sgd":
        opt = {"type": "SGD", "params": {"lr": SGD_LR}}
    else:
        opt = {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1,
                                           "torch_adam": True}}
    config = {
        **BATCH,
        "gradient_clipping": clip,
        "optimizer": opt,
        "zero_optimization": {"stage": zero},
    }
    if optimizer == "sgd":
        config["zero_allow_untested_optimizer"] = True
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    if precision == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 1000,
                          "hysteresis": 1, "min_loss_scale": 1}
    config.update(extra)
    return config


def train_config(tp=1, pp=1, **kwargs):
    from mtds.training import TrainConfig
    base = dict(deepspeed_config=ds_config(), model=TINY, tp=tp, pp=pp, steps=STEPS, seq_length=SEQ,
                eval_split=0.0, seed=SEED, warmup_steps=2, lr_decay="cosine", min_lr=LR / 10, progress=False)
    base.update(kwargs)
    if base["deepspeed_config"]["optimizer"]["type"] == "SGD" and "min_lr" not in kwargs:
        base["min_lr"] = SGD_LR / 10
    return TrainConfig(**base)


def _run_all(configs, force_fp16: bool, watch_reduction: bool = False):
    if force_fp16:
        # This CPU lacks fp16 kernels DeepSpeed checks for; the test process pretends it has them.
        from deepspeed.accelerator import get_accelerator
        get_accelerator().is_fp16_supported = lambda: True
    from mtds.training import run
    if not watch_reduction:
        return [run(cfg) for cfg in configs]
    results = []
    for cfg in configs:
        with largest_reduction_allocation() as largest:
            result = run(cfg)
        result.largest_reduction_allocation = largest[0]
        results.append(result)
    return results


@contextlib.contextmanager
def largest_reduction_allocation():
    """[the most elements of one tensor the ZeRO-1 reduce-scatter allocated (filling its buckets and
    reducing them), over every reduction while the block runs]. The class is restored afterwards (the
    ranks are pooled)."""
    from mtds.deepspeed_compat.zero1_reduce import Zero1ReduceScatter
    from tests.alloc_watch import LargestAllocation
    largest, reduce = [0], Zero1ReduceScatter._reduce

    def watched(self, *args, **kwargs):
        with LargestAllocation() as watch:
            reduce(self, *args, **kwargs)
        largest[0] = max(largest[0], watch.elements)

    Zero1ReduceScatter._reduce = watched
    try:
        yield largest
    finally:
        Zero1ReduceScatter._reduce = reduce


def run_layouts(world: int, configs: list, *, force_fp16: bool = False, timeout: float = 600,
                watch_reduction: bool = False):
    """Run several TrainConfigs one after another on the same ``world`` ranks; per-rank RunResults
    (``watch_reduction``: each with ``largest_reduction_allocation``, see the function of that name)."""
    return spawn(_run_all, world, configs, force_fp16, watch_reduction, timeout=timeout)


def hf_reference(cfg=TINY, steps: int = STEPS, clip: float = CLIP, optimizer: str = "adamw",
                 lr: float | None = None, seq: int = SEQ, batch: tuple[int, int] | None = None) -> Reference:
    """The HF model of ``cfg.architecture`` (GPT2LMHeadModel, LlamaForCausalLM, ...) with mtds's initial
    weights, trained by :func:`train_hf`; computed once per test session for each set of arguments
    (several test modules compare against the same one). ``lr``: the peak AdamW rate [LR]; ``seq``
    tokens per sample; ``batch``: (global, micro) batch [BATCH's]."""
    return _hf_reference(cfg, steps, clip, optimizer, lr, seq, batch)


@functools.lru_cache(maxsize=None)
def _hf_reference(cfg, steps: int, clip: float, optimizer: str, lr: float | None, seq: int,
                  batch: tuple[int, int] | None) -> Reference:
    hf = hf_with_mtds_weights(cfg, SEED)
    threads = torch.get_num_threads()
    torch.set_num_threads(len(os.sched_getaffinity(0)))      # the ranks wait meanwhile: use every core
    try:
        return train_hf(hf, steps, clip, optimizer, lr, seq=seq, batch=batch)
    finally:
        torch.set_num_threads(threads)


def hf_reference_losses(cfg=TINY, steps: int = STEPS, clip: float = CLIP) -> list[float]:
    return hf_reference(cfg, steps, clip).losses


def train_hf(hf, steps: int = STEPS, clip: float = CLIP, optimizer: str = "adamw", lr: float | None = None,
             seq: int = SEQ, batch: tuple[int, int] | None = None) -> Reference:
    """The reference loop (mtds.gpucheck.hf_reference, shared with mtds.gpucheck): torch AdamW (or plain
    SGD), mtds's batches, warm-up 2 then cosine to lr/10 at ``steps``, clipping; pre-clip norms.
    ``lr``: AdamW's peak rate [LR] (the mtds run passes the same as ``train_config(lr=..., min_lr=lr / 10)``)."""
    if optimizer == "sgd":
        base_lr = SGD_LR
        opt = torch.optim.SGD(hf.parameters(), lr=base_lr)
    else:
        base_lr = lr or LR
        opt = torch.optim.AdamW(hf.parameters(), lr=base_lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    floor = (base_lr / 10) / base_lr
    B, b = batch or (BATCH["train_batch_size"], BATCH["train_micro_batch_size_per_gpu"])
    return train_reference(hf, mtds_batches(seq, B, b, SEED), steps=steps, micro_batches=B // b, optimizer=opt,
                           lr_lambda=lambda s: lr_factor(s, 2, steps, floor), clip=clip)


def max_rel_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


# fp32 global norms whose squares are summed in another order (a few ulps): measured 8.2e-8 under avx2 kernels, 0
# native and default (docs/testing.md, "16-bit bounds")
NORM_ORDER_TOL = 1e-6


def assert_same_up_to_norm_order(got, want, what: str, history_equal: bool = True) -> None:
    """Two runs whose per-parameter arithmetic is the same but whose global grad norm sums its squares
    in another order (other layers share a rank: interleaved, DualPipeV; which order is fastest
    differs between CPU models). Grad norms within :data:`NORM_ORDER_TOL` relative; losses bit-equal
    up to and including the first step whose norm differs (a clipped step then scales the gradients by
    a coefficient an ulp apart), after that within the same tolerance. ``history_equal``: the runs
    began from bit-equal states and compute bit-equal per-parameter gradients (False for a resume whose
    saving run had already diverged by an ulp, and for DualPipeV against 1F1B, whose tied embedding
    gradient is summed in another order)."""
    from tests.bounds import same, within
    assert len(got.losses) == len(want.losses), (what, got.losses, want.losses)
    diff = max_rel_diff(got.grad_norms, want.grad_norms)
    assert within("norm_order.norm", diff, NORM_ORDER_TOL), \
        f"{what}: grad norms max rel diff {diff:.2e}\n{got.grad_norms}\n{want.grad_norms}"
    first = next((i for i, (a, b) in enumerate(zip(got.grad_norms, want.grad_norms)) if a != b), len(got.grad_norms))
    if history_equal:
        assert same("norm_order.losses_until_norms_differ", got.losses[:first + 1], want.losses[:first + 1]), \
            f"{what}: losses differ before the norms do (step {first + 1})\n{got.losses}\n{want.losses}"
    diff = max_rel_diff(got.losses, want.losses)
    assert within("norm_order.loss", diff, NORM_ORDER_TOL), \
        f"{what}: losses max rel diff {diff:.2e}\n{got.losses}\n{want.losses}"


DP_BYTES_TOL = 0.01   # DeepSpeed pads its flat partitions; the loss and norm scalars ride the same group


def assert_dp_bytes_at_ring_minimum(per_rank: list, index: int, dp: int, what: str, factor: int = 2,
                                    value_bytes: int = 4) -> None:
    """ZeRO-1 (``factor`` 2): every rank's data-parallel collectives in the last step put 2Ψ(d-1)/d x
    ``value_bytes`` bytes on its link (mtds.parallel.ring's bus bytes, by the tracer, per direction), Ψ its trainable
    parameters: a gradient reduce-scatter and a parameter all-gather, each (d-1)/d. DeepSpeed's all-reduce
    + all-gather is 3."""
    for rank, results in enumerate(per_rank):
        result = results[index]
        # what the rank sends: a point-to-point ring's receives are its neighbours' sends, counted there
        bus = sum(v["bus_bytes"] for key, v in result.comm.items() if key.endswith("/dp") and not key.startswith("recv/"))
        want = factor * (dp - 1) / dp * value_bytes * result.params
        assert result.params > 0 and abs(bus / want - 1) <= DP_BYTES_TOL, \
            (f"{what} rank {rank}: data-parallel bus bytes {bus} = {bus / want:.4f} x {factor}Ψ(d-1)/d "
             f"(Ψ = {result.params}, d = {dp})", result.comm)
