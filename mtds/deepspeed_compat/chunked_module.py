"""A ``PipelineModule`` holding ``v`` model chunks per pipeline rank (interleaved placement, PTD-P §2.2).

The layer list is cut into ``p·v`` virtual stages; rank ``r`` builds virtual stages ``r, r + p, …,
r + (v − 1)p`` as its chunks ``0..v−1``. Layers keep their *global* indices (module names, checkpoint
files ``layer_NN-…``), so a checkpoint does not depend on p, v or the schedule. The tied embedding lives
in virtual stage 0 (rank 0, chunk 0) and in the last virtual stage (rank p − 1, chunk v − 1); DeepSpeed's
tied-weight groups see the owning *ranks*, as with one chunk.

Only one chunk is exposed through ``forward()`` at a time (``activate_chunk``); the engine activates a
chunk around its forward *and* its backward, because recomputation re-runs the active chunk's layers.

It lives in the DeepSpeed boundary because it overrides private methods ``PipelineModule.__init__``
calls (partition, build, recompute bookkeeping); each override marks the module's patch ledger, so a
DeepSpeed that stops calling one is reported instead of building the wrong layers. Checked against
DeepSpeed 0.19.8.
"""
from __future__ import annotations

from deepspeed.pipe import PipelineModule

from mtds.deepspeed_compat.capabilities import check_subclass
from mtds.deepspeed_compat.explicit_parts import ExplicitPartsModule
from mtds.deepspeed_compat.ledger import ledger

OVERRIDES = ("_partition_layers", "_build", "_precompute_checkpointable_values", "stage_owner", "save_state_dict",
             "load_state_dir")


class ChunkedPipelineModule(ExplicitPartsModule):
    """``PipelineModule`` with ``virtual_stages`` chunks per rank (same arguments, plus that one, and
    ``parts`` over the p·v virtual stages: mtds.deepspeed_compat.explicit_parts)."""

    def __init__(self, *args, virtual_stages: int, **kwargs):
        check_subclass(type(self), PipelineModule, overrides=OVERRIDES)
        self.num_chunks = virtual_stages
        book = ledger(self)
        for name in ("_partition_layers", "_build"):
            book.expect(f"PipelineModule.{name}")
        if kwargs.get("activation_checkpoint_interval", 0) > 0:
            book.expect("PipelineModule._precompute_checkpointable_values")   # called by the engine
        super().__init__(*args, **kwargs)

    # DeepSpeed calls these from PipelineModule.__init__, in this order: partition, build, index ties.
    def _partition_layers(self, method="uniform"):
        ledger(self).mark("PipelineModule._partition_layers")
        ranks = self.num_stages
        self.num_stages = ranks * self.num_chunks      # partition over virtual stages
        super()._partition_layers(method)
        self.pipe_ranks = ranks
        stages = [c * ranks + self.stage_id for c in range(self.num_chunks)]
        self.chunk_bounds = [(self.parts[s], self.parts[s + 1]) for s in stages]

    def stage_owner(self, layer_idx):
        """The pipeline *rank* that owns ``layer_idx`` (virtual stage mod p)."""
        return super().stage_owner(layer_idx) % self.pipe_ranks

    def _build(self):
        ledger(self).mark("PipelineModule._build")
        self.chunk_funcs = []
        self.chunk_checkpointable = [[] for _ in range(self.num_chunks)]
        for start, stop in self.chunk_bounds:
            self._set_bounds(start, stop)
            super()._build()
            self.chunk_funcs.append(self.forward_funcs)
            self.forward_funcs = []
        self.activate_chunk(0)

    def activate_chunk(self, chunk: int) -> None:
        self.active_chunk = chunk
        self.forward_funcs = self.chunk_funcs[chunk]
        self.is_checkpointable_results = self.chunk_checkpointable[chunk]
        self._local_start, self._local_stop = self.chunk_bounds[chunk]

    def _precompute_checkpointable_values(self):
        ledger(self).mark("PipelineModule._precompute_checkpointable_values")
        for chunk in range(self.num_chunks):
            self.activate_chunk(chunk)
            self.is_checkpointable_results_interval = None   # the parent caches per interval, not per chunk
            super()._precompute_checkpointable_values()
            self.chunk_checkpointable[chunk] = self.is_checkpointable_results
        self.activate_chunk(0)

    def _each_chunk(self, method, *args, **kwargs):
        active = getattr(self, "active_chunk", 0)
        try:
            for chunk in range(self.num_chunks):
                self.activate_chunk(chunk)
                method(*args, **kwargs)
        finally:
            self.activate_chunk(active)

    def save_state_dict(self, *args, **kwargs):
        self._each_chunk(super().save_state_dict, *args, **kwargs)

    def load_state_dir(self, *args, **kwargs):
        self._each_chunk(super().load_state_dir, *args, **kwargs)
