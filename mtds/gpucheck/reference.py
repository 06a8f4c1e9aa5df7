"""The single-process reference: HuggingFace ``GPT2LMHeadModel`` with mtds's initial weights, trained by
a plain loop -- torch AdamW, mtds's batches (same seed and order), the LR schedule written out in closed
form, clipping -- in fp32 (TF32 off): the values every mtds layout and precision is measured against.
Records each step's mean loss and pre-clip global gradient norm."""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from . import ds_configs as C


@dataclass(frozen=True)
class Reference:
    losses: list[float]
    grad_norms: list[float]


def lr_factor(step: int, warmup: int, total: int, floor: float) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine from 1 down to ``floor`` at step ``total`` (the
    schedule mtds.training.schedule implements, written here independently)."""
    if step < warmup:
        return (step + 1) / warmup
    if total <= warmup:
        return 1.0
    t = min(1.0, (step - warmup) / (total - warmup))
    return floor + (1 - floor) * (1 + math.cos(math.pi * t)) / 2


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
    from transformers import GPT2LMHeadModel

    from mtds.hf import hf_config_from_model_config, model_to_hf_state
    from mtds.model import GPTModel
    hf = GPT2LMHeadModel(hf_config_from_model_config(cfg))
    hf.load_state_dict(model_to_hf_state(GPTModel(cfg, seed=C.SEED)), strict=False)
    return hf.to(device)


def train_reference(workload, device, *, clip: float = C.CLIP) -> Reference:
    from mtds.data import MicroBatchStream, build_packed_dataset, load_tokenizer
    with exact_fp32():
        hf = hf_model(workload.model, device)
        hf.train()
        opt = torch.optim.AdamW(hf.parameters(), lr=C.LR, betas=C.BETAS, eps=C.EPS, weight_decay=C.WEIGHT_DECAY)
        floor = C.MIN_LR / C.LR
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, C.WARMUP, workload.steps, floor))
        dataset = build_packed_dataset(None, load_tokenizer(None), workload.seq, show_progress=False)
        B, b = workload.global_batch, workload.micro_batch
        stream = MicroBatchStream(dataset, global_batch_size=B, micro_batch_size=b, seed=C.SEED)
        losses, norms = [], []
        for _ in range(workload.steps):
            total = torch.zeros((), dtype=torch.float64, device=device)
            for _ in range(B // b):
                input_ids, labels = (t.to(device) for t in next(stream))
                logits = hf(input_ids=input_ids).logits
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
                (loss / (B // b)).backward()
                total += loss.detach().double() / (B // b)
            # The norm in float64: fp32's own sum is off by ~1e-5 relative on large embedding gradients.
            norm = torch.stack([p.grad.double().pow(2).sum() for p in hf.parameters() if p.grad is not None]).sum()
            norms.append(math.sqrt(float(norm)))
            if clip:
                torch.nn.utils.clip_grad_norm_(hf.parameters(), clip)
            opt.step()
            sched.step()
            opt.zero_grad()
            losses.append(float(total))
    return Reference(losses, norms)


def max_rel_diff(got: list[float], want: list[float]) -> float:
    if len(got) != len(want) or any(x is None for x in got):
        return math.inf
    return max(abs(x - y) / abs(y) for x, y in zip(got, want))
