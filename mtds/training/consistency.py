"""Check that copies which must stay equal are equal: TP-replicated parameters (norms, row-parallel
biases, position embeddings) across the TP group, and the tied embedding on first and last stage."""
from __future__ import annotations

import torch
import torch.distributed as dist

from mtds.parallel.layout import ParallelGroups


class ReplicaMismatch(RuntimeError):
    """Copies of a parameter diverged; training is no longer equivalent to a single-process run."""


def _max_diff_across(tensor: torch.Tensor, group) -> float:
    reference = tensor.detach().clone()
    dist.broadcast(reference, src=dist.get_global_rank(group, 0), group=group)
    diff = (tensor.detach() - reference).abs().max().reshape(1)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX, group=group)
    return diff.item()


def replica_differences(module, groups: ParallelGroups) -> dict[str, float]:
    """Max |difference| of every replicated parameter against its first copy (collective)."""
    diffs: dict[str, float] = {}
    if groups.layout.tp > 1:
        for name, p in module.named_parameters():
            if not getattr(p, "tensor_model_parallel", False):
                diffs[f"tp:{name}"] = _max_diff_across(p, groups.tp_group)
    for key, comm in getattr(module, "tied_comms", {}).items():
        if len(comm["ranks"]) > 1 and dist.get_rank() in comm["ranks"]:
            for attr in comm["weight_attr"]:
                weight = module.tied_modules[key].get_parameter(attr)
                diffs[f"tied:{key}.{attr}"] = _max_diff_across(weight, comm["group"])
    return diffs


def check_replicas(module, groups: ParallelGroups, atol: float = 0.0) -> None:
    bad = {name: d for name, d in replica_differences(module, groups).items() if d > atol}
    if bad:
        name, diff = max(bad.items(), key=lambda kv: kv[1])
        raise ReplicaMismatch(f"{len(bad)} replicated parameter(s) diverged, worst {name} by {diff:.3g}")
