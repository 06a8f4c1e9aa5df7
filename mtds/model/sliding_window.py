"""Sliding-window causal attention (Mistral): query i sees keys i - window + 1 .. i, transformers'
``kv_idx > q_idx - sliding_window`` on top of the causal mask.

A window at least as long as the sequence hides nothing: plain causal attention then (SDPA's
``is_causal``, no mask tensor), which is also how Mistral v0.2+ (``sliding_window: null``) trains.
"""
from __future__ import annotations

import torch


def window_bites(window: int | None, seq: int) -> bool:
    return window is not None and window < seq


def window_mask(window: int, seq: int, device) -> torch.Tensor:
    """[s, s] bool for SDPA (True = may attend): causal and within the last ``window`` positions."""
    i = torch.arange(seq, device=device)
    distance = i[:, None] - i[None, :]          # query minus key position
    return (distance >= 0) & (distance < window)
