"""The model as the planner sees it: a GPT-style decoder described by a handful of sizes."""
from __future__ import annotations

import functools
from dataclasses import dataclass

from mtds.observe import metrics
from mtds.parallel.vocab import padded_vocab_size
from mtds.rules.job import ModelFacts


@dataclass(frozen=True)
class ModelSpec:
    """Decoder-only transformer: l layers, hidden h, a heads, vocab V, sequence s, FFN width f.

    Defaults describe GPT (multi-head attention, 2-matrix GELU MLP of width 4h, learned positions,
    biases, LayerNorm, tied embeddings). The other fields describe the families mtds trains (NeoX,
    Llama): ``kv_heads`` < a is grouped-query attention (K and V are h * kv_heads / a wide),
    ``gated_mlp`` a SwiGLU MLP (three h x f matrices), ``untied_head`` a separate LM-head matrix,
    ``rotary`` no position table, ``qkv_bias``/``linear_bias`` False: bias-free QKV / MLP (and projection,
    unless ``out_proj_bias`` says otherwise: Qwen2 has QKV biases only, Llama attention_bias without mlp_bias),
    ``rmsnorm`` one vector per norm; ``head_dim`` a per-head width other than h / a (Qwen3: Q is a d wide, the
    projection a d -> h), ``qk_norm`` a head_dim-wide norm on Q and on K per layer.
    FLOPs for all of them come from the same count as the step log (metrics.training_flops_per_iteration);
    the activation-memory formulas (Korthikanti et al.) stay the GPT ones.

    Mixture of experts (docs/moe.md, docs/planner.md "Mixture of experts"): ``num_experts`` E > 0 makes
    ``moe_layers`` of the l blocks (None: all of them) route each token to ``moe_top_k`` k of E bias-free SwiGLU
    experts of width ``moe_ffn_hidden`` F (None: f), three h x F matrices each, through an h x E router; the
    other blocks keep the dense MLP. Which blocks are MoE is not kept, only how many: the planner spreads them
    evenly over the pipeline stages (per-layer sizes below are averages over the l blocks). ``moe_shared_ffn``
    S > 0 adds a shared expert beside the routed ones in every MoE block (a SwiGLU MLP of width S, split t ways
    like the dense MLP; Qwen2-MoE, DeepSeek-V3), ``moe_shared_gate`` its h x 1 sigmoid gate (Qwen2-MoE).

    Multi-head latent attention (DeepSeek-V3; ``kv_lora_rank`` r_kv > 0): per head a query/key of
    ``qk_head_dim`` + ``qk_pos_emb_head_dim`` (the RoPE part) and a value of ``v_head_dim``; Q straight from h
    (``q_lora_rank`` None) or through a rank-r_q down-projection and its norm; K/V through one h x (r_kv + RoPE)
    down-projection (the RoPE key shared by all heads), a norm, and an r_kv x a(qk + v) up-projection. Under TP
    the up-projections and the output projection split with the heads; the down-projections and their norms are
    replicated (docs/moe.md), as mtds builds them.

    GPT-OSS: ``attention_sinks`` adds a learned logit per head (split t ways with the heads); ``expert_biases``
    biases on the router (E, replicated), on each expert's gate|up (2F, split t ways) and down (h, whole on every
    TP rank: :meth:`expert_whole_params_per_layer`). The eager sink core's s x s probabilities are not modelled.
    """

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    ffn_hidden: int | None = None
    name: str = ""
    vocab_multiple: int = 128   # Megatron pads V up to a multiple of vocab_multiple * t
    kv_heads: int | None = None
    gated_mlp: bool = False
    untied_head: bool = False
    rotary: bool = False
    qkv_bias: bool = True
    linear_bias: bool = True
    rmsnorm: bool = False
    head_dim: int | None = None          # None: h / a
    out_proj_bias: bool | None = None    # None: as linear_bias
    qk_norm: bool = False
    num_experts: int = 0                 # 0: dense
    moe_top_k: int = 2
    moe_ffn_hidden: int | None = None    # None: ffn
    moe_layers: int | None = None        # None: every block (when num_experts > 0)
    # what train.py's rules weigh besides the sizes (mtds.rules; a model read from a config carries them)
    moe_positions: tuple[int, ...] | None = None   # which blocks (0-based) hold experts; None: spread evenly
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    sliding_window: int | None = None
    moe_shared_ffn: int = 0              # 0: no shared expert
    moe_shared_gate: bool = False
    q_lora_rank: int | None = None       # latent attention (kv_lora_rank > 0) only: None = a full-rank Q
    kv_lora_rank: int = 0                # 0: the attention is the QKV one above
    qk_head_dim: int = 0
    qk_pos_emb_head_dim: int = 0
    v_head_dim: int = 0
    attention_sinks: bool = False        # a learned logit per head (GPT-OSS): a parameters per layer, split with them
    expert_biases: bool = False          # biases on the router, the experts' gate|up (split t ways) and down (whole)

    @classmethod
    def from_config(cls, cfg, seq: int | None = None, name: str = "") -> "ModelSpec":
        """The planner's view of an ``mtds.hf.resolve.ModelConfig`` (every architecture field carried over)."""
        return cls(layers=cfg.num_layers, hidden=cfg.hidden_size, heads=cfg.num_heads, vocab=cfg.vocab_size,
                   seq=seq or cfg.max_position_embeddings, ffn_hidden=cfg.ffn_size, name=name,
                   vocab_multiple=cfg.make_vocab_size_divisible_by, kv_heads=cfg.kv_heads,
                   gated_mlp=cfg.activation in ("swiglu", "quick_geglu"), untied_head=not cfg.tie_word_embeddings,
                   rotary=cfg.position_embedding == "rotary", qkv_bias=cfg.qkv_bias, linear_bias=cfg.linear_bias,
                   rmsnorm=cfg.normalization == "rmsnorm", head_dim=cfg.kv_channels,
                   out_proj_bias=cfg.out_proj_bias, qk_norm=cfg.qk_norm, attention_dropout=cfg.attention_dropout,
                   hidden_dropout=cfg.hidden_dropout, sliding_window=cfg.sliding_window,
                   attention_sinks=getattr(cfg, "attention_sinks", False), **_moe_fields(cfg),
                   **_latent_fields(cfg))

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.hidden

    @property
    def moe_ffn(self) -> int:
        """Width F of one expert."""
        return self.moe_ffn_hidden or self.ffn

    @property
    def moe_blocks(self) -> int:
        """How many blocks hold experts (0 for a dense model)."""
        if not self.num_experts:
            return 0
        return self.layers if self.moe_layers is None else self.moe_layers

    @functools.lru_cache(maxsize=32)     # frozen, so hashable: the planner asks it of every candidate
    def facts(self) -> ModelFacts:
        """What the rulebook (mtds.rules) weighs of this model: which blocks hold experts as the config says, else
        (a model given by its sizes) spread evenly over the l blocks, as the planner's per-stage costs take them."""
        n = self.moe_blocks
        moe = self.moe_positions if self.moe_positions is not None else \
            tuple(sorted({(i * self.layers) // n for i in range(n)})) if n else ()
        return ModelFacts(num_layers=self.layers, hidden_size=self.hidden, num_heads=self.heads,
                          kv_heads=self.kv_heads or self.heads, ffn_size=self.ffn, num_experts=self.num_experts,
                          moe_ffn_size=self.moe_ffn if self.num_experts else 0, moe_blocks=moe,
                          shared_expert_ffn_size=self.moe_shared_ffn if self.num_experts else 0,
                          latent_attention=self.latent,
                          attention_dropout=self.attention_dropout, hidden_dropout=self.hidden_dropout,
                          sliding_window=self.sliding_window)

    @property
    def moe_fraction(self) -> float:
        """Share of the blocks that are MoE: per-layer averages weight the MoE block by it."""
        return self.moe_blocks / self.layers

    @property
    def latent(self) -> bool:
        """Multi-head latent attention (DeepSeek-V3) instead of the QKV one."""
        return self.kv_lora_rank > 0

    @property
    def shared_expert_params(self) -> float:
        """One MoE block's shared expert: 3 h S (SwiGLU; split t ways) — its gate (h, replicated) aside."""
        return 3.0 * self.hidden * self.moe_shared_ffn if self.num_experts else 0.0

    def latent_params(self) -> tuple[float, float]:
        """(split with the heads, replicated) parameters of one latent attention: Q (or its up-projection), the
        K/V up-projection and the output projection; the down-projections and their norms."""
        h, a = self.hidden, self.heads
        qk = self.qk_head_dim + self.qk_pos_emb_head_dim
        norm = 1 if self.rmsnorm else 2
        split = (h if self.q_lora_rank is None else self.q_lora_rank) * a * qk \
            + self.kv_lora_rank * a * (self.qk_head_dim + self.v_head_dim) + a * self.v_head_dim * h
        whole = h * (self.kv_lora_rank + self.qk_pos_emb_head_dim) + norm * self.kv_lora_rank
        if self.q_lora_rank is not None:
            whole += h * self.q_lora_rank + norm * self.q_lora_rank
        return float(split), float(whole)

    def expert_params_per_layer(self) -> float:
        """Expert parameters of one layer, averaged over the l blocks: E x 3 h F per MoE block (bias-free SwiGLU).
        They are split t ways (inside each expert) and ep ways (experts over data ranks)."""
        bias = 2 * self.moe_ffn if self.expert_biases else 0
        return self.moe_fraction * self.num_experts * (3 * self.hidden * self.moe_ffn + bias)

    def expert_whole_params_per_layer(self) -> float:
        """The experts' down biases (``expert_biases``), averaged over the l blocks: E x h per MoE block, whole on
        every TP rank (added once after the experts' all-reduce), split ep ways with their experts."""
        return self.moe_fraction * self.num_experts * self.hidden if self.expert_biases else 0.0

    @property
    def active_ffn(self) -> float:
        """The per-block width whose FLOPs equal what the blocks compute per token (k active experts + the
        router): the step log's count (metrics.active_ffn_width), f for a dense model."""
        if not self.moe_blocks:
            return float(self.ffn)
        shared = self.moe_shared_ffn + (1 / 3 if self.moe_shared_gate else 0)
        return metrics.moe_active_ffn_width(self.layers, self.ffn, self.moe_blocks, self.num_experts,
                                            self.moe_top_k, self.moe_ffn, shared)

    @property
    def q_width(self) -> float:
        """Width of Q (and of the attention context): h, or a * head_dim where that is set; latent attention:
        a (qk + RoPE dims) for Q and K."""
        if self.latent:
            return float(self.heads * (self.qk_head_dim + self.qk_pos_emb_head_dim))
        return self.heads * self.head_dim if self.head_dim else self.hidden

    @property
    def kv_width(self) -> float:
        """Width of K (and of V): h for multi-head attention, h * kv_heads / heads for GQA; latent attention:
        K's (V's is :attr:`v_width`)."""
        return self.q_width * (self.kv_heads or self.heads) / self.heads

    @property
    def v_width(self) -> float:
        """Width of V and of the attention's output (the output projection's input)."""
        return float(self.heads * self.v_head_dim) if self.latent else self.kv_width

    @property
    def cp_widths(self) -> tuple[float, float]:
        """(Q, K = V) widths context parallelism exchanges: latent attention's value and query/key heads are
        zero-padded to the larger of the two dims (mtds.cp), so each is a · max(qk + RoPE, v)."""
        if not self.latent:
            return self.q_width, self.kv_width
        width = float(self.heads * max(self.qk_head_dim + self.qk_pos_emb_head_dim, self.v_head_dim))
        return width, width

    @property
    def context_width(self) -> float:
        """Width of the attention's output, the output projection's input."""
        return float(self.heads * self.v_head_dim) if self.latent else self.q_width

    @property
    def has_out_proj_bias(self) -> bool:
        return self.linear_bias if self.out_proj_bias is None else self.out_proj_bias

    @property
    def qk_norm_params(self) -> float:
        """Parameters of one layer's q and k norms: each head_dim wide (weight, + bias for LayerNorm)."""
        return 2 * (self.q_width / self.heads) * (1 if self.rmsnorm else 2) if self.qk_norm else 0

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.gated_mlp else 2

    def padded_vocab(self, tp: int) -> int:
        """Megatron vocabulary padding: ceil(V / (128 t)) * 128 t (mtds.parallel.vocab.padded_vocab_size)."""
        return padded_vocab_size(self.vocab, tp, self.vocab_multiple)

    @property
    def params(self) -> float:
        """Total parameters (unpadded vocabulary), counted exactly. For the GPT shape this is PTD-P
        Section 5.1's 12lh^2(1 + 13/(12h) + (V+s)/(12lh)) (metrics.gpt_param_count) + the final norm's 2h,
        which the paper leaves out."""
        h = self.hidden
        embeddings = self.vocab * h * (2 if self.untied_head else 1) + (0 if self.rotary else self.seq * h)
        return self.layers * self.params_per_layer() + embeddings + self.norm_params

    @property
    def norm_params(self) -> int:
        """Parameters of one normalization: weight and bias (LayerNorm) or weight only (RMSNorm)."""
        return self.hidden * (1 if self.rmsnorm else 2)

    def sharded_params_per_layer(self) -> float:
        """Parameters of one layer that tensor parallelism splits t ways: the QKV weight h(q + 2 h_kv)
        (q = h unless head_dim is set) and bias, the projection weight q h, the MLP matrices (2 or 3) x h f
        and the column-parallel MLP biases (f each for fc1 and, gated, the gate)."""
        h, f = self.hidden, self.ffn
        dense = 1.0 - self.moe_fraction        # MoE blocks have experts (expert_params_per_layer) instead
        shared = self.moe_fraction * self.shared_expert_params
        sinks = self.heads if self.attention_sinks else 0
        mlp_bias = (self.mlp_matrices - 1) * f * dense if self.linear_bias else 0.0
        if self.latent:
            return self.latent_params()[0] + dense * self.mlp_matrices * h * f + mlp_bias + shared + sinks
        qkv = self.q_width + 2 * self.kv_width
        bias = (qkv if self.qkv_bias else 0.0) + mlp_bias
        return h * qkv + self.q_width * h + dense * self.mlp_matrices * h * f + bias + shared + sinks

    def replicated_params_per_layer(self) -> float:
        """Parameters of one layer every TP rank holds whole: two norms, the row-parallel biases
        (projection and fc2, h each), the q/k norms and, in MoE blocks, the h x E router."""
        dense = 1.0 - self.moe_fraction
        biases = (self.hidden if self.has_out_proj_bias else 0) + (self.hidden * dense if self.linear_bias else 0)
        router = self.moe_fraction * (self.hidden * (self.num_experts + (1 if self.moe_shared_gate else 0))
                                      + (self.num_experts if self.expert_biases else 0))
        latent = self.latent_params()[1] if self.latent else 0.0
        return 2 * self.norm_params + biases + self.qk_norm_params + router + latent

    def params_per_layer(self) -> float:
        """Sharded + replicated (= 12h^2 + 13h for the GPT shape: QKV 3h^2+3h, projection h^2+h,
        MLP 2hf+f+h, two layer norms 4h at f = 4h) + experts."""
        return (self.sharded_params_per_layer() + self.replicated_params_per_layer() + self.expert_params_per_layer()
                + self.expert_whole_params_per_layer())

    def model_flops(self, batch: int) -> float:
        """Model FLOPs per iteration: PTD-P eq. 3 without recompute for the GPT shape; for other shapes
        the same derivation (metrics.training_flops_per_iteration: GQA's narrower K/V, SwiGLU's third
        matrix, any f)."""
        return self.hardware_flops(batch, "none")

    def hardware_flops(self, batch: int, recompute: str) -> float:
        """Executed FLOPs including recomputation: the count the step log uses too
        (metrics.training_flops_per_iteration; equals metrics.hardware_flops_per_iteration at f = 4h)."""
        return metrics.training_flops_per_iteration(batch, self.seq, self.layers, self.hidden, self.vocab,
                                                    ffn_hidden=self.active_ffn, num_heads=self.heads,
                                                    num_kv_heads=self.kv_heads, gated_mlp=self.gated_mlp,
                                                    head_dim=self.head_dim, recompute=recompute,
                                                    attention=self.latent_attention_flops())

    def latent_attention_flops(self) -> tuple[float, float] | None:
        """Latent attention's (projections, core) forward FLOPs per token and layer: the step log's count."""
        if not self.latent:
            return None
        return metrics.latent_attention_flops_of_sizes(self.hidden, self.heads, self.q_lora_rank, self.kv_lora_rank,
                                                       self.qk_head_dim, self.qk_pos_emb_head_dim, self.v_head_dim,
                                                       self.seq)

    def __str__(self) -> str:
        tag = f"{self.name} " if self.name else ""
        extra = "".join([f" kv={self.kv_heads}" if self.kv_heads and self.kv_heads != self.heads else "",
                         " swiglu" if self.gated_mlp else "", f" d={self.head_dim}" if self.head_dim else "",
                         " qk-norm" if self.qk_norm else "",
                         f" mla r_q={self.q_lora_rank} r_kv={self.kv_lora_rank}" if self.latent else "",
                         f" moe E={self.num_experts} k={self.moe_top_k} F={self.moe_ffn} x{self.moe_blocks}"
                         if self.moe_blocks else "", f" shared={self.moe_shared_ffn}" if self.moe_shared_ffn else ""])
        return (f"{tag}l={self.layers} h={self.hidden} a={self.heads} V={self.vocab} s={self.seq}{extra} "
                f"({self.params / 1e9:.1f}B params)")


def _moe_fields(cfg) -> dict:
    """The MoE sizes of a ModelConfig (an older or dense config without them: none)."""
    experts = getattr(cfg, "num_experts", 0)
    if not experts:
        return {}
    positions = tuple(i for i in range(cfg.num_layers) if cfg.is_moe_layer(i + 1))
    return {"num_experts": experts, "moe_top_k": cfg.moe_top_k, "moe_ffn_hidden": cfg.moe_ffn_size,
            "moe_layers": len(positions), "moe_positions": positions,
            "moe_shared_ffn": cfg.moe_shared_expert_intermediate_size or 0,
            "moe_shared_gate": bool(cfg.moe_shared_expert_gate), "expert_biases": bool(cfg.linear_bias)}


def _latent_fields(cfg) -> dict:
    """The multi-head latent attention sizes of a ModelConfig (none where it has the QKV attention)."""
    if not getattr(cfg, "multi_latent_attention", False):
        return {}
    return {"q_lora_rank": cfg.q_lora_rank, "kv_lora_rank": cfg.kv_lora_rank, "qk_head_dim": cfg.qk_head_dim,
            "qk_pos_emb_head_dim": cfg.qk_pos_emb_head_dim, "v_head_dim": cfg.v_head_dim}


def resolve_model(name_or_path, *, seq: int | None = None, **overrides) -> ModelSpec:
    """ModelSpec from a preset name or HF config via mtds.hf.resolve.resolve_model_config (optional)."""
    try:
        from mtds.hf.resolve import resolve_model_config
    except ImportError as exc:  # the config module is optional for the planner
        raise ValueError(f"model presets need mtds.hf.resolve ({exc}); pass --layers/--hidden/--heads/--vocab") from exc
    spec = ModelSpec.from_config(resolve_model_config(name_or_path), seq=seq, name=str(name_or_path))
    return ModelSpec(**{**spec.__dict__, **{k: v for k, v in overrides.items() if v is not None}})
