"""--async-save on 2 gloo ranks: saving every step in the background leaves training bit for bit unchanged and
resumes exactly; a save is not visible before every rank's files are durable (one rank's writer frozen);
a save asked for while one is in flight waits for it. (kill -9 during a background write:
tests/test_recovery.py.)"""
import os
import threading

import pytest

from mtds.checkpoint.complete import STAGING_SUFFIX, check_complete, rank_manifest
from lab.testing import spawn
from tests.training_helpers import TINY, ds_config, train_config

DROPOUT = TINY.__class__(**{**TINY.__dict__, "hidden_dropout": 0.1, "attention_dropout": 0.1, "num_layers": 2})
FROZEN_SAVE, RELEASE_AT = 2, 4


def _visible(directory, step):
    try:
        check_complete(os.path.join(directory, f"global_step{step}"))
        return True
    except Exception:       # absent or incomplete
        return False


class _slow_writer:
    def __init__(self, delay_s):
        self.delay_s = delay_s

    def __enter__(self):
        import time

        from mtds.checkpoint import async_save
        self.original = original = async_save.write_file

        def write_file(save, state, path):
            time.sleep(self.delay_s)
            return original(save, state, path)
        async_save.write_file = write_file

    def __exit__(self, *exc):
        from mtds.checkpoint import async_save
        async_save.write_file = self.original


def _freeze_rank1_writer(root, seen):
    """Rank 1's background write of step FROZEN_SAVE waits until rank 1 starts step RELEASE_AT; rank 0 records,
    at each step boundary, whether its own files are durable and whether the checkpoint is visible."""
    import torch.distributed as dist

    from mtds.checkpoint import async_save
    rank, release = dist.get_rank(), threading.Event()
    original_write, original_poll = async_save.write_file, async_save.AsyncSaver.poll

    def write_file(save, state, path):
        if rank == 1 and f"global_step{FROZEN_SAVE}{STAGING_SUFFIX}" in path:
            release.wait(120)
        return original_write(save, state, path)

    def poll(self):
        staging = os.path.join(root, f"global_step{FROZEN_SAVE}{STAGING_SUFFIX}")
        seen.append((os.path.isfile(rank_manifest(staging, 0)), _visible(root, FROZEN_SAVE)))
        return original_poll(self)

    async_save.write_file, async_save.AsyncSaver.poll = write_file, poll

    def releaser(engine, groups):
        def at_step(module, args):
            if engine.global_steps == RELEASE_AT - 1:
                release.set()
        engine.module.register_forward_pre_hook(at_step)
    return releaser, lambda: setattr(async_save, "write_file", original_write) or setattr(
        async_save.AsyncSaver, "poll", original_poll)


def _worker(root):
    from mtds.training import run
    dense = dict(model=DROPOUT, steps=4, deepspeed_config=ds_config(zero=1))     # d = 2: ZeRO-1 partitions
    plain = run(train_config(**dense))
    # each background write starts 0.2 s late, after the next step's update: a snapshot that shared the live
    # tensors would save that step's weights
    with _slow_writer(0.2):
        every = run(train_config(**dense, save=f"{root}/every", save_interval=1, async_save=True))
    resumed = run(train_config(**dense, load=f"{root}/every/global_step2"))
    seen: list = []
    releaser, restore = _freeze_rank1_writer(f"{root}/frozen", seen)
    try:
        pipe = run(train_config(model=DROPOUT, pp=2, steps=5, save=f"{root}/frozen", save_interval=FROZEN_SAVE,
                                async_save=True), on_engine_ready=(releaser,))
    finally:
        restore()
    return plain, every, resumed, seen, pipe


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("async"))
    return root, spawn(_worker, 2, root, timeout=300)


def test_saving_every_step_in_the_background_changes_nothing_and_resumes_exactly(runs):
    root, results = runs
    for plain, every, resumed, *_ in results:
        assert every.losses == plain.losses and every.grad_norms == plain.grad_norms
        assert resumed.losses == plain.losses[2:] and resumed.grad_norms == plain.grad_norms[2:]
    assert all(_visible(f"{root}/every", s) for s in range(1, 5))      # the last save completed before exit


def test_a_save_is_not_visible_before_every_rank_has_written_it(runs):
    root, results = runs
    seen = results[0][3]                 # rank 0's view at the boundaries of steps 1..5
    # step 3's boundary: rank 0's files and manifest are durable, rank 1's writer is frozen -> not visible
    assert seen[FROZEN_SAVE] == (True, False), seen
    assert _visible(f"{root}/frozen", FROZEN_SAVE) and _visible(f"{root}/frozen", 4) and _visible(f"{root}/frozen", 5)
