"""Small helpers shared by the per-architecture HF adapters."""
from __future__ import annotations

from typing import Any

from mtds.model.config import ModelConfig


class UnsupportedHFConfig(ValueError):
    """A HF config we cannot reproduce exactly; the message says what is supported instead."""


def require(cond: bool, message: str) -> None:
    if not cond:
        raise UnsupportedHFConfig(message)


def read_rope(d: dict[str, Any], arch: str, *, default_theta: float, default_percent: float) -> tuple[float, float]:
    """(rope base, rotary percent) from either transformers-5 `rope_parameters` or the older flat keys.

    Only plain RoPE is implemented: any scaling type (linear, dynamic, yarn, llama3, ...) is refused,
    because silently ignoring it would give a different model at long context.
    """
    params = dict(d.get("rope_parameters") or {})
    scaling = dict(d.get("rope_scaling") or {})
    rope_type = (params.get("rope_type") or params.get("type") or scaling.get("rope_type")
                 or scaling.get("type") or "default")
    require(rope_type == "default",
            f"{arch}: rope scaling type {rope_type!r} is not supported; only plain RoPE (rope_type 'default')")
    theta = params.get("rope_theta", d.get("rope_theta", d.get("rotary_emb_base", default_theta)))
    percent = params.get("partial_rotary_factor",
                         d.get("partial_rotary_factor", d.get("rotary_pct", default_percent)))
    return float(theta), float(percent)


def rope_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """Both spellings, so transformers 4.x (flat keys) and 5.x (rope_parameters) read the same RoPE."""
    return {"rope_parameters": {"rope_type": "default", "rope_theta": cfg.rotary_base,
                                "partial_rotary_factor": cfg.rotary_percent},
            "rope_theta": cfg.rotary_base}


def require_export(cfg: ModelConfig, arch: str, **expected: Any) -> None:
    """Refuse to export a ModelConfig the target HF architecture cannot express."""
    for field, want in expected.items():
        have = getattr(cfg, field)
        ok = have in want if isinstance(want, tuple) else have == want
        require(ok, f"cannot export to {arch}: it needs {field}={want!r}, this model has {have!r}")
