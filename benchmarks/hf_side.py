"""The baseline: HuggingFace ``GPT2LMHeadModel`` + ``torch.optim.AdamW``, a plain PyTorch loop.

One step = next batch, forward, cross entropy over the logits (labels come pre-shifted from the data
pipeline, as on the mtds side), backward, ``clip_grad_norm_(1.0)``, ``AdamW.step``, ``zero_grad``.
Runs inside a spawned rank (``lab.testing.spawn``), like the mtds side, so both sides have the same
process structure and their RSS is comparable.

``fused``: torch's fused AdamW kernel (one pass over every tensor) instead of its default per-tensor loop
on CPU -- what mtds asks DeepSpeed for (benchmarks/bench_host.py compares host time with it).
``ops_step``: count the ATen operators of that step (``lab.testing.op_counts.OpCounts``); the dispatch
mode slows the step, so a caller excludes it from its timings.
"""
from __future__ import annotations

import contextlib
import time

from lab.measure import PhaseTimer, current_rss_gib, maybe_profile, median, peak_rss_gib
from .workloads import ADAMW, CLIP, Shape


def train_hf(shape_fields: dict, steps: int, warmup: int, seed: int, profile_step: int | None = None,
             fused: bool = False, ops_step: int | None = None) -> dict:
    import torch
    import torch.nn.functional as F
    from transformers import GPT2LMHeadModel

    from lab.testing.op_counts import OpCounts
    from .data import micro_batch_stream

    shape = Shape(**shape_fields)
    stream = micro_batch_stream(shape.seq, shape.micro_batch, shape.micro_batch, seed)
    rss_before_model = current_rss_gib()
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(shape.hf_config())
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    # fused=None is torch's own default (on CPU: the per-tensor loop), what other callers keep
    optimizer = torch.optim.AdamW(params, lr=ADAMW["lr"], betas=tuple(ADAMW["betas"]), eps=ADAMW["eps"],
                                  weight_decay=ADAMW["weight_decay"], fused=True if fused else None)
    timer = PhaseTimer()
    step_times, losses, profile, ops = [], [], {}, None
    for step in range(1, steps + 1):
        timer.enabled = step > warmup
        counter = OpCounts() if step == ops_step else contextlib.nullcontext()
        start = time.perf_counter()
        with maybe_profile(step == profile_step, profile), counter:
            with timer.phase("data"):
                input_ids, labels = next(stream)
            with timer.phase("forward"):
                logits = model(input_ids=input_ids).logits
                loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
            with timer.phase("backward"):
                loss.backward()
            with timer.phase("optimizer"):
                torch.nn.utils.clip_grad_norm_(params, CLIP)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        step_times.append(time.perf_counter() - start)
        if step == ops_step:
            ops = dict(counter.counts)
    measured = step_times[warmup:]
    return {
        "side": "hf", "losses": losses, "step_times_s": step_times, "median_step_s": median(measured),
        "tokens_per_s": shape.tokens_per_micro_batch / median(measured),
        "phases_s": timer.per_step(len(measured)), "parameters": sum(p.numel() for p in params),
        "rss_before_model_gib": rss_before_model, "peak_rss_gib": peak_rss_gib(), "profile_ops": profile.get("ops"),
        "op_counts": ops,
    }
