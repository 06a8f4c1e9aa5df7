"""--async-save: the step does not wait for its checkpoint's files.

At the step boundary each rank runs DeepSpeed's save with its checkpoint engine capturing instead of writing:
every file's state is copied to host memory (mtds.checkpoint.snapshot) under the usual staging folder's names.
A background writer then writes those files, fsyncs them and writes the rank's manifest, as the synchronous
save does, while training goes on: on CPU a writer process of the rank (mtds.checkpoint.writer_process; the
snapshot in shared memory), on CUDA a thread of the rank (the snapshot in pinned memory, which a process cannot
share; the copies are non-blocking and the thread waits for them). A save becomes the checkpoint ``--load`` finds only once every
rank's files are durable: at each later step boundary the ranks ask each other in one small all-reduce whether
their writes are done (nobody waits for a write there); once all are, rank 0 commits (meta, marker, rename,
``latest``, prune: mtds.checkpoint.commit). A crash before that leaves the ``.partial`` folder, which nothing
loads, and the previous checkpoint stays the newest complete one.

One save in flight at most, so host memory holds one snapshot per rank: a save asked for while the previous
one is still being written first waits for it (and says how long). The run's last save, and the save a
SIGTERM asks for, complete before the run returns (:meth:`AsyncSaver.finish`).

Why a process on CPU: ``torch.save`` in a thread holds the training thread's GIL for most of the write (a
pure-Python loop beside it ran at 0.2-0.3 of its speed; beside a writer process, at full speed). What a save costs
the step end to end is in docs/benchmarks.md.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mtds.checkpoint.commit import write_manifest
from mtds.checkpoint.snapshot import copies_done_event, nbytes
from mtds.checkpoint import lifecycle


def write_job(files, staging_dir: str, rank: int, rng: dict, save) -> dict:
    """The writer thread's job: each captured file, then the manifest (mtds.checkpoint.writer_process.write_job)."""
    from mtds.checkpoint.writer_process import write_job as write
    return write(files, staging_dir, rank, rng, save, write_manifest)


@dataclass
class _Write:
    step: int
    staging_dir: str
    files: list                       # [(path, host state)]; entries dropped as they are written
    rng: dict
    event: object                     # CUDA event after the host copies (None on CPU)
    started: float
    bytes: int
    done: threading.Event = field(default_factory=threading.Event)
    error: str | None = None
    write_s: float = 0.0
    job: int | None = None            # the writer process's job number (CPU)
    writer: object = None             # ... and that process (a new one may have replaced it since)


