"""gpucheck's single-process reference: mtds.gpucheck.hf_reference's loop (the test suite's) with torch
AdamW at the GPU shapes, in fp32 with TF32 off: the values every mtds layout and precision is measured
against; and the same loop under torch.autocast, which shows how far 16-bit rounding alone moves each step."""
from __future__ import annotations

import contextlib
import math

import torch

from mtds.gpucheck.hf_reference import Reference, hf_with_mtds_weights, lr_factor, mtds_batches
from mtds.gpucheck.hf_reference import train_reference as run_reference_loop

from mtds.gpucheck import ds_configs as C


@contextlib.contextmanager
def exact_fp32():
    """fp32 matmuls in fp32 on CUDA (no TF32) inside the block; the previous flags after it."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def hf_model(cfg, device):
    """GPT2LMHeadModel holding the weights mtds initialises (seed :data:`ds_configs.SEED`), on ``device``."""
    return hf_with_mtds_weights(cfg, C.SEED).to(device)


def train_reference(workload, device, *, clip: float = C.CLIP, autocast=None, scaler=None) -> Reference:
    """The reference loop at ``workload`` (``autocast``/``scaler``: its 16-bit form, see below)."""
    with exact_fp32():
        hf = hf_model(workload.model, device)
        opt = torch.optim.AdamW(hf.parameters(), lr=C.LR, betas=C.BETAS, eps=C.EPS, weight_decay=C.WEIGHT_DECAY)
        floor = C.MIN_LR / C.LR
        B, b = workload.global_batch, workload.micro_batch
        return run_reference_loop(hf, mtds_batches(workload.seq, B, b, C.SEED), steps=workload.steps,
                                  micro_batches=B // b, optimizer=opt, clip=clip, device=device,
                                  lr_lambda=lambda s: lr_factor(s, C.WARMUP, workload.steps, floor),
                                  autocast=autocast, scaler=scaler)


def train_reference_autocast(workload, device, precision: str, *, clip: float = C.CLIP) -> Reference:
    """The same loop in 16-bit as HF users run it: fp32 weights and AdamW under ``torch.autocast(precision)``,
    fp16 behind ``GradScaler`` (initial scale 2^8, as the checks' DeepSpeed config). An implementation of
    16-bit training independent of mtds and DeepSpeed: how far *it* drifts from the fp32 reference at each
    step is how far rounding alone can move that step (see parity.judge)."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0 ** 8) if precision == "fp16" else None
    return train_reference(workload, device, clip=clip, autocast=dtype, scaler=scaler)


def max_rel_diff(got: list[float], want: list[float]) -> float:
    if len(got) != len(want) or any(x is None for x in got):
        return math.inf
    return max(abs(x - y) / abs(y) for x, y in zip(got, want))
