"""--async-save on 2 gloo ranks: saving every step in the background leaves training bit for bit unchanged and
resumes exactly (with the writer process, each write held back past the next step's update; and with the writer
thread the CUDA path uses); a save is not visible before every rank's files are durable (rank 1's writer process
frozen with SIGSTOP); kill -9 of a rank's writer during a write stops the run with one line and the previous save
resumes exactly. (kill -9 of a rank during a background write: tests/test_recovery.py.)"""
import os
import signal

import pytest

from mtds.checkpoint.complete import STAGING_SUFFIX, check_complete, rank_manifest
from lab.testing import spawn
from tests.training_helpers import TINY, ds_config, train_config

DROPOUT = TINY.__class__(**{**TINY.__dict__, "hidden_dropout": 0.1, "attention_dropout": 0.1, "num_layers": 2})
FROZEN_SAVE, RELEASE_AT, KILLED_SAVE = 2, 4, 3


def _visible(directory, step):
    try:
        check_complete(os.path.join(directory, f"global_step{step}"))
        return True
    except Exception:       # absent or incomplete
        return False


class _around_saves:
    """Wraps AsyncSaver.save / poll in this process: ``after_save(saver, step)`` once a save is handed to the
    writer, ``before_poll(saver)`` at each step boundary before the poll."""

    def __init__(self, after_save=None, before_poll=None):
        self.after_save, self.before_poll = after_save, before_poll

    def __enter__(self):
        from mtds.checkpoint.async_save import AsyncSaver
        self.save, self.poll = AsyncSaver.save, AsyncSaver.poll
        outer = self

        def save(saver, step, extra):
            outer.save(saver, step, extra)
            if outer.after_save:
                outer.after_save(saver, step)

        def poll(saver):
            if outer.before_poll:
                outer.before_poll(saver)
            return outer.poll(saver)
        AsyncSaver.save, AsyncSaver.poll = save, poll

    def __exit__(self, *exc):
        from mtds.checkpoint.async_save import AsyncSaver
        AsyncSaver.save, AsyncSaver.poll = self.save, self.poll


def _writer_pid():
    from mtds.checkpoint.writer_process import writer
    return writer().process.pid


def _worker(root):
    import torch.distributed as dist

    from mtds.checkpoint.async_save import AsyncSaver
    from mtds.checkpoint.lifecycle import CheckpointError
    from mtds.training import run
    rank = dist.get_rank()
    dense = dict(model=DROPOUT, steps=4, deepspeed_config=ds_config(zero=1))     # d = 2: ZeRO-1 partitions
    plain = run(train_config(**dense))
    # each write but the last waits (its writer stopped) until the next step boundary, after that step's update
    with _around_saves(after_save=lambda saver, step: step < 4 and os.kill(_writer_pid(), signal.SIGSTOP),
                       before_poll=lambda saver: os.kill(_writer_pid(), signal.SIGCONT)):
        every = run(train_config(**dense, save=f"{root}/every", save_interval=1, async_save=True))
    resumed = run(train_config(**dense, load=f"{root}/every/global_step2"))
    AsyncSaver.writer = "thread"
    try:
        threaded = run(train_config(**dense, save=f"{root}/thread", save_interval=1, async_save=True))
    finally:
        AsyncSaver.writer = "process"
    # rank 1's writer frozen from the save of step 2 until the boundary of step 3 has been looked at
    seen, boundaries = [], [0]
    frozen = f"{root}/frozen/global_step{FROZEN_SAVE}{STAGING_SUFFIX}"

    def after_save(saver, step):
        if rank == 1 and step == FROZEN_SAVE:
            os.kill(_writer_pid(), signal.SIGSTOP)

    def before_poll(saver):
        boundaries[0] += 1
        if boundaries[0] == FROZEN_SAVE + 1 and rank == 0:
            saver._finished(saver.pending, block=True)      # rank 0's own write is done (a local wait)
            seen.append((os.path.isfile(rank_manifest(frozen, 0)), _visible(f"{root}/frozen", FROZEN_SAVE)))
        if boundaries[0] == RELEASE_AT and rank == 1:
            os.kill(_writer_pid(), signal.SIGCONT)
    with _around_saves(after_save, before_poll):
        pipe = run(train_config(model=DROPOUT, pp=2, steps=5, save=f"{root}/frozen", save_interval=FROZEN_SAVE,
                                async_save=True))
    # kill -9 of rank 1's writer during the write of step 3's save
    with _around_saves(after_save=lambda saver, step: rank == 1 and step == KILLED_SAVE and os.kill(
            _writer_pid(), signal.SIGKILL)):
        try:
            run(train_config(**dense, save=f"{root}/killed", save_interval=1, async_save=True))
            killed = None
        except CheckpointError as err:
            killed = str(err)
    after_kill = run(train_config(**dense, load=f"{root}/killed"))
    return plain, every, resumed, threaded, seen, pipe, killed, after_kill


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("async"))
    return root, spawn(_worker, 2, root, timeout=300)


def test_saving_every_step_in_the_background_changes_nothing_and_resumes_exactly(runs):
    root, results = runs
    for plain, every, resumed, threaded, *_ in results:
        assert every.losses == plain.losses and every.grad_norms == plain.grad_norms
        assert threaded.losses == plain.losses and threaded.grad_norms == plain.grad_norms
        assert resumed.losses == plain.losses[2:] and resumed.grad_norms == plain.grad_norms[2:]
    for name in ("every", "thread"):
        assert all(_visible(f"{root}/{name}", s) for s in range(1, 5))      # the last save completed before exit


def test_a_save_is_not_visible_before_every_rank_has_written_it(runs):
    root, results = runs
    # the boundary of step 3: rank 0's files and manifest are durable, rank 1's writer is frozen -> not visible
    assert results[0][4] == [(True, False)], results[0][4]
    assert all(_visible(f"{root}/frozen", s) for s in (FROZEN_SAVE, 4, 5))


def test_a_killed_writer_stops_the_run_and_the_previous_save_resumes_exactly(runs):
    root, results = runs
    for plain, *_, killed, after_kill in results:
        assert killed is not None and f"the background save of step {KILLED_SAVE}" in killed, killed
        assert "rank 1" in killed or "died (killed by SIGKILL)" in killed, killed
        assert after_kill.losses == plain.losses[KILLED_SAVE - 1:], (after_kill.losses, plain.losses)
    assert not _visible(f"{root}/killed", KILLED_SAVE)
