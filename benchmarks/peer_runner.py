"""Run a peer framework (Megatron-core, torchtitan) through ``../shared/tools/peers/bench_peer.py``, optionally
profiling one step, without mtds importing anything of the peers: the peer runs in its own interpreter
(``PEERS_PYTHON``), and a short bootstrap (below, passed with ``-c``) adds a profiler around its step.

Where the peers are not installed, :func:`peer_missing` says why and the callers skip them.
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile

# Runs in the peer's interpreter. bench_peer.py calls dist.barrier() once at the start of every step (and
# its ranks call nothing else that barriers), so barrier k starts step k: profile step PROFILE_STEP from
# barrier PROFILE_STEP to barrier PROFILE_STEP + 1 (or the end of the run), on every rank, rank 0 writes.
# It runs as a script file: the spawn start method re-runs a script's top level (not ``-c`` code) in every rank.
_BOOTSTRAP = r"""
import json, os, sys, time
import torch.distributed as dist
sys.path.insert(0, os.path.dirname(os.environ["MTDS_PEER_SCRIPT"]))
import bench_peer
_K, _OUT = int(os.environ.get("MTDS_PROFILE_STEP", "0")), os.environ.get("MTDS_PROFILE_OUT")
_state = {"n": 0, "prof": None}
_barrier, _destroy = dist.barrier, dist.destroy_process_group

def _finish():
    prof = _state.pop("prof"); prof.__exit__(None, None, None)
    if dist.get_rank() == 0:
        import torch
        rows = [{"name": e.key, "total_ms": e.cpu_time_total / 1e3, "self_ms": e.self_cpu_time_total / 1e3,
                 "calls": e.count, "shapes": str(e.input_shapes)[:120]}
                for e in prof.key_averages(group_by_input_shape=True)]
        cpu, wall = time.process_time() - _state["cpu0"], time.perf_counter() - _state["wall0"]
        rows.append({"name": "peer.cpu_over_wall", "total_ms": wall * 1e3, "self_ms": cpu * 1e3, "calls": 1,
                     "shapes": f"torch threads {torch.get_num_threads()}"})
        with open(_OUT, "w") as f:
            json.dump(rows, f)

def _counting_barrier(*a, **k):
    if _state.get("prof") is not None:
        _finish()
    r = _barrier(*a, **k)
    _state["n"] += 1
    if _state["n"] == _K:
        from torch.profiler import ProfilerActivity, profile
        _state["prof"] = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
        _state["prof"].__enter__()
        _state["cpu0"], _state["wall0"] = time.process_time(), time.perf_counter()
    return r

def _destroy_and_finish(*a, **k):
    if _state.get("prof") is not None:
        _finish()
    return _destroy(*a, **k)

if _K:
    dist.barrier, dist.destroy_process_group = _counting_barrier, _destroy_and_finish

if os.environ.get("MTDS_TT_PARAM_DTYPE"):
    # torchtitan's trainer default (TrainingConfig.mixed_precision_param = "bfloat16") makes its FSDP wrap,
    # installed even at degree 1, compute in bf16. The other precision, for the same arithmetic as the other side.
    _shims = bench_peer.torchtitan_cpu_shims
    def _shims_then_dtype():
        _shims()
        import torch
        import torchtitan.models.llama3.parallelize as par
        dtype = getattr(torch, os.environ["MTDS_TT_PARAM_DTYPE"])
        apply = par.apply_fsdp_to_decoder
        def apply_with_dtype(*a, **k):
            k["param_dtype"], k["reduce_dtype"] = dtype, torch.float32
            return apply(*a, **k)
        par.apply_fsdp_to_decoder = apply_with_dtype
        bench_peer.PATCHES.append(f"torchtitan FSDP MixedPrecisionPolicy param_dtype -> {dtype}")
    bench_peer.torchtitan_cpu_shims = _shims_then_dtype

if __name__ == "__main__":
    sys.argv = [os.environ["MTDS_PEER_SCRIPT"]] + json.loads(os.environ["MTDS_PEER_ARGS"])
    bench_peer.main()
"""

# bench_peer.py's shape options (--micro-batch for micro_batch), the fields of benchmarks.workloads.Shape
SHAPE_OPTIONS = ("layers", "hidden", "heads", "vocab", "seq", "micro_batch")


def peers_dir() -> str:
    """Where bench_peer.py lives: ``MTDS_PEERS_DIR``, default ../shared/tools/peers next to the checkout."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return os.environ.get("MTDS_PEERS_DIR", os.path.join(os.path.dirname(here), "shared", "tools", "peers"))


