"""``PipelineModule`` cut where mtds says: explicit stage boundaries (``parts``) instead of one of
DeepSpeed's partition methods (uniform, parameters, ``type:``), which cannot express a pipeline layout.

``parts`` is DeepSpeed's own representation: stage k builds layer specs ``parts[k]:parts[k + 1]``, so
everything downstream (``stage_owner``, tied-weight groups, layer checkpoint files named by global index)
works unchanged. DeepSpeed has no public option for it, so the private ``_partition_layers`` that
``PipelineModule.__init__`` calls is overridden (capability "cut pipeline stages at explicit
boundaries"); the override marks the module's patch ledger, so a DeepSpeed that stops calling it is
reported instead of silently building its own partition.

``ChunkedPipelineModule`` (interleaved, zb-h1) derives from :class:`ExplicitPartsModule`;
:class:`ExplicitPartsDualPipeV` places it under DeepSpeed's ``DualPipeVModule``, whose
``_partition_layers`` doubles the stage count and then calls this one through ``super()``.
Checked against DeepSpeed 0.19.8.
"""
from __future__ import annotations

from deepspeed.pipe import PipelineModule
from deepspeed.runtime.pipe.dualpipev import DualPipeVModule

from mtds.deepspeed_compat.capabilities import check_subclass
from mtds.deepspeed_compat.ledger import ledger

PATCH = "PipelineModule._partition_layers (explicit parts)"


class ExplicitPartsModule(PipelineModule):
    """``PipelineModule`` plus ``parts``: None keeps ``partition_method``; a list of p·v + 1 spec
    boundaries (p·v: the virtual stages the subclass partitions over) cuts exactly there."""

    def __init__(self, *args, parts: list[int] | None = None, **kwargs):
        check_subclass(ExplicitPartsModule, PipelineModule, overrides=("_partition_layers",))
        self.explicit_parts = None if parts is None else [int(x) for x in parts]
        if parts is not None:
            ledger(self).expect(PATCH)
        super().__init__(*args, **kwargs)

    def _partition_layers(self, method="uniform"):
        if self.explicit_parts is None:
            return super()._partition_layers(method)
        ledger(self).mark(PATCH)
        parts = self.explicit_parts
        if len(parts) != self.num_stages + 1 or parts[0] != 0 or parts[-1] != len(self._layer_specs) or \
                any(b < a for a, b in zip(parts, parts[1:])):
            raise ValueError(f"pipeline parts {parts} do not cut {len(self._layer_specs)} layers into "
                             f"{self.num_stages} stages")
        self.parts = list(parts)
        self._set_bounds(start=parts[self.stage_id], stop=parts[self.stage_id + 1])


class ExplicitPartsDualPipeV(DualPipeVModule, ExplicitPartsModule):
    """DeepSpeed's ``DualPipeVModule`` with ``parts`` over its 2p stages (rank r: stages r and 2p-1-r)."""


__all__ = ["ExplicitPartsDualPipeV", "ExplicitPartsModule"]
