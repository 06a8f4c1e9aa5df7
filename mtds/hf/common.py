"""Small helpers shared by the per-architecture HF adapters."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mtds.model.config import ModelConfig


class UnsupportedHFConfig(ValueError):
    """A HF config we cannot reproduce exactly; the message says what is supported instead."""


def require(cond: bool, message: str) -> None:
    if not cond:
        raise UnsupportedHFConfig(message)


# The keys each trainable RoPE scaling reads (transformers' modeling_rope_utils); others are ignored there too.
ROPE_SCALING_KEYS = {"linear": ("factor",),
                     "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                     "yarn": ("factor", "original_max_position_embeddings", "attention_factor", "beta_fast",
                              "beta_slow", "mscale", "mscale_all_dim", "truncate")}
_WHY_NOT = {"dynamic": "it rescales RoPE by the length of each sequence at inference, which training does not see",
            "longrope": "its per-dim factors switch at the original context length (Phi-3 style), not implemented"}


@dataclass(frozen=True)
class Rope:
    theta: float
    percent: float
    scaling: str | None = None             # None: plain RoPE
    params: tuple = ()                     # sorted (key, value) pairs of that scaling


def read_rope(d: dict[str, Any], arch: str, *, default_theta: float, default_percent: float,
              scalings: tuple[str, ...] = ()) -> Rope:
    """RoPE from either transformers-5 `rope_parameters` or the older `rope_scaling` dict and flat keys.

    ``scalings``: the scaling types this family trains with (of ROPE_SCALING_KEYS); any other type is
    refused, because silently ignoring it would give a different model at long context. As in transformers
    5, a `rope_scaling` dict wins over `rope_parameters`, and llama3/yarn default their
    original_max_position_embeddings to the config's (top-level one first, then max_position_embeddings).
    """
    field = "rope_scaling" if d.get("rope_scaling") else "rope_parameters"
    params = dict(d.get(field) or {})
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type != "default" and rope_type not in scalings:
        why = _WHY_NOT.get(rope_type, "not implemented")
        supported = ", ".join(("default", *scalings))
        raise UnsupportedHFConfig(f"{arch}: {field} rope_type {rope_type!r} is not supported ({why}); "
                                  f"supported: {supported}")
    theta = params.get("rope_theta", d.get("rope_theta", d.get("rotary_emb_base", default_theta)))
    percent = params.get("partial_rotary_factor",
                         d.get("partial_rotary_factor", d.get("rotary_pct", default_percent)))
    if rope_type == "default":
        return Rope(float(theta), float(percent))
    if rope_type in ("llama3", "yarn"):
        original = d.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
        params["original_max_position_embeddings"] = original or d.get("max_position_embeddings")
    kept = tuple(sorted((k, params[k]) for k in ROPE_SCALING_KEYS[rope_type] if params.get(k) is not None))
    return Rope(float(theta), float(percent), rope_type, kept)


def rope_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """Both spellings, so transformers 4.x (flat keys, `rope_scaling`) and 5.x (rope_parameters) read the same
    RoPE. (Transformers 5 prefers `rope_scaling` when both are present: it holds the same scaling.)"""
    scaling = {"rope_type": cfg.rope_scaling, **cfg.rope_params} if cfg.rope_scaling else None
    # partial_rotary_factor only where partial: transformers' own configs of whole-head RoPE have none
    partial = {"partial_rotary_factor": cfg.rotary_percent} if cfg.rotary_percent != 1.0 else {}
    out = {"rope_parameters": {"rope_type": "default", "rope_theta": cfg.rotary_base, **partial, **(scaling or {})},
           "rope_theta": cfg.rotary_base}
    if scaling:
        out["rope_scaling"] = scaling
    return out


# What the GPT-2 and NeoX layouts cannot express: the Llama-family switches, at their plain values.
PLAIN_ATTENTION = dict(kv_channels=None, has_out_proj_bias=True, qk_norm=False, sliding_window=None, rope_scaling=None)


def require_export(cfg: ModelConfig, arch: str, **expected: Any) -> None:
    """Refuse to export a ModelConfig the target HF architecture cannot express."""
    for field, want in expected.items():
        have = getattr(cfg, field)
        ok = have in want if isinstance(want, tuple) else have == want
        require(ok, f"cannot export to {arch}: it needs {field}={want!r}, this model has {have!r}")
