"""Start-up that never hangs silently.

Two classic hangs before the first step:
  * the rendezvous never completes (a rank not started, a wrong MASTER_ADDR/PORT): torch waits for the
    process-group timeout; we turn its error into one line saying how many ranks joined and what to check;
  * a JIT build of a DeepSpeed op ("compiling and loading fused kernels") waits forever on a ``lock``
    file in TORCH_EXTENSIONS_DIR that a killed build left behind (torch's FileBaton polls until the file
    goes). :class:`BuildLockWatchdog` looks at the start-up thread's stack; once it has sat in that wait
    for ``limit_s`` with nothing in the build's folder changing, it prints the file and the fix and ends
    the process (exit 2): nothing else can wake it. A build another rank is running (its folder changing)
    is waited for, however long.
"""
from __future__ import annotations

import os
import sys
import threading
import time


class RendezvousError(RuntimeError):
    """The process group could not form; one line with the fix."""


def waiting_on_build_lock(thread_id: int) -> str | None:
    """The lock file a thread is blocked on in torch's ``FileBaton.wait`` (the JIT-build lock), else None."""
    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        if frame.f_code.co_name == "wait" and frame.f_code.co_filename.endswith("file_baton.py"):
            return getattr(frame.f_locals.get("self"), "lock_file_path", "lock")
        frame = frame.f_back
    return None


def build_activity(lock_path: str) -> float:
    """Newest modification time under the lock's directory (the extension's build folder: ninja log,
    objects), 0.0 if unreadable. A live build keeps moving it; a lock left by a killed build does not."""
    newest = 0.0
    folder = os.path.dirname(os.path.abspath(lock_path))
    try:
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.name != os.path.basename(lock_path):
                    try:
                        newest = max(newest, entry.stat().st_mtime)
                    except OSError:
                        pass
    except OSError:
        pass
    return newest


def _report_and_exit(message: str) -> None:
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(2)


class BuildLockWatchdog:
    """While active, end the process with one ``error:`` line once the thread that entered it has waited
    ``limit_s`` on a JIT-build lock while nothing in the build's folder changed. A lock nobody waits on
    is harmless and not reported; another rank's build in progress (its folder changing) restarts the
    clock, however long it takes. ``on_stuck(message)`` replaces the default report-and-exit (tests)."""

    def __init__(self, limit_s: float, poll_s: float = 0.5, on_stuck=None):
        self.limit_s, self.poll_s = limit_s, poll_s
        self.on_stuck = on_stuck or _report_and_exit
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def _watch(self, watched: int) -> None:
        since, path, activity = None, None, 0.0
        while not self._done.wait(self.poll_s):
            current = waiting_on_build_lock(watched)
            latest = build_activity(current) if current is not None else 0.0
            if current != path or latest != activity:
                since, path, activity = time.monotonic(), current, latest
            if path is not None and time.monotonic() - since >= self.limit_s and not self._done.is_set():
                self.on_stuck(f"start-up has waited {time.monotonic() - since:.0f} s on the torch-extensions build "
                              f"lock {path} with no build activity in its folder: a JIT build that was killed left "
                              f"it behind; if no other build is running, delete it (rm {path}) and start again")
                return

    def __enter__(self):
        if self.limit_s > 0:
            self._thread = threading.Thread(target=self._watch, args=(threading.get_ident(),), daemon=True,
                                            name="mtds-build-lock-watchdog")
            self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __exit__(self, *exc):
        self.stop()
        return False


def rendezvous_error(err: BaseException, timeout_s: float) -> RendezvousError:
    world = os.environ.get("WORLD_SIZE", "?")
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
    return RendezvousError(f"the {world} ranks did not all join the rendezvous at {where} within {timeout_s:.0f} s "
                           f"({first}): start every rank with the same MASTER_ADDR/MASTER_PORT and WORLD_SIZE, or "
                           f"raise --dist-timeout")
