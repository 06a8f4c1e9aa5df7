"""Deterministic, resumable micro-batches for one data-parallel rank.

The sample order is one endless stream, fixed by the seed alone:

    stream = perm_0[:E] + perm_1[:E] + ...      perm_e = permutation(N) seeded by (seed, e)
                                                E = (N // B) * B   (an epoch drops its ragged tail)

Global batch k is stream[k*B : (k+1)*B]. DP rank r of d takes the contiguous
slice [r*B/d, (r+1)*B/d) of it and cuts it into micro-batches of b, in order.
Hence the samples of a global batch and their order do not depend on d, t or p:
every TP rank and pipeline stage of a DP group gets the same batches, and a run
resumed from `consumed_samples` (the stream position) continues exactly where
an uninterrupted run would have been, even with a different d.
"""
import numpy as np
import torch

from mtds.data.errors import DataError


class MicroBatchStream:
    """Iterator of (input_ids[b, s], labels[b, s]) LongTensors, the format of
    DeepSpeed's `PipelineEngine.train_batch(data_iter)`; labels are the inputs
    shifted by one token.

    Endless: it cycles epochs. `iter(stream)` returns the stream itself, so
    iterating again continues where it stopped. `consumed_samples` advances by
    the global batch size B when this rank hands out the last micro-batch of a
    global batch, i.e. it counts completed global batches.

    Stages that need neither inputs nor labels (middle pipeline stages) read no
    data and get zero tensors of the right shape; when only one of the two is
    needed, the other is a zero tensor too.

    `eod_mask_id` (--eod-mask-loss): labels at positions whose input is that token are -100, the
    ignore index of the loss, as Megatron's loss mask: no loss on guessing a new document's first
    token from the end of the previous one.
    """

    def __init__(self, dataset, *, global_batch_size: int, micro_batch_size: int,
                 dp_rank: int = 0, dp_size: int = 1, seed: int = 1234, consumed_samples: int = 0,
                 need_inputs: bool = True, need_labels: bool = True, shuffle: bool = True,
                 name: str = "training", eod_mask_id=None):
        B, b, d = global_batch_size, micro_batch_size, dp_size
        if min(B, b, d) < 1 or B % d or (B // d) % b:
            raise DataError(f"global batch size {B} must be a multiple of micro batch size {b} "
                            f"x data-parallel size {d}")
        if not 0 <= dp_rank < d:
            raise DataError(f"dp_rank {dp_rank} is outside [0, {d})")
        if len(dataset) < B:
            raise DataError(f"the {name} data has {len(dataset)} samples of seq_length "
                            f"{dataset.seq_length}, fewer than one global batch of {B}; use more "
                            f"data, a smaller train_batch_size in the DeepSpeed config or a shorter --seq-length")
        self.dataset = dataset
        self.global_batch_size, self.micro_batch_size = B, b
        self.dp_rank, self.dp_size = dp_rank, d
        self.seed, self.shuffle = seed, shuffle
        self.eod_mask_id = eod_mask_id
        self.need_inputs, self.need_labels = need_inputs, need_labels
        self.consumed_samples = int(consumed_samples)
        self.samples_per_epoch = (len(dataset) // B) * B
        self.micro_batches_per_step = B // (d * b)  # = gradient accumulation steps
        self._micro = 0  # next micro-batch within the current global batch
        self._perm_cache = {}

    # -- where samples come from -------------------------------------------------------
    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perm_cache:
            n = len(self.dataset)
            perm = (np.random.default_rng([self.seed, epoch]).permutation(n)
                    if self.shuffle else np.arange(n))
            self._perm_cache = {epoch: perm}  # one epoch at a time is enough
        return self._perm_cache[epoch]

    def stream_indices(self, start: int, count: int) -> np.ndarray:
        """Dataset indices at stream positions [start, start + count)."""
        epochs, offsets = np.divmod(np.arange(start, start + count), self.samples_per_epoch)
        out = np.empty(count, dtype=np.int64)
        for epoch in np.unique(epochs):  # a batch spans at most a couple of epochs
            here = epochs == epoch
            out[here] = self._perm(int(epoch))[offsets[here]]
        return out

    def global_batch_indices(self, start: int) -> np.ndarray:
        """The B dataset indices of the global batch beginning at stream position `start`."""
        return self.stream_indices(start, self.global_batch_size)

    def rank_indices(self, start: int) -> np.ndarray:
        """This DP rank's contiguous slice of that global batch."""
        per_rank = self.global_batch_size // self.dp_size
        return self.stream_indices(start + self.dp_rank * per_rank, per_rank)

    @property
    def epoch(self) -> int:
        return self.consumed_samples // self.samples_per_epoch

    @property
    def steps_per_epoch(self) -> int:
        return self.samples_per_epoch // self.global_batch_size

    # -- iteration -----------------------------------------------------------------------
    def __iter__(self):
        return self

    def __next__(self):
        b, s = self.micro_batch_size, self.dataset.seq_length
        if self.need_inputs or self.need_labels:
            per_rank = self.global_batch_size // self.dp_size
            first = self.consumed_samples + self.dp_rank * per_rank + self._micro * b
            ids = self.stream_indices(first, b)
            block = torch.stack([self.dataset[int(i)] for i in ids])
            inputs = block[:, :-1].contiguous() if self.need_inputs else torch.zeros(b, s, dtype=torch.long)
            labels = block[:, 1:].contiguous() if self.need_labels else torch.zeros(b, s, dtype=torch.long)
            if self.need_labels and self.eod_mask_id is not None:
                labels[block[:, :-1] == self.eod_mask_id] = -100
        else:
            inputs = labels = torch.zeros(b, s, dtype=torch.long)
        self._micro += 1
        if self._micro == self.micro_batches_per_step:
            self._micro = 0
            self.consumed_samples += self.global_batch_size
        return inputs, labels

    # -- checkpointing -------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples, "seed": self.seed,
                "num_samples": len(self.dataset), "shuffle": self.shuffle,
                "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: dict, strict: bool = True) -> None:
        """Resume at the saved stream position. d (and even B) may differ; the seed and
        the data must not, or the stream would not be the same one (strict=False skips
        that check)."""
        if strict:
            # A dataset whose first n samples do not depend on its length (indexed blends) may
            # grow: a run resumed with more --steps continues the same order.
            grows = getattr(self.dataset, "grows_by_prefix", False) and not self.shuffle
            for field in ("seed", "shuffle") if grows else ("seed", "num_samples", "shuffle"):
                mine = getattr(self, field) if field != "num_samples" else len(self.dataset)
                if field in state and state[field] != mine:
                    raise DataError(f"checkpoint data state has {field}={state[field]} but this "
                                    f"run has {mine}; resume with the same data and seed")
        self.consumed_samples = int(state["consumed_samples"])
        self._micro = 0
