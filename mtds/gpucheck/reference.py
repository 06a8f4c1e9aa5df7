"""gpucheck's single-process reference: mtds.testing.hf_reference's loop (the test suite's) with torch
AdamW at the GPU shapes, in fp32 with TF32 off: the values every mtds layout and precision is measured
against."""
from __future__ import annotations

import contextlib
import math

import torch

from mtds.testing.hf_reference import Reference, hf_with_mtds_weights, lr_factor, mtds_batches
from mtds.testing.hf_reference import train_reference as run_reference_loop

from . import ds_configs as C


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


def train_reference(workload, device, *, clip: float = C.CLIP) -> Reference:
    with exact_fp32():
        hf = hf_model(workload.model, device)
        opt = torch.optim.AdamW(hf.parameters(), lr=C.LR, betas=C.BETAS, eps=C.EPS, weight_decay=C.WEIGHT_DECAY)
        floor = C.MIN_LR / C.LR
        B, b = workload.global_batch, workload.micro_batch
        return run_reference_loop(hf, mtds_batches(workload.seq, B, b, C.SEED), steps=workload.steps,
                                  micro_batches=B // b, optimizer=opt, clip=clip, device=device,
                                  lr_lambda=lambda s: lr_factor(s, C.WARMUP, workload.steps, floor))


def max_rel_diff(got: list[float], want: list[float]) -> float:
    if len(got) != len(want) or any(x is None for x in got):
        return math.inf
    return max(abs(x - y) / abs(y) for x, y in zip(got, want))
