"""The description of a job the rules judge: plain values, no torch, the same whoever asks (train.py's start-up,
mtds-eval, the planner's candidates). The trainer builds it from its flags, the DeepSpeed config and the model
(mtds.training.admit); the planner from a candidate layout (mtds.plan.runnable)."""
from __future__ import annotations

from dataclasses import dataclass

TRAIN, EVAL = "train", "eval"


@dataclass(frozen=True)
class ModelFacts:
    """What the rules need to know of the model: sizes they divide and features they refuse together."""

    num_layers: int
    hidden_size: int
    num_heads: int
    kv_heads: int
    ffn_size: int
    num_experts: int = 0
    moe_ffn_size: int = 0
    moe_blocks: tuple[int, ...] = ()        # 0-based indices of the blocks holding experts
    shared_expert_ffn_size: int = 0         # the MoE blocks' shared expert's width (0: none)
    expert_bias: bool = False               # the router has an expert bias (DeepSeek-V3)
    latent_attention: bool = False          # multi-head latent attention (DeepSeek-V3)
    attention_sinks: bool = False           # a learned logit per head in every softmax's sum (GPT-OSS)
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    sliding_window: int | None = None


@dataclass(frozen=True)
class Job:
    """One job: the layout over ``world_size`` ranks (d derived: world / (t c p)), the schedule and features, the
    DeepSpeed config's ZeRO stage, precision and batch, and the model. ``None`` where a value is not known to
    the asker (a rule that needs it is then not asked)."""

    model: ModelFacts
    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    virtual_stages: int = 1                 # --virtual-stages (dualpipev's two chunks are its own)
    pipeline_schedule: str = "1f1b"
    sequence_parallel: bool = False
    cp_comm_type: str = "p2p"
    seq_length: int = 128
    zero_stage: int = 0
    precision: str = "fp32"                 # fp32 | bf16 | fp16
    both_precisions: bool = False           # the DeepSpeed config enables fp16 and bf16
    grad_accum_dtype: str | None = None     # data_types.grad_accum_dtype as written (None: the model's dtype)
    global_batch: int | None = None         # B, sequences per step over the d data-parallel ranks
    micro_batch: int | None = None          # b
    accumulation: int | None = None         # m as the DeepSpeed config states it (None: derived)
    pipeline_layout: str | None = None      # --pipeline-layout as written
    stage_blocks: tuple[int, ...] | None = None   # blocks per virtual stage of the run's partition (p > 1)
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    compile: bool = False
    bf16_immediate_grad_update: bool = False
    zero_overlap_comm: bool = False
    zero_offload: bool = False              # zero_optimization.offload_optimizer / offload_param to cpu or nvme
    deepspeed_version: str | None = None
    moe_z_loss: bool = False                # --moe-z-loss-coeff > 0
    moe_bias_update: bool = False           # --moe-router-enable-expert-bias
    moe_capacity: bool = False              # --moe-expert-capacity-factor given
    moe_seq_aux: bool = False               # --moe-router-load-balancing-type seq_aux_loss
    moe_aux_coeff: bool = False             # --moe-aux-loss-coeff > 0
    moe_overlap_comm: bool = False          # --overlap-moe-expert-parallel-comm
    recompute: bool = False                 # --recompute selective or full
    save: bool = False                      # --save given
    async_save: bool = False                # --async-save
    purpose: str = TRAIN                    # train | eval (mtds-eval: no router statistics carried)

    @property
    def dp(self) -> int | None:
        """d, or None where the world does not split into t·c·p groups (a rule says so)."""
        group = self.tp * self.cp * self.pp
        return self.world_size // group if group > 0 and self.world_size % group == 0 else None

    @property
    def chunks(self) -> int:
        """Model chunks per pipeline rank: v, two under dualpipev."""
        return 2 if self.pipeline_schedule == "dualpipev" else self.virtual_stages

    @property
    def micro_batches(self) -> int | None:
        """m = B / (b d) where the batch arithmetic holds (the config's m, else 1, where it states no B), else
        None."""
        d, B, b = self.dp, self.global_batch, self.micro_batch
        if d is None or b is None:
            return None
        if B is None:
            return self.accumulation or 1
        return None if B % (b * d) else B // (b * d)

    @property
    def documents(self) -> bool:
        """Packed-document resets: their ids travel beside the activations."""
        return self.reset_position_ids or self.reset_attention_mask