def peers_python() -> str:
    work = os.environ.get("PEERS_WORK", os.path.join(tempfile.gettempdir(), "mtds-peers"))
    return os.environ.get("PEERS_PYTHON", os.path.join(work, "venv", "bin", "python"))


def peer_missing(peer: str) -> str | None:
    """Why ``peer`` cannot run here (None: it can)."""
    script = os.path.join(peers_dir(), "bench_peer.py")
    if not os.path.exists(script):
        return f"{script} not found (set MTDS_PEERS_DIR to the peers' tools folder)"
    return peer_python_missing({"megatron": "megatron.core", "torchtitan": "torchtitan"}[peer])


def peer_python_missing(module: str) -> str | None:
    """Why the peers' interpreter cannot import ``module`` (None: it can); for the benchmarks that run a script
    of their own there (benchmarks/megatron_moe.py), not bench_peer.py."""
    python = peers_python()
    if not os.access(python, os.X_OK):
        return f"no peers' python at {python} (run the peers' setup.sh, or set PEERS_PYTHON / PEERS_WORK)"
    probe = subprocess.run([python, "-c", f"import importlib.util as u, sys; "
                            f"sys.exit(0 if u.find_spec({module.split('.')[0]!r}) else 1)"],
                           capture_output=True, text=True)
    if probe.returncode:
        return f"{module} is not installed in {python}"
    return None


def run_peer(peer: str, model: str, tp: int, pp: int, microbatches: int, steps: int, warmup: int,
             threads: int = 1, profile_step: int | None = None, timeout: float = 900.0,
             tt_param_dtype: str | None = "float32", shape: dict | None = None) -> dict:
    """One bench_peer.py run; its JSON line (tokens_per_s, step_times_s, ...), plus 'profile' rows when
    ``profile_step`` is given, or {'error': ...}. ``tt_param_dtype``: torchtitan's compute dtype (its trainer's
    default is bfloat16 even for fp32 parameters; None keeps that default). ``shape``: any of layers, hidden,
    heads, vocab, seq, micro_batch (``workloads.Shape.as_dict()`` fits); None: bench_peer.py's own shape,
    the peer work of benchmarks/peer_work.py."""
    script = os.path.join(peers_dir(), "bench_peer.py")
    args = ["--peer", peer, "--model", model, "--tp", str(tp), "--steps", str(steps), "--warmup", str(warmup),
            "--threads", str(threads), "--timeout", str(timeout)]
    unknown = set(shape or {}) - set(SHAPE_OPTIONS)
    if unknown:   # bench_peer.py would refuse them only after a start of its interpreter
        raise ValueError(f"run_peer: no bench_peer.py option for {sorted(unknown)}; shape takes {SHAPE_OPTIONS}")
    for name, value in (shape or {}).items():
        args += [f"--{name.replace('_', '-')}", str(value)]
    if peer == "megatron":
        args += ["--pp", str(pp), "--microbatches", str(microbatches)]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONWARNINGS="ignore", MTDS_PEER_SCRIPT=script,
               MTDS_PEER_ARGS=json.dumps(args))
    out = None
    if profile_step is not None:
        out = tempfile.mktemp(prefix="peer_profile_", suffix=".json")
        env.update(MTDS_PROFILE_STEP=str(profile_step), MTDS_PROFILE_OUT=out)
    if peer == "torchtitan" and tt_param_dtype:
        env["MTDS_TT_PARAM_DTYPE"] = tt_param_dtype
    boot = tempfile.mktemp(prefix="peer_boot_", suffix=".py")
    with open(boot, "w") as f:
        f.write(_BOOTSTRAP)
    try:
        p = subprocess.run([peers_python(), boot], env=env, capture_output=True, text=True, timeout=timeout + 60)
    finally:
        os.unlink(boot)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    row = json.loads(lines[-1]) if lines else {"error": f"rc {p.returncode}: {p.stderr[-600:]}"}
    if out is not None and os.path.exists(out):
        with open(out) as f:
            events = json.load(f)
        os.unlink(out)
        events.sort(key=lambda r: r["self_ms"], reverse=True)
        row["profile"] = {"ops": events[:25], "all": events}
    return row
