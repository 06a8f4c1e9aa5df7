"""Start and stop torch.distributed the way DeepSpeed expects, on CUDA (NCCL) or CPU (gloo)."""
from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist


def device_and_backend() -> tuple[torch.device, str]:
    """CUDA + NCCL where a GPU is visible, else CPU + gloo (never hard-coded). One GPU per local rank: a
    local rank without its own GPU is a layout error with the fix (NCCL refuses two ranks on one GPU, and
    ``set_device`` past the last GPU fails as "invalid device ordinal", which read like a rendezvous timeout)."""
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        have = torch.cuda.device_count()
        if local_rank >= have:
            from mtds.parallel.layout import LayoutError
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            raise LayoutError(
                f"local rank {local_rank} has no GPU of its own: {have} GPU(s) visible on this node"
                f"{f' (CUDA_VISIBLE_DEVICES={visible})' if visible is not None else ''}; start at most {have} "
                f"rank(s) per node (deepspeed --num_gpus {have}, torchrun --nproc_per_node {have}), or hide the "
                f"GPUs (CUDA_VISIBLE_DEVICES=) to run every rank on CPU with gloo")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cpu"), "gloo"


def group_device() -> torch.device:
    """The device the default group's collectives take: this rank's GPU under NCCL, else the host."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_distributed(timeout_s: float = 600.0) -> tuple[torch.device, str]:
    """Initialise (or reuse) the default process group through DeepSpeed, with a finite timeout.

    A single process started without a launcher becomes a world of one (MASTER_* defaults).
    """
    import deepspeed
    # DeepSpeed JIT-builds a shared-memory op (~40 s) at init that only inference all-reduce uses.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    device, backend = device_and_backend()
    if not dist.is_initialized():
        for key, default in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                             ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29517")):
            os.environ.setdefault(key, default)
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            _init_on_attempt_store(backend, timeout_s)
    deepspeed.init_distributed(dist_backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
    if backend == "gloo":
        # Ranks share the cores: one BLAS thread each unless the user said otherwise.
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    return device, backend


def _init_on_attempt_store(backend: str, timeout_s: float) -> None:
    """The default process group on torchrun's store, under this restart's own prefix. torchrun's static
    rendezvous (``--master-port``) keeps one store for all restarts and hands it to the workers unprefixed:
    a restarted group found the gloo addresses of the dead attempt's processes there and every rank failed
    with "connectFullMesh … Connection refused" (mtds.safety.store)."""
    from mtds.safety.store import rendezvous_store
    store = rendezvous_store(timeout_s)
    dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]), timeout=datetime.timedelta(seconds=timeout_s))


class CommandLineError(ValueError):
    """Bad input found in the command line alone, before any process group exists: every rank finds it, so
    only the first rank reports it (:func:`report_error`)."""


ERROR_GRACE_S = 10.0        # how long another rank waits for the first rank's line (report_error)
_REPORTED = "mtds/error-reported"


def _first_rank(same_on_every_rank: bool) -> bool:
    if dist.is_initialized():
        return dist.get_rank() == 0
    # before the process group: the launcher's RANK (torchrun, deepspeed); an error of one rank's own, though,
    # (its GPU, its rendezvous) is said by that rank
    return (not same_on_every_rank or os.environ.get("RANK", "0") == "0"
            or int(os.environ.get("WORLD_SIZE", "1")) <= 1)


def report_error(message: str, *, same_on_every_rank: bool = True) -> None:
    """The one ``error: message`` line, from the first rank. Under torchrun it also goes into the error file
    torchrun's failure report reads (``TORCHELASTIC_ERROR_FILE``): the report's root cause then names it,
    instead of a link about how to record tracebacks.

    A launcher ends every rank as soon as one exits, so another rank must not exit before the first has said
    it: it waits up to ``ERROR_GRACE_S`` (with a process group: for the first rank's word in the rendezvous
    store; before one: the time itself, which the launcher cuts short once the first rank is done), and says
    it itself where no word came (an error only it found)."""
    line = f"error: {message}"
    if not _first_rank(same_on_every_rank) and _first_rank_said_it():
        return
    _say(line)
    if dist.is_initialized() and dist.get_world_size() > 1 and dist.get_rank() == 0:
        try:
            from mtds.safety.store import rendezvous_store
            rendezvous_store(5.0).set(_REPORTED, "1")
        except Exception:       # the store is gone: so are the others
            pass


def _first_rank_said_it() -> bool:
    """Wait (up to ERROR_GRACE_S) for the first rank's line; True when it said it or is gone."""
    if not dist.is_initialized():
        import time
        time.sleep(ERROR_GRACE_S)       # a launcher kills this rank first, once the first rank has exited
        return False
    from mtds.safety.store import rendezvous_store
    try:
        store = rendezvous_store(ERROR_GRACE_S)
    except Exception:       # nobody serves the store any more: the first rank (its host) has exited
        return True
    try:
        store.wait([_REPORTED])
        return True
    except Exception:       # timed out: an error only this rank found
        return False


