"""What context parallelism refuses (docs/long_context.md): its shapes (mtds.parallel.cp_rules, which the
kernels and mtds-eval's padding use too) and the features not built with it yet."""
from __future__ import annotations

from mtds.parallel.cp_rules import cp_shape_problems
from mtds.rules.job import EVAL, Job


def cp_shapes(job: Job) -> str | None:
    """2c chunks of the sequence; with SP each rank's s/c tokens split over t; Ulysses' heads split over c."""
    if job.cp == 1:
        return None
    problems = cp_shape_problems(cp=job.cp, tp=job.tp, seq_length=job.seq_length, comm_type=job.cp_comm_type,
                                 sequence_parallel=job.sequence_parallel, num_heads=job.model.num_heads,
                                 kv_heads=job.model.kv_heads)
    return problems[0].train_message() if problems else None


def cp_features(job: Job) -> str | None:
    """Features not built with context parallelism yet."""
    c, m = job.cp, job.model
    if c == 1:
        return None
    if m.attention_dropout > 0:
        # the attention kernel draws its probabilities' mask itself, per call: split over c ranks (ring blocks
        # or Ulysses' head groups) it cannot draw c = 1's mask
        return f"--cp {c} with attention dropout ({m.attention_dropout}) is not supported (the attention kernel " \
               f"draws that mask itself and cannot draw the unsplit sequence's): set --attention-dropout 0"
    if m.hidden_dropout > 0 and job.sequence_parallel and job.tp > 1:
        return f"--cp {c} with --sequence-parallel and hidden dropout ({m.hidden_dropout}) is not supported yet " \
               f"(each TP rank's slice would need its part of the whole sequence's mask): set --hidden-dropout 0 " \
               f"or drop --sequence-parallel"
    if job.reset_position_ids:
        return f"--reset-position-ids with --cp {c} is not supported yet (a document's positions would need its " \
               f"start on another rank): drop it or use --cp 1"
    if m.sliding_window is not None and m.sliding_window < job.seq_length:
        return f"a sliding attention window ({m.sliding_window}) with --cp {c} is not supported yet: use --cp 1 " \
               f"or --seq-length <= the window"
    if m.num_experts and job.purpose == EVAL:
        return f"mtds-eval of a mixture-of-experts model with --cp {c} is not built yet (training is): use --cp 1"
    if m.num_experts and job.pp > 1:
        # tried with this lifted: Mixtral (1,2,1) c = 2 trained off transformers (grad norm 7.9e-4, docs/moe.md)
        return f"mixture-of-experts models with --cp {c} and --pp {job.pp} are not built yet (verified at " \
               f"--pp 1): use --pp 1 or --cp 1"
    if m.num_experts and job.moe_capacity:
        # each rank would drop past a capacity of its own s/c tokens: other drops than c = 1's
        return f"--moe-expert-capacity-factor with --cp {c} is not built (each rank would drop by a capacity " \
               f"of its own s/{c} tokens, not the whole sequence's): drop the capacity factor or use --cp 1"
    return None
