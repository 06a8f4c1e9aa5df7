"""The single-process HuggingFace reference every mtds layout is measured against: an HF model holding
mtds's initial weights, trained by a plain loop -- a torch optimizer, mtds's batches (same seed and
order), the warm-up + cosine LR schedule written out here independently of mtds.training.schedule,
clipping -- recording each step's mean loss and pre-clip global gradient norm. Used by the test suite
(tests/training_helpers.py) and by ``python -m mtds.gpucheck``, so both hold mtds to the same loop."""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable, Iterator

import torch


@dataclass(frozen=True)
class Reference:
    """Per-step losses and pre-clip global gradient norms of the single-process reference."""
    losses: list[float]
    grad_norms: list[float]


def lr_factor(step: int, warmup: int, total: int, floor: float) -> float:
    """Linear warm-up over ``warmup`` steps, then cosine from 1 down to ``floor`` at step ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    if total <= warmup:
        return 1.0
    t = min(1.0, (step - warmup) / (total - warmup))
    return floor + (1 - floor) * (1 + math.cos(math.pi * t)) / 2


def hf_with_mtds_weights(cfg, seed: int):
    """The transformers model of ``cfg.architecture`` (GPT2LMHeadModel, LlamaForCausalLM, Qwen2/Qwen3/
    MistralForCausalLM, ...) built from ``cfg``'s exported config, holding the weights ``GPTModel(cfg,
    seed=seed)`` starts from (CPU). Every weight is mtds's: only a tied head (transformers ties it to
    the embedding) and non-weight buffers are not loaded."""
    from transformers import AutoModelForCausalLM

    from mtds.hf import hf_config_from_model_config, model_to_hf_state
    from mtds.model import GPTModel
    if cfg.moe_z_loss_coeff or cfg.moe_expert_capacity_factor is not None or \
            cfg.moe_router_load_balancing_type != "aux_loss":
        # Megatron-core's router options (docs/moe.md) are not in transformers' model: no reference to compare
        raise ValueError("the HF reference is transformers' dropless MoE without a router z-loss and with its own "
                         "aux loss: compare runs with --moe-z-loss-coeff / --moe-expert-capacity-factor / "
                         "--moe-router-load-balancing-type seq_aux_loss against mtds layouts, not against it")
    state = model_to_hf_state(GPTModel(cfg, seed=seed))
    if cfg.num_experts:
        return _moe_from_disk(cfg, state)
    hf = AutoModelForCausalLM.from_config(hf_config_from_model_config(cfg))
    unexpected = hf.load_state_dict(state, strict=False).unexpected_keys
    # a tied head is the embedding's parameter, listed once by named_parameters
    missing = sorted(set(dict(hf.named_parameters())) - set(state))
    if missing or unexpected:
        raise ValueError(f"{type(hf).__name__} and mtds's export differ: not exported {missing[:3]}, "
                         f"not in the HF model {unexpected[:3]}")
    return hf


def _moe_from_disk(cfg, state):
    """An MoE model through transformers' own loader: mtds exports the per-expert keys transformers writes
    (and the Hub holds), which its in-memory model fuses into [E, ...] tensors on load."""
    import tempfile

    from transformers import AutoModelForCausalLM

    from mtds.hf import save_hf_checkpoint
    with tempfile.TemporaryDirectory() as tmp:
        save_hf_checkpoint(cfg, state, tmp)
        hf, info = AutoModelForCausalLM.from_pretrained(tmp, output_loading_info=True, dtype=torch.float32)
    bad = {k: v for k, v in info.items() if v}     # missing, unexpected, mismatched keys, errors
    if bad:
        raise ValueError(f"{type(hf).__name__} did not load mtds's export whole: {bad}")
    return hf


def mtds_batches(seq: int, global_batch: int, micro_batch: int, seed: int) -> Iterator:
    """mtds's training micro-batches of the shipped corpus, in mtds's order (d = 1)."""
    from mtds.data import MicroBatchStream, build_packed_dataset, load_tokenizer
    dataset = build_packed_dataset(None, load_tokenizer(None), seq, show_progress=False)
    return iter(MicroBatchStream(dataset, global_batch_size=global_batch, micro_batch_size=micro_batch, seed=seed))


def train_reference(hf, batches: Iterator, *, steps: int, micro_batches: int, optimizer, lr_lambda: Callable,
                    clip: float, device="cpu", autocast: torch.dtype | None = None, scaler=None) -> Reference:
    """``steps`` optimizer steps of ``micro_batches`` micro-batches each; the mean loss and the norm are
    summed in float64 (fp32's own sum of a 0.5M-element embedding gradient is off by ~1e-5 relative,
    more than the tolerance the layouts are held to), parameter by parameter in order.
    ``autocast``: the forward under ``torch.autocast`` in that dtype (weights, loss and optimizer stay fp32,
    as HF users train in 16 bits); ``scaler``: a ``torch.amp.GradScaler`` (fp16), unscaled before the norm."""
    hf.train()
    # an MoE model's training loss holds its load-balancing term (transformers adds it when asked for the
    # router logits, as its Trainer users do)
    moe = {"output_router_logits": True} if hasattr(hf.config, "router_aux_loss_coef") else {}
    sched = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
    losses, norms = [], []
    for _ in range(steps):
        total = torch.zeros((), dtype=torch.float64, device=device)
        for _ in range(micro_batches):
            input_ids, labels = (t.to(device) for t in next(batches))
            with (torch.autocast(torch.device(device).type, dtype=autocast) if autocast is not None
                  else contextlib.nullcontext()):
                out = hf(input_ids=input_ids, **moe)
            logits = out.logits
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                     labels.reshape(-1))
            if moe:   # MixtralForCausalLM's own line: loss += router_aux_loss_coef * aux_loss
                loss = loss + hf.config.router_aux_loss_coef * out.aux_loss
            part = loss / micro_batches
            (scaler.scale(part) if scaler is not None else part).backward()
            total += loss.detach().double() / micro_batches
        if scaler is not None:
            scaler.unscale_(optimizer)
        norms.append(math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in hf.parameters()
                                   if p.grad is not None)))
        if clip:
            torch.nn.utils.clip_grad_norm_(hf.parameters(), clip)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        sched.step()
        optimizer.zero_grad()
        losses.append(float(total))
    return Reference(losses, norms)


__all__ = ["Reference", "lr_factor", "hf_with_mtds_weights", "mtds_batches", "train_reference"]
