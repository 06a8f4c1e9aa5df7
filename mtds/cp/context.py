"""This rank's place in context parallelism, handed to the modules that see the sequence split.

With ``--context-parallel-size c`` every micro-batch's sequence is cut into 2·c equal chunks and rank i
of a context-parallel group holds chunks i and 2c−1−i (:mod:`mtds.cp.chunks`): under a causal mask the
early chunks attend to little and the late ones to much, and this pairing gives every rank the same
attention work. Three modules act on it: the embedding takes this rank's tokens (and their positions
in the whole sequence), attention exchanges keys and values across the group (:mod:`mtds.cp.ring`,
:mod:`mtds.cp.ulysses`), and the loss takes this rank's labels and weighs its token sum so that the mean
over the d·c gradient replicas is the mean over every token of the sequence.

The data loader is unchanged: the c ranks of a group read the same samples (their data-parallel rank is
the same) and each keeps its part, so nothing of the sequence is sent between ranks but K/V in attention.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mtds.cp.chunks import local_positions


@dataclass(frozen=True)
class ContextParallel:
    group: Any            # the c ranks that split one sequence
    size: int             # c > 1 (without context parallelism modules get None, not this)
    rank: int
    comm_type: str = "p2p"        # mtds.cp.cp_attention's: p2p (ring) | a2a (Ulysses)

    def positions(self, seq_length: int, device=None) -> torch.Tensor:
        """The positions in the whole sequence of the tokens this rank holds, in its order."""
        return local_positions(seq_length, self.size, self.rank, device=device)

    def split(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's part of a whole-sequence tensor (ids, labels, segment ids) along ``dim``."""
        index = self.positions(x.shape[dim], x.device)
        return x.index_select(dim, index)

    def token_count(self, labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
        """Tokens with a target in the whole sequence (all c parts): one small all-reduce, no gradient."""
        count = (labels != ignore_index).sum().reshape(1).to(torch.float32)
        dist.all_reduce(count, group=self.group)
        return count


def context_of(groups, comm_type: str) -> ContextParallel | None:
    """The modules' view of ``groups``' context parallelism, or None when c = 1."""
    c = groups.layout.cp
    return None if c == 1 else ContextParallel(groups.cp_group, c, groups.cp_rank, comm_type)
