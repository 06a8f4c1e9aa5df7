"""Packed documents (Megatron's ``--reset-position-ids`` / ``--reset-attention-mask``).

A training sequence is several documents back to back, each ended by the EOD token. With
``reset_position_ids`` positions restart at 0 after every EOD; with ``reset_attention_mask`` a token
attends only to the earlier tokens of its own document. The EOD token belongs to the document it
ends (Megatron: after EOD at i, rows i+1.. lose columns ..i and positions i+1.. restart).

The embedding stage computes one int64 tensor per micro-batch, the *segment ids* [b, s] (how many
EODs precede each token), and passes it on beside the hidden states, through every block and
pipeline stage; positions and the block-diagonal causal mask are derived from it where used.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DocumentMasking:
    eod_token_id: int
    reset_position_ids: bool = False
    reset_attention_mask: bool = False

    @property
    def active(self) -> bool:
        return self.reset_position_ids or self.reset_attention_mask


def enabled(documents: DocumentMasking | None) -> DocumentMasking | None:
    """``documents`` if either reset is on, else None (the model then runs as without it)."""
    return documents if documents is not None and documents.active else None


def beside(micro_batch: int, seq_length: int) -> tuple:
    """The segment ids as a tensor beside the boundary activation, for an engine that sends tensor by tensor
    (mtds.pipe.p2p): (shape, dtype, has a gradient). Last in the tuple: after an MoE model's router statistics
    (mtds.model.router_carry). ``seq_length``: the whole sequence's, also with sequence parallelism; with
    context parallelism this rank's s/c tokens'."""
    return (((micro_batch, seq_length), torch.int64, False),)


def segment_ids(input_ids: torch.Tensor, eod_token_id: int) -> torch.Tensor:
    """[b, s] -> [b, s] int64: the number of EOD tokens strictly before each position."""
    eod = (input_ids == eod_token_id).to(torch.int64)
    return eod.cumsum(dim=1) - eod


def document_positions(segments: torch.Tensor) -> torch.Tensor:
    """[b, s] segment ids -> [b, s] positions counted from each document's first token."""
    s = segments.shape[1]
    index = torch.arange(s, device=segments.device).expand_as(segments)
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    # the latest document start at or before each position
    start = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - start


def document_mask(segments: torch.Tensor) -> torch.Tensor:
    """[b, s] segment ids -> [b, 1, s, s] bool for SDPA (True = may attend): causal, same document."""
    s = segments.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=segments.device).tril()
    return (segments[:, :, None] == segments[:, None, :]).logical_and_(causal)[:, None]
