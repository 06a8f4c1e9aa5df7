"""Model hyper-parameters: one frozen dataclass shared by the model, the pipeline builder, checkpoints and
the HF adapters, and the presets.

A ModelConfig describes the *logical* model only (no parallel layout): every quantity here is the
same whatever t, p or d is, which is what makes weights and checkpoints layout independent.

It imports only ``mtds.parallel.vocab`` and no torch, so every layer (the planner too) may import it.
Which config a name or a HF file means is :func:`mtds.hf.resolve.resolve_model_config`.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from mtds.parallel.vocab import padded_vocab_size

POSITION_EMBEDDINGS = ("learned", "rotary")
NORMALIZATIONS = ("layernorm", "rmsnorm")
ACTIVATIONS = ("gelu_tanh", "gelu", "swiglu")
ARCHITECTURES = ("gpt2", "gpt_neox", "llama")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int | None = None          # None -> num_heads (multi-head); fewer = grouped-query attention
    ffn_hidden_size: int | None = None       # None -> 4 * hidden_size (resolved in __post_init__)
    max_position_embeddings: int = 1024
    position_embedding: str = "learned"      # "learned" (GPT-2) | "rotary" (NeoX, Llama)
    rotary_percent: float = 1.0              # fraction of each head's dims that are rotated (NeoX: 0.25)
    rotary_base: float = 10000.0
    normalization: str = "layernorm"         # "layernorm" | "rmsnorm"
    norm_eps: float = 1e-5
    activation: str = "gelu_tanh"            # "gelu_tanh" (GPT-2 gelu_new) | "gelu" (exact) | "swiglu"
    qkv_bias: bool = True                    # bias of the fused QKV projection
    linear_bias: bool = True                 # bias of attention out-proj and both MLP projections
    parallel_residual: bool = False          # NeoX: x + attn(ln1(x)) + mlp(ln2(x))
    tie_word_embeddings: bool = True
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    init_std: float = 0.02
    make_vocab_size_divisible_by: int = 128
    architecture: str = "gpt2"               # which HF family this maps to (for import/export)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "max_position_embeddings",
                     "make_vocab_size_divisible_by"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by num_heads {self.num_heads}")
        if self.num_kv_heads is not None and (self.num_kv_heads <= 0 or self.num_heads % self.num_kv_heads):
            raise ValueError(f"num_kv_heads {self.num_kv_heads} must be positive and divide "
                             f"num_heads {self.num_heads}")
        if self.ffn_hidden_size is not None and self.ffn_hidden_size <= 0:
            raise ValueError(f"ffn_hidden_size must be positive, got {self.ffn_hidden_size}")
        # Resolve the None defaults so equal models compare equal whichever way they were spelled.
        object.__setattr__(self, "num_kv_heads", self.num_kv_heads or self.num_heads)
        object.__setattr__(self, "ffn_hidden_size", self.ffn_hidden_size or 4 * self.hidden_size)
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
        return self.hidden_size // self.num_heads

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def rotary_dim(self) -> int:
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
NOT_WEIGHTS = ("hidden_dropout", "attention_dropout", "init_std")


def weight_differences(expected: ModelConfig, found: ModelConfig) -> list[str]:
    """``["field: found (model has expected)", ...]`` for every field that changes the weights."""
    a = {k: v for k, v in dataclasses.asdict(expected).items() if k not in NOT_WEIGHTS}
    b = {k: v for k, v in dataclasses.asdict(found).items() if k not in NOT_WEIGHTS}
    return [f"{k}: {b[k]!r} (model has {a[k]!r})" for k in a if a[k] != b[k]]
