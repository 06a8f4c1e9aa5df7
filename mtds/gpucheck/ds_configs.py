"""DeepSpeed configs of the checks: the settings of the shipped ``ds_configs/ptdp_*.json`` (ZeRO-1, torch's
AdamW -- fused on CUDA --, bf16 with fp32 gradient accumulation, fp16 with a dynamic loss scale), with the
check's batch, learning rate and clipping so that the HuggingFace reference can follow the same recipe."""
from __future__ import annotations

LR = 2e-3               # large enough that 10 steps move a small model visibly
CLIP = 0.5              # low enough that most steps clip: the global norm over all ranks matters
BETAS = (0.9, 0.95)
EPS = 1e-8
WEIGHT_DECAY = 0.1
WARMUP = 2
MIN_LR = LR / 10


def ds_config(precision: str, device: str, micro_batch: int, global_batch: int, *, clip: float = CLIP) -> dict:
    params = {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WEIGHT_DECAY, "torch_adam": True}
    if device == "cuda":
        params["fused"] = True
    config = {
        "train_batch_size": global_batch,
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": params},
        "zero_optimization": {"stage": 1},
        "steps_per_print": 10 ** 9,
    }
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    elif precision == "fp16":
        # 2^8, not the shipped 2^16: a first step skipped for overflow would leave the reference behind
        # (a skipped step is reported as a failure, so the start must not overflow on a healthy run).
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "loss_scale_window": 1000,
                          "hysteresis": 2, "min_loss_scale": 1}
    elif precision != "fp32":
        raise ValueError(f"precision must be fp32, bf16 or fp16, got {precision!r}")
    return config


def train_config(workload, precision: str, device: str, **kwargs):
    """A :class:`mtds.training.TrainConfig` for ``workload`` (cosine decay with warm-up, no held-out set)."""
    from mtds.training import TrainConfig
    ds = kwargs.pop("deepspeed_config", None) or ds_config(precision, device, workload.micro_batch,
                                                            workload.global_batch * kwargs.pop("dp", 1))
    base = dict(deepspeed_config=ds, model=workload.model, steps=workload.steps, seq_length=workload.seq,
                eval_split=0.0, seed=SEED, warmup_steps=WARMUP, lr_decay="cosine", min_lr=MIN_LR, progress=False)
    base.update(kwargs)
    return TrainConfig(**base)


SEED = 1234
