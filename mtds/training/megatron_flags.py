"""Megatron-LM's training flags that train.py does not take, each with what does the same in mtds.

Megatron's flags that mean what an mtds flag means are aliases of it (mtds.training.config: --train-iters,
--lr-warmup-iters, --lr-decay-style, --tensorboard-dir, --tensor-model-parallel-size, ...) and those for
settings the DeepSpeed JSON owns override it (--bf16, --fp16, --clip-grad, --weight-decay). The rest land here,
so a Megatron user's command line fails with the way forward instead of "unrecognized arguments".
"""
from __future__ import annotations

_MODEL = "mtds takes the architecture from --model (a preset such as gpt2-medium, or a HF config.json)"
_JSON = "set it in the DeepSpeed JSON's optimizer.params (see ds_configs/)"

EQUIVALENTS = {
    **{flag: _MODEL for flag in (
        "--num-layers", "--hidden-size", "--num-attention-heads", "--ffn-hidden-size", "--max-position-embeddings",
        "--kv-channels", "--num-query-groups", "--group-query-attention", "--swiglu", "--normalization",
        "--position-embedding-type", "--untie-embeddings-and-output-weights", "--init-method-std",
        "--rotary-base", "--vocab-size", "--make-vocab-size-divisible-by", "--disable-bias-linear",
        "--add-qkv-bias", "--norm-epsilon", "--layernorm-epsilon", "--apply-layernorm-1p")},
    "--lr-decay-iters": "mtds decays the learning rate over the whole run: --steps (alias --train-iters)",
    "--lr-warmup-fraction": "give the warm-up in steps: --warmup-steps (alias --lr-warmup-iters)",
    "--train-samples": "give the run in steps: --steps N, with --global-batch-size B sequences each",
    "--adam-beta1": _JSON, "--adam-beta2": _JSON, "--adam-eps": _JSON, "--optimizer": _JSON,
    "--loss-scale": "set fp16.loss_scale in the DeepSpeed JSON (0 = dynamic)",
    "--initial-loss-scale": "set fp16.initial_scale_power in the DeepSpeed JSON",
    "--log-interval": "mtds logs every step (console line, --log-jsonl, --tensorboard)",
    "--split": "hold out a fraction with --eval-split F, or give --eval-data-path",
    "--distributed-backend": "mtds picks NCCL on GPUs and gloo on CPUs by itself",
    "--use-distributed-optimizer": "that is ZeRO-1: zero_optimization.stage 1 in the DeepSpeed JSON (the shipped ptdp_*.json)",
    "--recompute-activations": "--recompute selective",
    "--use-flash-attn": "mtds calls torch's scaled_dot_product_attention, which picks flash attention itself",
    "--num-layers-per-virtual-pipeline-stage": "--pipeline-schedule interleaved --virtual-stages V",
    # mixture of experts (docs/moe.md): the model's MoE settings come from its HF config (Mixtral, Qwen3-MoE)
    **{flag: _MODEL + "; an MoE model's experts, top-k and expert width come from its HF config (docs/moe.md)"
       for flag in ("--num-experts", "--moe-router-topk", "--moe-ffn-hidden-size")},
    "--expert-tensor-parallel-size": "an MoE model's experts are split over --tp (expert TP = TP, docs/moe.md)",
    "--moe-pad-expert-input-to-capacity": "not built: with --moe-expert-capacity-factor each expert computes only "
                                          "the rows it kept, unpadded (docs/moe.md)",
    "--moe-grouped-gemm": "mtds runs the local experts as a grouped GEMM by itself where torch has one for the device "
                          "(docs/moe.md)",
    **{flag: _MODEL + "; an MoE model's shared expert (width, gate) comes from its HF config: Qwen2-MoE's "
                      "shared_expert_intermediate_size with its sigmoid shared_expert_gate (docs/moe.md)"
       for flag in ("--moe-shared-expert-intermediate-size", "--moe-shared-expert-gate")},
    **{flag: _MODEL + "; multi-head latent attention and its sizes come from a DeepSeek-V3 HF config (q_lora_rank, "
                      "kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, rope_interleave; docs/moe.md)"
       for flag in ("--multi-latent-attention", "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim",
                    "--qk-pos-emb-head-dim", "--v-head-dim", "--rotary-scaling-factor", "--mscale",
                    "--mscale-all-dim")},
    **{flag: _MODEL + "; DeepSeek-V3's routing comes from its HF config (sigmoid scores, n_group, topk_group, "
                      "routed_scaling_factor, e_score_correction_bias; docs/moe.md)"
       for flag in ("--moe-router-score-function", "--moe-router-num-groups", "--moe-router-group-topk",
                    "--moe-router-topk-scaling-factor")},
    **{flag: _MODEL + "; GPT-OSS's attention sinks, alternating windows and clamped quick-GeGLU experts come from "
                      "its HF config (sinks, layer_types, sliding_window, swiglu_limit; docs/moe.md)"
       for flag in ("--softmax-type", "--window-size", "--window-attn-skip-freq", "--glu-linear-offset",
                    "--activation-func-clamp-value", "--quick-geglu")},
    "--moe-layer-freq": _MODEL + "; which blocks hold experts comes from its HF config (decoder_sparse_step, "
                                 "mlp_only_layers; DeepSeek-V3's first_k_dense_replace; docs/moe.md)",
    "--ckpt-format": "mtds writes DeepSpeed's checkpoint format (mtds-convert turns it into HF's)",
}


def hint(message: str) -> str | None:
    """The way forward for argparse's "unrecognized arguments: ..." when it names a Megatron flag, else None."""
    if not message.startswith("unrecognized arguments:"):
        return None
    for token in message.split(":", 1)[1].split():
        flag = token.split("=", 1)[0]
        if flag in EQUIVALENTS:
            return f"{flag} is Megatron-LM's and not a train.py flag: {EQUIVALENTS[flag]}"
    return None
