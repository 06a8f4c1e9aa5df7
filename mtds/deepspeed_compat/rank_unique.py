"""Parameters whose values differ between data-parallel ranks by design (an expert-parallel rank's own
experts). At start-up DeepSpeed's engine broadcasts every parameter from data-parallel rank 0
(``DeepSpeedEngine._broadcast_model``), except its own MoE class's experts and parameters marked
``ds_optim_param`` (its marker for weights unique per rank, set by ``deepspeed.linear.OptimizedLinear``).
Without the marker every rank would start from rank 0's experts.

Checked against DeepSpeed 0.19.8 (``capabilities``: "keep rank-unique parameters out of the start-up
broadcast"); the marker's other reader is the OptimizedLinear offload, which runs only for those modules.
"""
from __future__ import annotations


def keep_out_of_startup_broadcast(params) -> None:
    for p in params:
        p.ds_optim_param = True
