"""Sampling: DP sharding, layout independence and exact resume.

A window of the synthetic dataset below starts with its own index times
seq_length, so a micro-batch's samples can be read back from its first column.
"""
import numpy as np
import pytest
import torch

from mtds.data import MicroBatchStream
from mtds.data.packed import PackedDataset

S = 4
DATA = PackedDataset(np.arange(S * 37 + 1), S)  # 37 samples: epochs of 32 at B=8 drop 5


def sample_ids(inputs):
    return (inputs[:, 0] // S).tolist()


def take_global_batches(d, steps, *, B=8, b=2, consumed=0, seed=5):
    """Per step, the global batch as the concatenation of ranks 0..d-1 in order."""
    streams = [MicroBatchStream(DATA, global_batch_size=B, micro_batch_size=b, dp_rank=r,
                                dp_size=d, seed=seed, consumed_samples=consumed) for r in range(d)]
    out = []
    for _ in range(steps):
        batch = []
        for st in streams:
            for _ in range(st.micro_batches_per_step):
                batch += sample_ids(next(st)[0])
        out.append(batch)
    return out, streams


def test_inputs_and_labels_are_shifted_windows():
    st = MicroBatchStream(DATA, global_batch_size=8, micro_batch_size=2, seed=1)
    inputs, labels = next(st)
    assert inputs.shape == labels.shape == (2, S) and inputs.dtype == torch.long
    for k, i in enumerate(sample_ids(inputs)):
        assert torch.equal(inputs[k], DATA[i][:-1]) and torch.equal(labels[k], DATA[i][1:])


def test_global_batch_is_the_documented_permutation_slice():
    batches, streams = take_global_batches(d=2, steps=3)
    for k, batch in enumerate(batches):
        assert batch == streams[0].global_batch_indices(k * 8).tolist()
    perm = np.random.default_rng([5, 0]).permutation(len(DATA))
    assert sum(batches, []) == perm[:24].tolist()


def test_dp_shards_are_disjoint_and_cover_each_global_batch():
    d, B = 4, 16
    st = [MicroBatchStream(DATA, global_batch_size=B, micro_batch_size=2, dp_rank=r, dp_size=d,
                           seed=3) for r in range(d)]
    shards = [sum((sample_ids(next(s)[0]) for _ in range(s.micro_batches_per_step)), []) for s in st]
    flat = sum(shards, [])
    assert all(len(x) == B // d for x in shards)
    assert len(set(flat)) == B  # disjoint
    assert flat == st[0].global_batch_indices(0).tolist()  # covering, in order


def test_global_batches_do_not_depend_on_dp_size():
    one, _ = take_global_batches(d=1, steps=10)  # 10 steps cross two epoch boundaries
    two, _ = take_global_batches(d=2, steps=10)
    four, _ = take_global_batches(d=4, steps=10, b=1)
    assert one == two == four
    assert all(len(set(batch)) == 8 for batch in one)


def test_epochs_reshuffle_and_never_repeat_within_an_epoch():
    batches, streams = take_global_batches(d=1, steps=8)
    epoch0, epoch1 = sum(batches[:4], []), sum(batches[4:], [])
    assert len(set(epoch0)) == 32 and len(set(epoch1)) == 32 and epoch0 != epoch1
    assert streams[0].epoch == 2 and streams[0].steps_per_epoch == 4


@pytest.mark.parametrize("d_after", [1, 2, 4])
def test_resume_continues_the_exact_stream(d_after):
    full, _ = take_global_batches(d=2, steps=9)
    _, streams = take_global_batches(d=2, steps=5)
    state = streams[0].state_dict()
    assert state["consumed_samples"] == 5 * 8
    resumed = [MicroBatchStream(DATA, global_batch_size=8, micro_batch_size=1, dp_rank=r,
                                dp_size=d_after, seed=5) for r in range(d_after)]
    for st in resumed:
        st.load_state_dict(state)
    rest = []
    for _ in range(4):
        batch = []
        for st in resumed:
            for _ in range(st.micro_batches_per_step):
                batch += sample_ids(next(st)[0])
        rest.append(batch)
    assert rest == full[5:]


def test_consumed_samples_counts_completed_global_batches():
    st = MicroBatchStream(DATA, global_batch_size=8, micro_batch_size=2, dp_rank=0, dp_size=2)
    assert st.micro_batches_per_step == 2
    next(st)
    assert st.consumed_samples == 0
    next(st)
    assert st.consumed_samples == 8


def test_stages_without_inputs_or_labels_read_nothing():
    class Exploding(PackedDataset):
        def __getitem__(self, i):
            raise AssertionError("a middle stage read data")

    middle = MicroBatchStream(Exploding(DATA.tokens, S), global_batch_size=8, micro_batch_size=2,
                              need_inputs=False, need_labels=False)
    inputs, labels = next(middle)
    assert inputs.shape == labels.shape == (2, S) and not inputs.any() and not labels.any()

    last = MicroBatchStream(DATA, global_batch_size=8, micro_batch_size=2, need_inputs=False)
    first = MicroBatchStream(DATA, global_batch_size=8, micro_batch_size=2, need_labels=False)
    (x_last, y_last), (x_first, y_first) = next(last), next(first)
    assert not x_last.any() and not y_first.any()
    assert torch.equal(y_last[:, :-1], x_first[:, 1:])  # the same samples on both stages
