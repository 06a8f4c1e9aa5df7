"""A ``PipelineModule`` holding ``v`` model chunks per pipeline rank (interleaved placement, PTD-P §2.2).

The layer list is cut into ``p·v`` virtual stages; rank ``r`` builds virtual stages ``r, r + p, …,
r + (v − 1)p`` as its chunks ``0..v−1``. Layers keep their *global* indices (module names, checkpoint
files ``layer_NN-…``), so a checkpoint does not depend on p, v or the schedule. The tied embedding lives
in virtual stage 0 (rank 0, chunk 0) and in the last virtual stage (rank p − 1, chunk v − 1); DeepSpeed's
tied-weight groups see the owning *ranks*, as with one chunk.

Only one chunk is exposed through ``forward()`` at a time (``activate_chunk``); the engine activates a
chunk around its forward *and* its backward, because recomputation re-runs the active chunk's layers.
"""
from __future__ import annotations

from deepspeed.pipe import PipelineModule


class ChunkedPipelineModule(PipelineModule):
    """``PipelineModule`` with ``virtual_stages`` chunks per rank (same arguments, plus that one)."""

    def __init__(self, *args, virtual_stages: int, **kwargs):
        self.num_chunks = virtual_stages
        super().__init__(*args, **kwargs)

    # DeepSpeed calls these from PipelineModule.__init__, in this order: partition, build, index ties.
    def _partition_layers(self, method="uniform"):
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
