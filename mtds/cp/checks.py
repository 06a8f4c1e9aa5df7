"""What context parallelism refuses, checked before any process group exists: one line each, saying what
to change. Each refusal is a feature not built yet (docs/long_context.md lists them), never a silently
different model."""
from __future__ import annotations

from mtds.cp.chunks import ContextParallelError
from mtds.parallel.cp_rules import cp_shape_problems


def check_context_parallel(layout, model_cfg, *, seq_length: int, comm_type: str, sequence_parallel: bool,
                           reset_position_ids: bool) -> None:
    c = layout.cp
    if c == 1:
        return
    # the shape rules the planner applies too (mtds.parallel.cp_rules): the first one broken
    problems = cp_shape_problems(cp=c, tp=layout.tp, seq_length=seq_length, comm_type=comm_type,
                                 sequence_parallel=sequence_parallel, num_heads=model_cfg.num_heads,
                                 kv_heads=model_cfg.kv_heads)
    if problems:
        raise ContextParallelError(problems[0].train_message())
    if model_cfg.attention_dropout > 0:
        # the attention kernel draws its probabilities' mask itself, per call: split over c ranks (ring blocks
        # or Ulysses' head groups) it cannot draw c = 1's mask
        raise ContextParallelError(
            f"--cp {c} with attention dropout ({model_cfg.attention_dropout}) is not supported (the attention "
            f"kernel draws that mask itself and cannot draw the unsplit sequence's): set --attention-dropout 0")
    if model_cfg.hidden_dropout > 0 and sequence_parallel and layout.tp > 1:
        raise ContextParallelError(
            f"--cp {c} with --sequence-parallel and hidden dropout ({model_cfg.hidden_dropout}) is not supported "
            f"yet (each TP rank's slice would need its part of the whole sequence's mask): set "
            f"--hidden-dropout 0 or drop --sequence-parallel")
    if reset_position_ids:
        raise ContextParallelError(f"--reset-position-ids with --cp {c} is not supported yet (a document's "
                                   f"positions would need its start on another rank): drop it or use --cp 1")
    if model_cfg.sliding_window is not None and model_cfg.sliding_window < seq_length:
        raise ContextParallelError(f"a sliding attention window ({model_cfg.sliding_window}) with --cp {c} is not "
                                   f"supported yet: use --cp 1 or --seq-length <= the window")
    if model_cfg.num_experts:
        raise ContextParallelError(f"mixture-of-experts models with --cp {c} are not supported yet: use --cp 1")
