"""The model as the planner sees it: a GPT-style decoder described by a handful of sizes."""
from __future__ import annotations

from dataclasses import dataclass

from mtds import metrics


@dataclass(frozen=True)
class ModelSpec:
    """Decoder-only transformer: l layers, hidden h, a heads, vocab V, sequence s, FFN width f.

    The FLOP and activation formulas of the papers assume f = 4h and learned positions (GPT);
    other f are handled in the per-GEMM timing and in `params_per_layer`.
    """

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    ffn_hidden: int | None = None
    name: str = ""
    vocab_multiple: int = 128   # Megatron pads V up to a multiple of vocab_multiple * t

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or 4 * self.hidden

    def padded_vocab(self, tp: int) -> int:
        """Megatron vocabulary padding: ceil(V / (128 t)) * 128 t."""
        unit = self.vocab_multiple * tp
        return -(-self.vocab // unit) * unit

    @property
    def params(self) -> float:
        """Total parameters; PTD-P Section 5.1 formula when f = 4h (see metrics.gpt_param_count)."""
        if self.ffn == 4 * self.hidden:
            return metrics.gpt_param_count(self.layers, self.hidden, self.vocab, self.seq)
        return self.layers * self.params_per_layer() + (self.vocab + self.seq) * self.hidden + 2 * self.hidden

    def params_per_layer(self) -> float:
        """QKV 3h^2+3h, projection h^2+h, MLP 2hf+f+h, two layer norms 4h (= 12h^2+13h at f=4h)."""
        h, f = self.hidden, self.ffn
        return 4 * h * h + 2 * h * f + 9 * h + f

    def model_flops(self, batch: int) -> float:
        """Model FLOPs per iteration: PTD-P eq. 3 without recompute (metrics.model_flops_per_iteration).

        For f != 4h the same derivation with per-token layer matmuls 2(4h^2 + 2hf) + 4sh and
        logits 2hV: F = 3 B s (l (8h^2 + 4hf + 4sh) + 2hV), which equals 72 B s l h^2 (...) at f = 4h.
        """
        return self.hardware_flops(batch, "none")

    def hardware_flops(self, batch: int, recompute: str) -> float:
        """Executed FLOPs including recomputation: the count the step log uses too
        (metrics.training_flops_per_iteration; equals metrics.hardware_flops_per_iteration at f = 4h)."""
        return metrics.training_flops_per_iteration(batch, self.seq, self.layers, self.hidden, self.vocab,
                                                    ffn_hidden=self.ffn, recompute=recompute)

    def __str__(self) -> str:
        tag = f"{self.name} " if self.name else ""
        return (f"{tag}l={self.layers} h={self.hidden} a={self.heads} V={self.vocab} s={self.seq} "
                f"({self.params / 1e9:.1f}B params)")


def resolve_model(name_or_path, *, seq: int | None = None, **overrides) -> ModelSpec:
    """ModelSpec from a preset name or HF config via mtds.config.resolve_model_config (optional)."""
    try:
        from mtds.config import resolve_model_config
    except ImportError as exc:  # the config module is optional for the planner
        raise ValueError(f"model presets need mtds.config ({exc}); pass --layers/--hidden/--heads/--vocab") from exc
    cfg = resolve_model_config(name_or_path)
    ffn = cfg.ffn_hidden_size or 4 * cfg.hidden_size
    if getattr(cfg, "activation", "") == "swiglu":
        # SwiGLU has three h x f matrices: same weights and matmul FLOPs as a 2-matrix MLP of
        # width 1.5 f (approximation: element-wise traffic and GQA's smaller K/V are not modelled)
        ffn = int(1.5 * ffn)
    spec = ModelSpec(
        layers=cfg.num_layers, hidden=cfg.hidden_size, heads=cfg.num_heads, vocab=cfg.vocab_size,
        seq=seq or cfg.max_position_embeddings, ffn_hidden=ffn, name=str(name_or_path),
    )
    return ModelSpec(**{**spec.__dict__, **{k: v for k, v in overrides.items() if v is not None}})
