"""Simulators of the pipeline schedules: discrete-event timing, NCCL issue-order semantics, DeepSpeed's DualPipeV
instruction stream, and the unit-cost theory drawn from them. The runtime (``mtds.pipe``) never imports these."""
