"""Model hyper-parameters: one frozen dataclass shared by the model, the pipeline builder, checkpoints and
the HF adapters, and the presets.

A ModelConfig describes the *logical* model only (no parallel layout): every quantity here is the
same whatever t, p or d is, which is what makes weights and checkpoints layout independent.

It imports only ``mtds.parallel.vocab``, the rulebook's ``ModelFacts`` and no torch, so every layer (the planner too) may import it.
Which config a name or a HF file means is :func:`mtds.hf.resolve.resolve_model_config`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from mtds.parallel.vocab import padded_vocab_size
from mtds.rules.job import ModelFacts

POSITION_EMBEDDINGS = ("learned", "rotary")
NORMALIZATIONS = ("layernorm", "rmsnorm")
# quick_geglu: GLU with quick_gelu, gate·sigmoid(1.702·gate) (GPT-OSS's experts; Megatron-core's name)
ACTIVATIONS = ("gelu_tanh", "gelu", "swiglu", "quick_geglu")
GLU_ACTIVATIONS = ("swiglu", "quick_geglu")
SOFTMAX_TYPES = ("vanilla", "learnable")
ARCHITECTURES = ("gpt2", "gpt_neox", "llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen3_moe",
                 "qwen2_moe", "deepseek_v3", "gpt_oss")
# RoPE frequency schemes for training (transformers' names); "dynamic" rescales per sequence at inference: not here.
ROPE_SCALINGS = ("linear", "llama3", "yarn")
# The parameters each scheme needs (transformers' keys); the rest of rope_scaling_params are optional.
ROPE_SCALING_REQUIRED = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("original_max_position_embeddings",)}


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int | None = None          # None -> num_heads (multi-head); fewer = grouped-query attention
    kv_channels: int | None = None           # per-head dim; None -> hidden_size / num_heads (Qwen3: explicit)
    ffn_hidden_size: int | None = None       # None -> 4 * hidden_size (resolved in __post_init__)
    max_position_embeddings: int = 1024
    position_embedding: str = "learned"      # "learned" (GPT-2) | "rotary" (NeoX, Llama)
    rotary_percent: float = 1.0              # fraction of each head's dims that are rotated (NeoX: 0.25)
    rotary_base: float = 10000.0
    rope_scaling: str | None = None          # None (plain RoPE) | "linear" | "llama3" | "yarn"
    rope_scaling_params: Any = ()            # that scheme's parameters: sorted ((key, value), ...) pairs
    normalization: str = "layernorm"         # "layernorm" | "rmsnorm"
    norm_eps: float = 1e-5
    activation: str = "gelu_tanh"            # "gelu_tanh" (GPT-2 gelu_new) | "gelu" (exact) | "swiglu"
    qkv_bias: bool = True                    # bias of the fused QKV projection
    linear_bias: bool = True                 # bias of both MLP projections (and of the out-proj, see below)
    out_proj_bias: bool | None = None        # bias of the attention out-proj; None -> same as linear_bias
    qk_norm: bool = False                    # Qwen3: a norm over each head's q and k (head_dim weights) before RoPE
    sliding_window: int | None = None        # Mistral: a query sees only the last sliding_window keys; None -> all
    window_attn_skip_freq: int | None = None  # GPT-OSS: every N-th block (1-based) attends fully, the rest slide
    softmax_type: str = "vanilla"            # "learnable": a learned logit per head in every softmax's sum (sinks)
    parallel_residual: bool = False          # NeoX: x + attn(ln1(x)) + mlp(ln2(x))
    tie_word_embeddings: bool = True
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    init_std: float = 0.02
    make_vocab_size_divisible_by: int = 128
    architecture: str = "gpt2"               # which HF family this maps to (for import/export)
    # Mixture of experts (docs/moe.md; transformers' names). num_experts 0: every block has the dense MLP.
    num_experts: int = 0                     # routed experts per MoE block
    moe_top_k: int = 2                       # experts per token (num_experts_per_tok)
    moe_ffn_hidden_size: int | None = None   # each expert's SwiGLU width (moe_intermediate_size); None -> ffn
    norm_topk_prob: bool = True              # renormalise the k probabilities to sum 1 (Mixtral: always)
    router_aux_loss_coef: float = 0.0        # HF's load-balancing loss weight, added to the training loss
    decoder_sparse_step: int = 1             # block i (1-based) is MoE when i % step == 0 ...
    mlp_only_layers: tuple[int, ...] = ()    # ... and its 0-based index is not listed here (Qwen3-MoE)
    # A dense SwiGLU MLP beside the routed experts of every MoE block, always on (Megatron-core's names):
    moe_shared_expert_intermediate_size: int | None = None   # its width; None: no shared expert
    moe_shared_expert_gate: bool = False     # Qwen2-MoE: its output scaled by sigmoid(x · w), w [1, h]
    # DeepSeek-V3's router (Megatron-core's names; docs/moe.md): sigmoid scores, a bias for the choice only,
    # group-limited top-k, the weights scaled
    moe_router_score_function: str = "softmax"         # softmax | sigmoid
    moe_router_enable_expert_bias: bool = False        # e_score_correction_bias: an fp32 buffer [E]
    moe_router_num_groups: int | None = None           # n_group: experts in groups of E / n ...
    moe_router_group_topk: int | None = None           # ... of which topk_group take part (top-2 sums)
    moe_router_topk_scaling_factor: float | None = None   # routed_scaling_factor on the k weights
    # Multi-head latent attention (DeepSeek-V2/V3; Megatron-core's names, docs/moe.md). Off: the fields unused.
    multi_latent_attention: bool = False
    q_lora_rank: int | None = None           # None: one q projection; else down to this rank, a norm, up
    kv_lora_rank: int = 0                    # the compressed key/value latent
    qk_head_dim: int = 0                     # each head's query/key dims without RoPE (qk_nope_head_dim)
    qk_pos_emb_head_dim: int = 0             # ... with RoPE: the decoupled key shared by every head
    v_head_dim: int = 0                      # each head's value dims
    rotary_interleaved: bool = False         # RoPE over (x0, x1), (x2, x3), ... pairs (rope_interleave)
    # Megatron-core's router options (training flags, not HF's; docs/moe.md): off by default
    moe_router_bias_update_rate: float = 0.0   # aux-loss-free balancing: bias += rate·sign(mean − load)
    moe_z_loss_coeff: float = 0.0            # router z-loss weight (--moe-z-loss-coeff)
    moe_expert_capacity_factor: float | None = None   # None: dropless (--moe-expert-capacity-factor)
    moe_token_drop_policy: str = "probs"     # which assignments past the capacity drop: probs | position
    # aux_loss: transformers' load-balancing loss x router_aux_loss_coef; seq_aux_loss: Megatron-core's per-sequence
    # one x moe_aux_loss_coeff instead (--moe-router-load-balancing-type, --moe-aux-loss-coeff; mtds.model.aux_loss)
    moe_router_load_balancing_type: str = "aux_loss"
    moe_aux_loss_coeff: float = 0.0
    # GPT-OSS's experts (Megatron-core's names): (clamp(up) + offset) · act(clamp(gate)), the gate clamped above,
    # up on both sides; with linear_bias the experts and the router carry biases (Megatron's add_bias_linear)
    glu_linear_offset: float = 0.0
    activation_func_clamp_value: float | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "max_position_embeddings",
                     "make_vocab_size_divisible_by"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.kv_channels is not None and (not isinstance(self.kv_channels, int) or self.kv_channels <= 0):
            raise ValueError(f"ModelConfig.kv_channels must be a positive int or None, got {self.kv_channels!r}")
        if self.kv_channels is None and self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}: "
                             f"set kv_channels (the per-head dim)")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window <= 0):
            raise ValueError(f"ModelConfig.sliding_window must be a positive int or None, got {self.sliding_window!r}")
        if self.num_kv_heads is not None and (self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads):
            raise ValueError(f"num_kv_heads {self.num_kv_heads} must be positive and divide "
                             f"num_heads {self.num_heads}")
        if self.ffn_hidden_size is not None and self.ffn_hidden_size <= 0:
            raise ValueError(f"ffn_hidden_size must be positive, got {self.ffn_hidden_size}")
        # Resolve the None defaults so equal models compare equal whichever way they were spelled.
        object.__setattr__(self, "num_kv_heads", self.num_kv_heads or self.num_heads)
        object.__setattr__(self, "ffn_hidden_size", self.ffn_hidden_size or 4 * self.hidden_size)
        # The opposite for the two overrides: stored only where they differ from what they override, so
        # dataclasses.replace(cfg, hidden_size=..., linear_bias=...) still changes the tied value with it,
        # and an mtds_meta.json written before these fields existed reads as the same model.
        if self.kv_channels is not None and self.kv_channels * self.num_heads == self.hidden_size:
            object.__setattr__(self, "kv_channels", None)
        if self.out_proj_bias is not None and self.out_proj_bias == self.linear_bias:
            object.__setattr__(self, "out_proj_bias", None)
        object.__setattr__(self, "rope_scaling_params", _frozen_params(self.rope_scaling_params))
        _check_moe(self)
        _check_mla(self)
        _check_gpt_oss(self)
        if self.rope_scaling is not None:
            _check_choice("rope_scaling", self.rope_scaling, ROPE_SCALINGS)
            if self.position_embedding != "rotary":
                raise ValueError(f"rope_scaling {self.rope_scaling!r} needs position_embedding='rotary'")
            missing = [k for k in ROPE_SCALING_REQUIRED[self.rope_scaling] if k not in self.rope_params]
            if missing:
                raise ValueError(f"rope_scaling {self.rope_scaling!r} needs rope_scaling_params {missing}")
        elif self.rope_scaling_params:
            raise ValueError(f"rope_scaling_params {dict(self.rope_scaling_params)} given without a rope_scaling type")
        _check_choice("position_embedding", self.position_embedding, POSITION_EMBEDDINGS)
        _check_choice("normalization", self.normalization, NORMALIZATIONS)
        _check_choice("activation", self.activation, ACTIVATIONS)
        _check_choice("architecture", self.architecture, ARCHITECTURES)
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ValueError(f"rotary_percent must be in (0, 1], got {self.rotary_percent}")
        if self.position_embedding == "rotary" and (self.rotary_dim < 2 or self.rotary_dim % 2):
            raise ValueError(f"rotary dims per head = int(head_dim {self.head_dim} * rotary_percent "
                             f"{self.rotary_percent}) = {self.rotary_dim} must be even and >= 2")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.init_std <= 0 or self.norm_eps <= 0 or self.rotary_base <= 0:
            raise ValueError("init_std, norm_eps and rotary_base must be positive")

    # ---- derived sizes ------------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_heads

    @property
    def has_out_proj_bias(self) -> bool:
        return self.linear_bias if self.out_proj_bias is None else self.out_proj_bias

    @property
    def rope_params(self) -> dict[str, Any]:
        """rope_scaling_params as a dict (transformers' keys: factor, original_max_position_embeddings, ...)."""
        return dict(self.rope_scaling_params)

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    def is_moe_layer(self, layer_number: int) -> bool:
        """Block ``layer_number`` (global, 1..L) holds experts: transformers' Qwen3-MoE rule
        (Mixtral: step 1, no dense blocks)."""
        return (self.num_experts > 0 and layer_number % self.decoder_sparse_step == 0
                and layer_number - 1 not in self.mlp_only_layers)

    @property
    def moe_ffn_size(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_size

    def facts(self) -> ModelFacts:
        """What the rulebook (mtds.rules) weighs of this model."""
        return ModelFacts(num_layers=self.num_layers, hidden_size=self.hidden_size, num_heads=self.num_heads,
                          kv_heads=self.kv_heads, ffn_size=self.ffn_size, num_experts=self.num_experts,
                          moe_ffn_size=self.moe_ffn_size if self.num_experts else 0,
                          moe_blocks=tuple(i for i in range(self.num_layers) if self.is_moe_layer(i + 1)),
                          shared_expert_ffn_size=self.moe_shared_expert_intermediate_size or 0,
                          expert_bias=self.moe_router_enable_expert_bias,
                          latent_attention=self.multi_latent_attention, attention_sinks=self.attention_sinks,
                          attention_dropout=self.attention_dropout, hidden_dropout=self.hidden_dropout,
                          sliding_window=self.sliding_window)

    def attention_window(self, layer_number: int) -> int | None:
        """The sliding window of block ``layer_number`` (1..L), None where it attends fully."""
        if self.window_attn_skip_freq is not None and layer_number % self.window_attn_skip_freq == 0:
            return None
        return self.sliding_window

    @property
    def attention_sinks(self) -> bool:
        return self.softmax_type == "learnable"

    @property
    def rotary_dim(self) -> int:
        if self.multi_latent_attention:     # the decoupled RoPE dims of each head
            return self.qk_pos_emb_head_dim
        # int() truncation is what HF NeoX/Llama do, so partial-rotary models line up dim for dim.
        return int(self.head_dim * self.rotary_percent)

    @property
    def qkv_size(self) -> int:
        return (self.num_heads + 2 * self.kv_heads) * self.head_dim

    def padded_vocab_size(self, tp_size: int = 1) -> int:
        """Megatron's padding of the vocabulary at t = tp_size (:func:`padded_vocab_size`)."""
        return padded_vocab_size(self.vocab_size, tp_size, self.make_vocab_size_divisible_by)

    @property
    def num_global_layers(self) -> int:
        """Global layer indices: 0 embedding, 1..L blocks, L+1 final norm, L+2 LM head (untied only)."""
        return self.num_layers + 3

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _frozen_params(params: Any) -> tuple[tuple[str, Any], ...]:
    """A dict, pairs, or JSON's lists of pairs -> sorted ((key, value), ...): hashable, and equal however
    spelled (mtds_meta.json stores the tuple as lists). None values mean "absent", as in transformers."""
    items = params.items() if isinstance(params, dict) else params
    out = []
    for pair in items:
        key, value = pair
        if value is not None:
            out.append((str(key), value))
    return tuple(sorted(out))


def _check_moe(cfg: ModelConfig) -> None:
    """The MoE fields: consistent, and at their defaults on a dense model (a stray value there would be a
    different model nobody asked for)."""
    object.__setattr__(cfg, "mlp_only_layers", tuple(sorted(int(i) for i in cfg.mlp_only_layers)))
    if not isinstance(cfg.num_experts, int) or cfg.num_experts < 0:
        raise ValueError(f"ModelConfig.num_experts must be an int >= 0, got {cfg.num_experts!r}")
    if cfg.num_experts == 0:
        dense = ModelConfig.__dataclass_fields__
        moved = [f for f in ("moe_top_k", "moe_ffn_hidden_size", "norm_topk_prob", "router_aux_loss_coef",
                             "decoder_sparse_step", "mlp_only_layers", "moe_z_loss_coeff",
                             "moe_shared_expert_intermediate_size", "moe_shared_expert_gate",
                             "moe_router_score_function", "moe_router_enable_expert_bias", "moe_router_num_groups",
                             "moe_router_group_topk", "moe_router_topk_scaling_factor",
                             "moe_router_bias_update_rate",
                             "moe_expert_capacity_factor", "moe_token_drop_policy", "glu_linear_offset",
                             "activation_func_clamp_value", "moe_router_load_balancing_type", "moe_aux_loss_coeff")
                 if getattr(cfg, f) != dense[f].default]
        if moved:
            raise ValueError(f"MoE fields {moved} set on a dense model (num_experts = 0)")
        return
    if not 1 <= cfg.moe_top_k <= cfg.num_experts:
        raise ValueError(f"moe_top_k {cfg.moe_top_k} must be in 1..num_experts {cfg.num_experts}")
    if cfg.moe_ffn_hidden_size is not None and cfg.moe_ffn_hidden_size <= 0:
        raise ValueError(f"moe_ffn_hidden_size must be positive, got {cfg.moe_ffn_hidden_size}")
    shared = cfg.moe_shared_expert_intermediate_size
    if shared is not None and (not isinstance(shared, int) or shared <= 0):
        raise ValueError(f"moe_shared_expert_intermediate_size must be a positive int or None, got {shared!r}")
    if cfg.moe_shared_expert_gate and shared is None:
        raise ValueError("moe_shared_expert_gate needs a shared expert (moe_shared_expert_intermediate_size)")
    if not isinstance(cfg.decoder_sparse_step, int) or cfg.decoder_sparse_step < 1:
        raise ValueError(f"decoder_sparse_step must be an int >= 1, got {cfg.decoder_sparse_step!r}")
    outside = [i for i in cfg.mlp_only_layers if not 0 <= i < cfg.num_layers]
    if outside:
        raise ValueError(f"mlp_only_layers {outside} outside the 0-based blocks 0..{cfg.num_layers - 1}")
    if not cfg.router_aux_loss_coef >= 0:
        raise ValueError(f"router_aux_loss_coef must be >= 0, got {cfg.router_aux_loss_coef}")
    if not cfg.moe_z_loss_coeff >= 0:
        raise ValueError(f"moe_z_loss_coeff must be >= 0, got {cfg.moe_z_loss_coeff}")
    if cfg.moe_expert_capacity_factor is not None and not cfg.moe_expert_capacity_factor > 0:
        raise ValueError(f"moe_expert_capacity_factor must be > 0 (or None: dropless), got "
                         f"{cfg.moe_expert_capacity_factor}")
    if cfg.moe_router_score_function not in ("softmax", "sigmoid"):
        raise ValueError(f"moe_router_score_function must be softmax or sigmoid, got {cfg.moe_router_score_function!r}")
    groups, group_topk = cfg.moe_router_num_groups, cfg.moe_router_group_topk
    if (groups is None) != (group_topk is None):
        raise ValueError("moe_router_num_groups and moe_router_group_topk go together")
    if groups is not None and not (cfg.num_experts % groups == 0 and cfg.num_experts // groups >= 2
                                   and 1 <= group_topk <= groups and group_topk * cfg.num_experts // groups
                                   >= cfg.moe_top_k):
        raise ValueError(f"moe_router_num_groups {groups} must divide the {cfg.num_experts} experts into groups of "
                         f">= 2, and moe_router_group_topk {group_topk} groups (of 1..{groups}) must hold the "
                         f"top-{cfg.moe_top_k}")
    if (cfg.moe_router_enable_expert_bias or groups is not None) and cfg.moe_router_score_function != "sigmoid":
        raise ValueError("the expert bias and group-limited routing are built with moe_router_score_function "
                         "sigmoid (DeepSeek-V3)")
    if cfg.moe_router_bias_update_rate and not cfg.moe_router_enable_expert_bias:
        raise ValueError("moe_router_bias_update_rate needs moe_router_enable_expert_bias")
    if not cfg.moe_router_bias_update_rate >= 0:
        raise ValueError(f"moe_router_bias_update_rate must be >= 0, got {cfg.moe_router_bias_update_rate}")
    if cfg.moe_router_load_balancing_type not in ("aux_loss", "seq_aux_loss"):
        raise ValueError(f"moe_router_load_balancing_type must be aux_loss or seq_aux_loss, got "
                         f"{cfg.moe_router_load_balancing_type!r}")
    seq_aux = cfg.moe_router_load_balancing_type == "seq_aux_loss"
    if not cfg.moe_aux_loss_coeff >= 0 or (cfg.moe_aux_loss_coeff and not seq_aux):
        raise ValueError(f"moe_aux_loss_coeff {cfg.moe_aux_loss_coeff} must be >= 0, and is read with "
                         f"moe_router_load_balancing_type seq_aux_loss only")
    if cfg.moe_token_drop_policy not in ("probs", "position"):
        raise ValueError(f"moe_token_drop_policy must be probs or position, got {cfg.moe_token_drop_policy!r}")
    if cfg.activation not in GLU_ACTIVATIONS:
        raise ValueError(f"experts are built as gated MLPs ({', '.join(GLU_ACTIVATIONS)}): "
                         f"activation={cfg.activation!r} is not")
    dense_blocks = [i for i in range(1, cfg.num_layers + 1) if not cfg.is_moe_layer(i)]
    if dense_blocks and (cfg.activation != "swiglu" or cfg.activation_func_clamp_value is not None
                         or cfg.glu_linear_offset):
        raise ValueError(f"activation {cfg.activation!r} with its clamp and offset is built for the experts only "
                         f"(GPT-OSS): blocks {dense_blocks} are dense")
    clamp = cfg.activation_func_clamp_value
    if clamp is not None and not (isinstance(clamp, (int, float)) and 0 < clamp < float("inf")):
        raise ValueError(f"activation_func_clamp_value must be a positive finite number or None, got {clamp!r}")
    if cfg.linear_bias and cfg.moe_shared_expert_intermediate_size is not None:
        raise ValueError("expert biases (linear_bias) with a shared expert are not built")
    if not any(cfg.is_moe_layer(i) for i in range(1, cfg.num_layers + 1)):
        raise ValueError(f"num_experts {cfg.num_experts} but no block is MoE (decoder_sparse_step "
                         f"{cfg.decoder_sparse_step}, mlp_only_layers {list(cfg.mlp_only_layers)})")


def _check_gpt_oss(cfg: ModelConfig) -> None:
    """Attention sinks and alternating windows: valid values, and a window where the alternation asks for one."""
    _check_choice("softmax_type", cfg.softmax_type, SOFTMAX_TYPES)
    freq = cfg.window_attn_skip_freq
    if freq is not None and (not isinstance(freq, int) or isinstance(freq, bool) or freq < 2
                             or cfg.sliding_window is None):
        raise ValueError(f"window_attn_skip_freq {freq!r} must be an int >= 2 with a sliding_window (every N-th "
                         f"block attends fully, the others slide)")
    if cfg.multi_latent_attention and cfg.attention_sinks:
        raise ValueError("attention sinks (softmax_type 'learnable') with multi_latent_attention are not built")


def _check_mla(cfg: ModelConfig) -> None:
    """Multi-head latent attention's sizes: positive where used, at their defaults where not."""
    fields = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rotary_interleaved")
    if not cfg.multi_latent_attention:
        dense = ModelConfig.__dataclass_fields__
        moved = [f for f in fields if getattr(cfg, f) != dense[f].default]
        if moved:
            raise ValueError(f"multi-latent attention fields {moved} set without multi_latent_attention")
        return
    for f in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
        if not isinstance(getattr(cfg, f), int) or getattr(cfg, f) <= 0:
            raise ValueError(f"multi_latent_attention needs a positive int {f}, got {getattr(cfg, f)!r}")
    if cfg.q_lora_rank is not None and (not isinstance(cfg.q_lora_rank, int) or cfg.q_lora_rank <= 0):
        raise ValueError(f"q_lora_rank must be a positive int or None, got {cfg.q_lora_rank!r}")
    if cfg.position_embedding != "rotary" or cfg.kv_heads != cfg.num_heads or cfg.qk_norm or cfg.sliding_window:
        raise ValueError("multi_latent_attention is built with rotary positions, as many key/value heads as "
                         "query heads, no q/k norm and no sliding window")


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"ModelConfig.{name}={value!r} is not supported; choose one of {', '.join(choices)}")


def _gpt2(hidden: int, layers: int, heads: int, **kw: Any) -> ModelConfig:
    # Dropout defaults to 0 (contract default): runs at different layouts then stay comparable step by step.
    return ModelConfig(**{"vocab_size": 50257, "hidden_size": hidden, "num_layers": layers, "num_heads": heads,
                          "max_position_embeddings": 1024, **kw})


PRESETS: dict[str, ModelConfig] = {
    # vocab 8192 matches the tokenizer shipped with the repo's tiny data set.
    "gpt2-tiny": _gpt2(128, 4, 4, vocab_size=8192, max_position_embeddings=256),
    "gpt2-small": _gpt2(768, 12, 12),
    "gpt2-medium": _gpt2(1024, 24, 16),
    "gpt2-large": _gpt2(1280, 36, 20),
    "gpt2-xl": _gpt2(1600, 48, 25),
}


# Fields that describe training, not the weights: a checkpoint or HF config may differ in them.
NOT_WEIGHTS = ("hidden_dropout", "attention_dropout", "init_std", "router_aux_loss_coef", "moe_z_loss_coeff",
               "moe_expert_capacity_factor", "moe_token_drop_policy", "moe_router_bias_update_rate",
               "moe_router_load_balancing_type", "moe_aux_loss_coeff")


def differing_weight_fields(expected: ModelConfig, found: ModelConfig) -> list[str]:
    """The fields, in order, in which the two differ and that change the weights."""
    a, b = dataclasses.asdict(expected), dataclasses.asdict(found)
    return [k for k in a if k not in NOT_WEIGHTS and a[k] != b[k]]


def weight_differences(expected: ModelConfig, found: ModelConfig) -> list[str]:
    """``["field: found (model has expected)", ...]`` for every field that changes the weights."""
    a, b = dataclasses.asdict(expected), dataclasses.asdict(found)
    return [f"{k}: {b[k]!r} (model has {a[k]!r})" for k in differing_weight_fields(expected, found)]
