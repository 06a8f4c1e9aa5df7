"""Fault injection with real processes: kill -9 one rank of a real launch (while it trains, or while it
saves), then check what the issue promises -- the launch ends within a bound, the launcher names the dead
rank, every visible checkpoint is complete, and a restart resumes from the newest complete one.

    python -m lab.faults --tries 10            # prints the counts; exit 1 if any try broke a promise
"""
from lab.faults.harness import FaultResult, run_try

__all__ = ["FaultResult", "run_try"]
