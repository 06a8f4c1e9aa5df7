"""Test-side entry to the multi-rank runner (the implementation lives in lab.testing)."""
from lab.testing import RankFailure, free_port, spawn

__all__ = ["spawn", "RankFailure", "free_port"]