def run_and_exit(work, user_errors, debug: bool = False) -> None:
    """Console-script body shared by train.py and mtds-eval: run ``work()``; bad input (``user_errors``: a tuple
    of exception types, or a function returning one, called only when something was raised) is one ``error:``
    line (:func:`report_error`) and exit 2 on every rank, a bug a traceback and exit 1; then :func:`shutdown`."""
    code = 0
    try:
        work()
    except CommandLineError as err:     # before anything imports the modules user_errors() names
        code = _bad_input(err, debug)
    except Exception as err:
        from mtds.safety.restarts import peer_lost
        if peer_lost(err) and not debug:
            code = _lost_a_peer(err)
        elif not isinstance(err, user_errors() if callable(user_errors) else user_errors):
            import traceback
            traceback.print_exc()
            code = 1
        else:
            code = _bad_input(err, debug)
    shutdown(code)


def _lost_a_peer(err: Exception) -> int:
    """Another rank died (kill -9, a crash): this rank's collective failed. One line, from this rank (each
    survivor says it: the peer that died says nothing), into torchrun's error file too; exit 1 at once, so the
    launcher can restart the group."""
    from mtds.safety.restarts import PEER_LOST, restart_note
    rank = dist.get_rank() if dist.is_initialized() else os.environ.get("RANK", "?")
    cause = next(marker for marker in PEER_LOST if marker in str(err))
    _say(f"error: rank {rank} lost a peer rank in a collective ({type(err).__name__}: {cause}): it died or was "
         f"killed (the launcher's report names it); {restart_note()}")
    return 1


def _say(line: str) -> None:
    """``line`` to stderr and into torchrun's error file (its report's root cause then shows it)."""
    print(line, file=sys.stderr, flush=True)
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        import json
        import time
        # torchrun's own format (torch.distributed.elastic ErrorHandler.record_exception): the report shows
        # py_callstack as the failure's "traceback"
        data = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
        try:
            with open(path, "w") as f:
                json.dump(data, f)
        except OSError:
            pass


def _bad_input(err: Exception, debug: bool) -> int:
    if debug:
        import traceback
        traceback.print_exc()
    text = str(err).strip()
    report_error(text.splitlines()[0] if text else type(err).__name__,     # the rulebook's refusals are too
                 same_on_every_rank=isinstance(err, CommandLineError) or getattr(err, "same_on_every_rank", False))
    return 2


def shutdown(exit_code: int) -> None:
    """Leave cleanly: barrier, destroy the group, flush, ``os._exit``.

    gloo ranks otherwise abort at interpreter exit now and then ("terminate called without an
    active exception"), turning a good run into a failed one.
    """
    try:
        if dist.is_initialized():
            if exit_code == 0:
                dist.barrier()
            dist.destroy_process_group()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)


def configure_matmul_precision(device: torch.device, precision: str) -> bool:
    """fp32 runs on CUDA use TF32 tensor cores for matmuls and convolutions (as Megatron-core and
    torchtitan do): ~494 instead of ~67 TFLOP/s on an H100, with a 10-bit mantissa for the products and
    fp32 accumulation. True where enabled (the run's header line says so)."""
    if device.type != "cuda" or precision != "fp32":
        return False
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    return True


def peak_memory_gib(device: torch.device) -> tuple[float, float | None]:
    """(peak allocated, peak reserved) GiB: the CUDA caching allocator's peaks on GPU (reserved is what
    the process holds from the device, allocated what tensors use), peak RSS of the process on CPU (no
    reserved figure)."""
    if device.type == "cuda":
        return (torch.cuda.max_memory_allocated(device) / 2 ** 30, torch.cuda.max_memory_reserved(device) / 2 ** 30)
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20, None     # KiB on Linux
