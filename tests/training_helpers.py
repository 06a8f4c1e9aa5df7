"""Shared pieces of the training tests: a tiny model, DeepSpeed configs, runs on spawned ranks, and
the single-process HuggingFace reference (GPT2LMHeadModel + torch.optim.AdamW on the same batches)."""
from __future__ import annotations

import torch

from mtds.config import ModelConfig
from mtds.testing import spawn

TINY = ModelConfig(vocab_size=8192, hidden_size=64, num_layers=4, num_heads=4, max_position_embeddings=64)
SEQ = 32
STEPS = 10
LR = 2e-3
CLIP = 0.5    # low enough that most steps are clipped: tests the global norm across layouts
SEED = 1234
BATCH = dict(train_batch_size=8, train_micro_batch_size_per_gpu=2)


def ds_config(zero: int = 1, precision: str = "fp32", clip: float = CLIP, **extra) -> dict:
    config = {
        **BATCH,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.1, "torch_adam": True}},
        "zero_optimization": {"stage": zero},
    }
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
    return TrainConfig(**base)


def _run_all(configs, force_fp16: bool):
    if force_fp16:
        # This CPU lacks fp16 kernels DeepSpeed checks for; the test process pretends it has them.
        from deepspeed.accelerator import get_accelerator
        get_accelerator().is_fp16_supported = lambda: True
    from mtds.training import run
    return [run(cfg) for cfg in configs]


def run_layouts(world: int, configs: list, *, force_fp16: bool = False, timeout: float = 600):
    """Run several TrainConfigs one after another on the same ``world`` ranks; per-rank RunResults."""
    return spawn(_run_all, world, configs, force_fp16, timeout=timeout)


def hf_reference_losses(cfg=TINY, steps: int = STEPS, clip: float = CLIP) -> list[float]:
    """HF GPT2LMHeadModel with mtds's initial weights, trained by :func:`train_hf`."""
    from transformers import GPT2LMHeadModel

    from mtds.hf import hf_config_from_model_config, model_to_hf_state
    from mtds.model import GPTModel

    ours = GPTModel(cfg, seed=SEED)
    hf = GPT2LMHeadModel(hf_config_from_model_config(cfg))
    hf.load_state_dict(model_to_hf_state(ours), strict=False)
    return train_hf(hf, steps, clip)


def train_hf(hf, steps: int = STEPS, clip: float = CLIP) -> list[float]:
    """The reference loop: torch AdamW, mtds's batches (same seed and order) and LR schedule, clipping."""
    from mtds.data import MicroBatchStream, build_packed_dataset, load_tokenizer
    from mtds.training.schedule import lr_factor

    hf.train()
    opt = torch.optim.AdamW(hf.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, base_lr=LR, min_lr=LR / 10, warmup=2,
                                                                        total=steps, decay="cosine"))
    dataset = build_packed_dataset(None, load_tokenizer(None), SEQ, show_progress=False)
    B, b = BATCH["train_batch_size"], BATCH["train_micro_batch_size_per_gpu"]
    stream = MicroBatchStream(dataset, global_batch_size=B, micro_batch_size=b, seed=SEED)
    losses = []
    for _ in range(steps):
        total = 0.0
        for _ in range(B // b):
            input_ids, labels = next(stream)
            logits = hf(input_ids=input_ids).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
            (loss / (B // b)).backward()
            total += loss.item() / (B // b)
        if clip:
            torch.nn.utils.clip_grad_norm_(hf.parameters(), clip)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def max_rel_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (len(a), len(b))
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))
