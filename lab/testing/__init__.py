"""Multi-rank test running: :func:`spawn` a body on N ranks, on fresh processes or on a live pool.

- :mod:`lab.testing.ranks` -- the entry point, fresh processes, the pool switch.
- :mod:`lab.testing.pool` -- one live pool of ranks per world size.
- :mod:`mtds.local_ranks.rank_setup` -- what both need to start a rank, join the group and leave.
- :mod:`lab.testing.reset` -- what a pooled rank puts back between bodies.
"""
from lab.testing.ranks import RankFailure, close_pools, device, free_port, needs_ranks, pool_stats, spawn, use_pools

__all__ = ["spawn", "RankFailure", "free_port", "use_pools", "close_pools", "pool_stats", "device", "needs_ranks"]
