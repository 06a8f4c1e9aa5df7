"""DualPipeV with ``--overlap-moe-expert-parallel-comm``: the process groups and MoE blocks prepared for the
cross-chunk overlap, whose engine (a forward of one phase beside a backward of the other, on two threads) is
mtds.deepspeed_compat.dualpipev_overlap (the design and why threads are there)."""
from __future__ import annotations

import torch.distributed as dist
from torch import nn


def install_cross_chunk_overlap(engine, groups, tracer=None, timeout_s: float = 600.0) -> int:
    """Turn a built ``DualPipeVEngine`` into :class:`OverlappedDualPipeVEngine`: a duplicate of the expert
    group for the all-to-alls' backward (collective: every rank creates every expert group's duplicate, in
    the same order), given to every MoE block's dispatcher, each block told its phase (``comm_chunk``, the
    timeline's chunk of its ``a2a`` spans). ``timeout_s``: the duplicate group's, as the layout's groups
    (--dist-timeout), so a dead peer ends a pair's backward thread with an error, not a hang. Returns the number of
    MoE blocks on this rank."""
    import datetime
    from mtds.model.dispatch import AllToAllDispatcher
    from mtds.model.moe import MoEBlock
    from mtds.deepspeed_compat.dualpipev_overlap import overlap_pairs
    backward_group = None
    for ranks in groups.layout.ep_groups():
        group = dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout_s))
        if groups.rank in ranks:
            backward_group = group
    if tracer is not None:
        tracer.name_group(backward_group, "ep")
    blocks = 0
    for phase, funcs in enumerate(engine.module.phase_funcs):
        for layer in funcs:
            if not isinstance(layer, nn.Module):
                continue
            for block in layer.modules():
                if isinstance(block, MoEBlock) and isinstance(block.dispatcher, AllToAllDispatcher):
                    block.dispatcher.backward_group = backward_group
                    block.comm_chunk = phase
                    blocks += 1
    overlap_pairs(engine)
    return blocks
