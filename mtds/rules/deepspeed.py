"""What the DeepSpeed config may combine with the layout: the ZeRO stage, the precision and the batch
arithmetic B = b x m x d (global batch, micro batch, accumulation, data-parallel size)."""
from __future__ import annotations

from mtds.rules.job import Job


def zero_stage_known(job: Job) -> str | None:
    if job.zero_stage not in (0, 1, 2, 3):
        return f"zero_optimization.stage must be 0-3, got {job.zero_stage}: set 0, 1, 2 or 3 in the DeepSpeed config"
    return None


FP32_NAMES = ("fp32", "float32", "float", "torch.float32")    # data_types.grad_accum_dtype's spellings of fp32


def zero_with_pipeline(job: Job) -> str | None:
    """DeepSpeed's pipeline engine asserts ZeRO 0-1; mtds partitions ZeRO-2's gradients itself at p > 1
    (mtds.deepspeed_compat.zero2_reduce; bf16 with fp32 accumulation: bf16_zero2) on every schedule, dense
    models, and ZeRO-3's parameters (fp32 and bf16)
    (mtds.deepspeed_compat.zero3_params; the schedules its rule below allows)."""
    stage, pp = job.zero_stage, job.pp
    if pp <= 1 or stage <= 1:
        return None
    z = f"ZeRO-{stage}"
    if job.precision == "fp16":
        return f"{z} with --pp {pp} is built for fp32 and bf16 (fp16's loss scaling is not): use ZeRO-1 with --pp {pp} " \
               f"for fp16, or bf16"
    if job.precision == "bf16" and job.grad_accum_dtype not in FP32_NAMES:
        return f"{z} with --pp {pp} in bf16 accumulates its gradients in fp32 (DeepSpeed's BF16_Optimizer): set " \
               f"data_types.grad_accum_dtype to \"fp32\" in the DeepSpeed config"
    if job.bf16_immediate_grad_update:
        return f"{z} with --pp {pp} folds each micro-batch's bf16 gradients itself: set bf16.immediate_grad_update to " \
               f"false"
    if job.model.num_experts:
        return f"{z} with --pp {pp} and a mixture-of-experts model is not built: use ZeRO-1 with --pp {pp}"
    if job.zero_overlap_comm:
        return f"{z} with --pp {pp} reduces its own gradients: set zero_optimization.overlap_comm to false"
    if job.zero_offload:
        return f"{z} with --pp {pp} keeps its partitions on the device (offloading is not built there): remove " \
               f"zero_optimization.offload_optimizer / offload_param, or use --pp 1"
    return None


def one_precision(job: Job) -> str | None:
    if job.both_precisions:
        return "the DeepSpeed config enables both fp16 and bf16: keep one"
    return None


def batch_problem(global_batch: int | None, micro_batch: int, accumulation: int | None, dp: int) -> str | None:
    """B divisible by b·d, and m (where the config states it) the B / (b·d) it must be. ``global_batch`` None: the
    config gives b (and m) only, B follows."""
    B, b, m = global_batch, micro_batch, accumulation
    if B is None:
        return None
    if B % (b * dp):
        return f"train_batch_size {B} is not divisible by micro batch {b} x data parallel size {dp}: use a " \
               f"multiple of {b * dp}"
    derived = B // (b * dp)
    if m is not None and m != derived:
        return f"train_batch_size {B} != micro batch {b} x gradient_accumulation_steps {m} x data parallel size " \
               f"{dp}: drop gradient_accumulation_steps and it is derived ({derived})"
    return None


def batch_splits(job: Job) -> str | None:
    if job.micro_batch is None or job.dp is None:
        return None
    return batch_problem(job.global_batch, job.micro_batch, job.accumulation, job.dp)
