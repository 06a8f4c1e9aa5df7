"""The lab: code that tests, measures or validates mtds but is not what a user runs. Not installed
(``pip install mtds`` ships ``mtds/`` only); the test-suite, ``compare/`` and ``benchmarks/`` import it from the
repository root.

testing/          a pool of live ranks for the suite (restores DeepSpeed's and torch's globals between bodies)
faults/           kill -9 tries during training and saves (``python -m lab.faults``)
pipe_sim/         simulators of the pipeline schedules (discrete events, NCCL semantics, DualPipeV) and theory
plan_check/       the planner's predictions checked against measured runs and held-out published rows
activation_memory.py, heartbeat_load.py   measurement harnesses
"""
