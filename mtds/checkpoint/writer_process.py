"""The background writer of --async-save on CPU: a process of its own per training process, so that serialising
and writing a checkpoint never holds the training thread's GIL.

Measured: with the writer a thread of the rank, ``torch.save`` held the GIL for most of the write -- a pure-Python
loop beside it ran at 0.2-0.3 of its speed; beside a writer process, at full speed. A process does not share the
GIL (end-to-end numbers, and where the process loses on a busy 2-core machine: docs/benchmarks.md).

The process (a fresh interpreter running :func:`serve`, not a fork, whose copy-on-write pages would grow with
every weight the trainer updates) is started once per training process and reused by
every run in it. Each captured file is one anonymous shared-memory buffer (``memfd``; mtds.checkpoint.snapshot)
whose descriptor goes over a Unix socket with the job; the writer rebuilds the file's state with each tensor in
its own storage (so the file holds what the synchronous save writes), ``torch.save``s, fsyncs and CRCs it,
writes the rank's manifest, and answers with the files' sizes and CRCs or the error. It ignores SIGINT/SIGTERM
(a signal's save must still be written) and dies with its parent (``PR_SET_PDEATHSIG``), so a killed rank leaves
no writer behind to finish its files later; buffers are freed when both ends let go of them.
"""
from __future__ import annotations

import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys

_HEADER = struct.Struct("QQ")      # payload bytes, descriptors


def _send(sock: socket.socket, obj, fds=()) -> None:
    data = pickle.dumps(obj)
    socket.send_fds(sock, [_HEADER.pack(len(data), len(fds))], list(fds))
    sock.sendall(data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise EOFError("the other end closed the connection")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _recv(sock: socket.socket):
    header, fds, _, _ = socket.recv_fds(sock, _HEADER.size, 4096)
    if not header:
        raise EOFError("the other end closed the connection")
    if len(header) < _HEADER.size:
        header += _recv_exact(sock, _HEADER.size - len(header))
    size, _ = _HEADER.unpack(header)
    return pickle.loads(_recv_exact(sock, size)), fds


def _die_with_parent() -> None:
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)      # PR_SET_PDEATHSIG
    except OSError:         # not Linux: the writer still ends when its socket closes
        pass


def serve(fd: int, parent: int) -> None:
    """The writer process: jobs in, answers out, over the socket ``fd``, until it closes."""
    _die_with_parent()
    if os.getppid() != parent:      # the parent died before the line above took effect
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    import torch
    torch.set_num_threads(1)
    from mtds.checkpoint.commit import write_manifest
    from mtds.checkpoint.snapshot import Packed
    sock = socket.socket(fileno=fd)
    while True:
        try:
            (number, files, staging_dir, rank, rng), fds = _recv(sock)
        except EOFError:
            return
        try:
            for packed, buffer_fd in zip((p for _, p in files), fds):
                packed.attach(buffer_fd)
            written = write_job(files, staging_dir, rank, rng, torch.save, write_manifest, Packed.unpack)
            _send(sock, (number, written, None))
        except BaseException as err:
            text = str(err).strip()
            _send(sock, (number, None, f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"))
        finally:
            for buffer_fd in fds:
                os.close(buffer_fd)
            del files


def write_job(files, staging_dir: str, rank: int, rng: dict, save, write_manifest, materialize=None) -> dict:
    """Write a rank's captured files -- ``materialize`` turns each captured state into what is saved, one file at a
    time -- and its manifest; {name in the folder: (size, CRC-32)}. Entries of ``files`` are dropped as written."""
    from mtds.checkpoint.durable import crc32_of, fsync_file
    staging_abs = os.path.abspath(staging_dir)
    written = {}
    for i, (path, state) in enumerate(files):
        files[i] = (path, None)          # its host copy can go once written
        save(materialize(state) if materialize else state, path)
        del state
        fsync_file(path)
        written[os.path.relpath(os.path.abspath(path), staging_abs)] = (os.path.getsize(path), crc32_of(path))
    write_manifest(staging_dir, rank, written, rng)
    return written


class WriterProcess:
    """The training process's side: start, submit, answer, close."""

    def __init__(self):
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_package_root(),
                                                                           os.environ.get("PYTHONPATH")]))}
        self.process = subprocess.Popen(
            [sys.executable, "-c", f"from mtds.checkpoint.writer_process import serve; serve({theirs.fileno()}, "
                                   f"{os.getpid()})"], pass_fds=(theirs.fileno(),), env=env)
        theirs.close()
        self.sock, self._number, self._answers = mine, 0, {}

    def submit(self, files, staging_dir: str, rank: int, rng: dict) -> int:
        """Hand ``files`` ([(path, Packed)]) to the writer; the job's number."""
        self._number += 1
        _send(self.sock, (self._number, files, staging_dir, rank, rng), [packed.fd for _, packed in files])
        for _, packed in files:
            packed.release()            # the writer holds the buffers now
        return self._number

    def answer(self, number: int, block: bool):
        """(files, error) of job ``number`` once written; None while it runs (``block``: wait). A writer that died
        answers with an error naming how."""
        while number not in self._answers:
            ready, _, _ = select.select([self.sock], [], [], 0.5 if block else 0)
            if ready:
                try:
                    (got, files, error), _ = _recv(self.sock)
                    self._answers[got] = (files, error)
                    continue
                except (EOFError, OSError):
                    pass
            if self.process.poll() is not None:
                code = self.process.returncode
                how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
                return None, f"the checkpoint writer process died ({how})"
            if not block:
                return None
        return self._answers.pop(number)

    def alive(self) -> bool:
        return self.process.poll() is None


def _package_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


_writer: WriterProcess | None = None


def writer() -> WriterProcess:
    """This process's writer, started (again) if there is none alive."""
    global _writer
    if _writer is None or not _writer.alive():
        _writer = WriterProcess()
    return _writer
