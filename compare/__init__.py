"""PTD-P vs ZeRO-3 harness: run both on this machine (``python -m compare run``) or project them to a GPU
cluster with the planner (``python -m compare project``). ``python -m compare --help`` explains."""
