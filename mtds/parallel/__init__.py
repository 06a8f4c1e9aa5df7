"""The parallel layout's vocabulary, shared by the trainer and the planner: the (t, p, d, v) grid and its
process groups (layout.py), the pipeline schedules and recompute modes mtds runs (choices.py), context
parallelism's shape rules (cp_rules.py), explicit
stage layouts (pipeline_layout.py), ring byte formulas (ring.py) and the data-parallel reduce-scatter
at the ring minimum (dp_reduce.py)."""
