"""What context parallelism refuses, checked before any process group exists: one line each, saying what
to change. Each refusal is a feature not built yet (docs/long_context.md lists them), never a silently
different model."""
from __future__ import annotations

import math

from mtds.cp.chunks import ContextParallelError, check_cp_sequence
from mtds.cp.ulysses import check_ulysses_heads


def check_context_parallel(layout, model_cfg, *, seq_length: int, comm_type: str, sequence_parallel: bool,
                           reset_position_ids: bool) -> None:
    c, t = layout.cp, layout.tp
    if c == 1:
        return
    check_cp_sequence(seq_length, c)
    if sequence_parallel and (seq_length // c) % t:
        raise ContextParallelError(f"--sequence-parallel with --cp {c} splits each rank's {seq_length // c} tokens "
                                   f"over --tp {t}: use a --seq-length divisible by {math.lcm(2 * c, c * t)}")
    if comm_type == "a2a":
        check_ulysses_heads(model_cfg.num_heads // t, model_cfg.kv_heads // t, c)
    if model_cfg.hidden_dropout > 0 or model_cfg.attention_dropout > 0:
        raise ContextParallelError(
            f"--cp {c} with dropout (hidden {model_cfg.hidden_dropout}, attention {model_cfg.attention_dropout}) "
            f"is not supported yet (its masks are not yet keyed by position in the whole sequence): use --dropout 0")
    if reset_position_ids:
        raise ContextParallelError(f"--reset-position-ids with --cp {c} is not supported yet (a document's "
                                   f"positions would need its start on another rank): drop it or use --cp 1")
    if model_cfg.sliding_window is not None and model_cfg.sliding_window < seq_length:
        raise ContextParallelError(f"a sliding attention window ({model_cfg.sliding_window}) with --cp {c} is not "
                                   f"supported yet: use --cp 1 or --seq-length <= the window")
    if model_cfg.num_experts:
        raise ContextParallelError(f"mixture-of-experts models with --cp {c} are not supported yet: use --cp 1")
