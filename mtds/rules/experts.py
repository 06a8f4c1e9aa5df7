"""Mixture-of-experts models: what expert parallelism, ZeRO, pipelines and the router flags may combine
(docs/moe.md). Each refusal is something not built yet, or not correct on DeepSpeed's side: never a silently
different model or a wrong gradient."""
from __future__ import annotations

from mtds.rules.job import Job


def router_flags(job: Job) -> str | None:
    """Megatron-core's router options apply to models with experts; the bias update to a router with a bias."""
    if job.moe_bias_update and not job.model.expert_bias:
        return "--moe-router-enable-expert-bias needs a router with an expert bias (DeepSeek-V3's " \
               "e_score_correction_bias with sigmoid scores); this model's has none"
    if job.model.num_experts or not (job.moe_z_loss or job.moe_capacity):
        return None
    flag = "--moe-z-loss-coeff" if job.moe_z_loss else "--moe-expert-capacity-factor"
    return f"{flag} needs a mixture-of-experts model (Mixtral, Qwen3-MoE); this one has no experts"


def seq_aux_loss(job: Job) -> str | None:
    """Megatron-core's per-sequence balancing loss keeps [b, E] sums per block: on a pipeline they would have to
    travel beside the activation with the pooled counts, under context parallelism be summed over the chunks;
    neither is built."""
    if not job.moe_seq_aux:
        return None if not job.moe_aux_coeff else "--moe-aux-loss-coeff weighs --moe-router-load-balancing-type " \
            "seq_aux_loss only; the default aux_loss is weighted by the HF config's router_aux_loss_coef"
    if not job.model.num_experts:
        return "--moe-router-load-balancing-type seq_aux_loss needs a mixture-of-experts model; this one has no experts"
    if job.pp > 1:
        return f"--moe-router-load-balancing-type seq_aux_loss with --pp {job.pp} is not built yet (its per-sequence " \
               f"statistics do not travel between stages): use --pp 1 or the default aux_loss"
    if job.cp > 1:
        return f"--moe-router-load-balancing-type seq_aux_loss with --cp {job.cp} is not built yet (its per-sequence " \
               f"statistics are not summed over the context-parallel chunks): use --cp 1 or the default aux_loss"
    return None


def experts_split(job: Job) -> str | None:
    """e splits the experts of an MoE model."""
    e, experts = job.ep, job.model.num_experts
    if e == 1:
        return None
    if not experts:
        return f"--expert-model-parallel-size {e} needs a mixture-of-experts model (Mixtral, Qwen3-MoE); this one " \
               f"has no experts: leave it at 1"
    if experts % e:
        of_d = f" and the data-parallel size {job.dp}" if job.dp else ""
        return f"--expert-model-parallel-size {e} does not divide the model's {experts} experts: choose it from " \
               f"the common divisors of {experts}{of_d}"
    return None


def expert_parallel_zero(job: Job) -> str | None:
    """What expert parallelism does not do with ZeRO yet, or not correctly on DeepSpeed's side."""
    if job.ep == 1:
        return None
    e = f"--expert-model-parallel-size {job.ep}"
    if job.zero_stage == 3:
        return f"{e} with ZeRO-3 is not built: ZeRO-3 would partition each rank's own experts as if every data " \
               f"rank held them; use ZeRO-0, 1 or 2"
    if job.precision != "fp32" and job.zero_stage == 0:
        # deepspeed/runtime/fp16/unfused_optimizer.py step(): the expert half of
        # split_params_grads_into_shared_and_expert_params is dropped from the norm that clipping uses
        return f"{e} with {job.precision} needs ZeRO-1 or 2: at ZeRO-0 DeepSpeed's unfused {job.precision} " \
               f"optimizer leaves the expert gradients out of the global norm it clips by"
    return None


def overlap_comm(job: Job) -> str | None:
    """--overlap-moe-expert-parallel-comm hides the dispatch all-to-all behind the block's shared expert
    (mtds.model.moe) and, on DualPipeV, one chunk's all-to-alls behind the other chunk's compute
    (mtds.pipe.dualpipev_overlap). Without an all-to-all, or off DualPipeV without a shared expert, it would
    do nothing; with sequence parallelism it is not built."""
    if not job.moe_overlap_comm:
        return None
    flag = "--overlap-moe-expert-parallel-comm"
    dualpipev = job.pipeline_schedule == "dualpipev"
    if job.ep == 1 or not (job.model.shared_expert_ffn_size or dualpipev):
        return f"{flag} overlaps an MoE block's dispatch all-to-all with its shared expert, or on " \
               f"--pipeline-schedule dualpipev one chunk's all-to-alls with the other chunk's compute: it needs " \
               f"--expert-model-parallel-size > 1 and a model with a shared expert (Qwen2-MoE, DeepSeek-V3) or " \
               f"dualpipev; drop the flag"
    if job.sequence_parallel:
        return f"{flag} with --sequence-parallel is not built: drop one of them"
    return None


def dualpipev_overlap(job: Job) -> str | None:
    """DualPipeV's cross-chunk overlap (mtds.deepspeed_compat.dualpipev_overlap) runs a forward and a backward of the two
    phases at once on two threads, keeping every collective of a pass on a group of its own side: only the
    expert groups are duplicated, so what puts another collective (or the shared RNG state) inside a pass is
    not built."""
    if not (job.moe_overlap_comm and job.pipeline_schedule == "dualpipev" and job.ep > 1):
        return None
    flag = "--overlap-moe-expert-parallel-comm"
    on = f"{flag} on dualpipev (one chunk's forward beside the other's backward, on two threads)"
    if job.tp > 1 or job.cp > 1:
        return f"{on} with --tp {job.tp} --context-parallel-size {job.cp} is not built: only the expert groups " \
               f"are duplicated for the two threads; use --tp 1 and --context-parallel-size 1, or drop the flag"
    if job.recompute or job.model.attention_dropout or job.model.hidden_dropout:
        return f"{on} with recompute or dropout is not built: the recomputed forward's collectives and the " \
               f"dropout RNG state would be shared by the two threads; use --recompute none and a model without " \
               f"dropout, or drop the flag"
    if job.zero_stage >= 2 or job.precision != "fp32":
        return f"{on} is built for fp32 with ZeRO-0/1 (ZeRO-{job.zero_stage}, {job.precision} here): ZeRO-2/3 " \
               f"reduce inside the backward, and 16 bits is not verified; use fp32 ZeRO-1, or drop the flag"
    return None


def expert_width(job: Job) -> str | None:
    if job.model.num_experts and job.model.moe_ffn_size % job.tp:
        return f"tensor parallel size {job.tp} does not divide the expert FFN size {job.model.moe_ffn_size}"
    if job.model.shared_expert_ffn_size % job.tp:
        return f"tensor parallel size {job.tp} does not divide the shared expert FFN size " \
               f"{job.model.shared_expert_ffn_size}"
    return None