class AsyncSaver:
    """One rank's side of --async-save; every rank calls :meth:`save`, :meth:`poll` and :meth:`finish` at the
    same steps (they hold collectives)."""

    def __init__(self, engine, directory: str, groups, device, *, model_cfg=None, tokenizer=None, rng_tracker=None,
                 keep_last: int = 0, log=print):
        self.engine, self.directory, self.groups, self.device = engine, directory, groups, device
        self.model_cfg, self.tokenizer, self.rng_tracker, self.keep_last = model_cfg, tokenizer, rng_tracker, keep_last
        self.log = log
        self.pending: _Write | None = None
        self._thread: threading.Thread | None = None
        self.committed: list[int] = []        # steps committed by this saver, in order
        self.capture_s: list[float] = []      # time the training thread spent per save (snapshot)
        self.waited_s: list[float] = []       # time a save waited for the previous one's write
        self.use_process = device.type == "cpu" and self.writer == "process"
        if self.use_process:
            from mtds.checkpoint.writer_process import writer
            writer()                          # started now: its imports overlap the first steps

    writer = "process"                        # on CPU ("thread": the benchmark's comparison)

    def save(self, step: int, extra: dict) -> None:
        """Snapshot this step's checkpoint and start writing it in the background."""
        if self.pending is not None:
            start = time.perf_counter()
            previous = self.pending.step
            self._join()
            self._settle()
            waited = time.perf_counter() - start
            self.waited_s.append(waited)
            self.log(f"checkpoint: the save of step {step} waited {waited:.2f} s for the save of step {previous} "
                     f"to be written (one save in flight at most)")
        start = time.perf_counter()
        from mtds.checkpoint.snapshot import Packed, to_host
        _, staging_dir, files, rng = lifecycle.capture(self.engine, self.directory, step, extra, self.groups,
                                                       Packed if self.use_process else to_host,
                                                       model_cfg=self.model_cfg, rng_tracker=self.rng_tracker)
        w = self.pending = _Write(step=step, staging_dir=staging_dir, files=files, rng=rng,
                                  event=None if self.use_process else copies_done_event(), started=time.perf_counter(),
                                  bytes=sum(nbytes(state) for _, state in files))
        if self.use_process:
            from mtds.checkpoint.writer_process import writer
            w.writer = writer()
            w.job = w.writer.submit(files, staging_dir, dist.get_rank(), rng)
            w.files = []                      # the writer holds the shared buffers now
        else:
            self._thread = threading.Thread(target=self._write, args=(w,), daemon=True,
                                            name=f"mtds-async-save-{step}")
            self._thread.start()
        self.capture_s.append(time.perf_counter() - start)

    def _write(self, w: _Write) -> None:
        """The writer thread (CUDA)."""
        try:
            if w.event is not None:
                w.event.synchronize()
            write_job(w.files, w.staging_dir, dist.get_rank(), w.rng, lifecycle._durable(self.engine)._inner.save)
        except BaseException as err:     # reported at the next poll, by every rank
            text = str(err).strip()
            w.error = f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"
        finally:
            w.files = []
            w.write_s = time.perf_counter() - w.started
            w.done.set()

    def _finished(self, w: _Write, block: bool) -> bool:
        """Whether this rank's write of ``w`` is over (``block``: wait for it)."""
        if w.done.is_set():
            return True
        if not self.use_process:
            if block and self._thread is not None:
                self._thread.join()
                self._thread = None
            return w.done.is_set()
        answer = w.writer.answer(w.job, block)
        if answer is None:
            return False
        w.error = answer[1]
        w.write_s = time.perf_counter() - w.started
        w.done.set()
        return True

    def _join(self) -> None:
        if self.pending is not None:
            self._finished(self.pending, block=True)
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def poll(self) -> None:
        """At a step boundary: if every rank's write of the save in flight is done, commit it; else return at
        once (one all-reduce of two integers while a save is in flight; nothing otherwise)."""
        if self.pending is None:
            return
        w = self.pending
        done = self._finished(w, block=False)
        flags = torch.tensor([0 if done else 1, 1 if w.error else 0], dtype=torch.int64, device=self.device)
        if dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if int(flags[0]) == 0:
            self._join()
            self._settle(any_failed=bool(flags[1]))

    def _settle(self, any_failed: bool | None = None) -> None:
        """Every rank's write is done (joined or agreed): commit on rank 0, or raise the first failure."""
        w, self.pending = self.pending, None
        problem = w.error
        if any_failed is None or any_failed:
            problem = lifecycle._first_problem(w.error, self.device)
        if problem is not None:
            raise lifecycle.CheckpointError(f"the background save of step {w.step} in {self.directory!r} failed: "
                                            f"{problem}")
        error = [None]
        if dist.get_rank() == 0:
            error[0] = lifecycle.commit_on_rank0(self.engine, self.directory, w.step, self.groups,
                                                 model_cfg=self.model_cfg, tokenizer=self.tokenizer,
                                                 keep_last=self.keep_last)
        if dist.get_world_size() > 1:
            dist.broadcast_object_list(error, src=0)
        if error[0]:
            raise lifecycle.CheckpointError(error[0])
        self.committed.append(w.step)
        self.log(f"checkpoint: {lifecycle.tag_for(w.step)} complete ({w.bytes / 2 ** 20:.1f} MiB on this rank, "
                 f"written in the background in {w.write_s:.2f} s)")

    def finish(self) -> None:
        """Wait for the save in flight and commit it (the run's last save, a SIGTERM's save)."""
        if self.pending is not None:
            self._join()
            self._settle()
