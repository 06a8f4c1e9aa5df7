"""Launch a peer scheme (Megatron-core, torchtitan) in the peers' own interpreter, on this host or on every
node of an emulated cluster, with the job the mtds schemes run: same model shape, samples, global and
micro batch, fp32, AdamW hyper-parameters, clipping and constant learning rate (from the scheme's DeepSpeed
config), and the same seed for the data order.

The peers are optional and never imported here or by mtds: they run as ``$PEERS_PYTHON -m
torch.distributed.run compare/peer_entry.py JOB.json`` (torchrun's static rendezvous, one launcher per node
inside its namespace, as a scheduler would start them). ``make peers`` installs them into their own venv
(``PEERS_WORK``, default <tmp>/mtds-peers; ``PEERS_PYTHON`` names another interpreter).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from .launch import effective_config
from .schemes import REPO, Scheme

ENTRY = os.path.join(REPO, "compare", "peer_entry.py")
MODULES = {"megatron": "megatron.core", "torchtitan": "torchtitan"}
HOW = "install the peers with `make peers` (their own venv under $PEERS_WORK), or set PEERS_PYTHON"


def peers_python() -> str:
    work = os.environ.get("PEERS_WORK", os.path.join(tempfile.gettempdir(), "mtds-peers"))
    return os.environ.get("PEERS_PYTHON", os.path.join(work, "venv", "bin", "python"))


def peer_missing(kind: str) -> str | None:
    """One line saying why the peer `kind` cannot run here and how to get it; None when it can."""
    python = peers_python()
    if not os.access(python, os.X_OK):
        return f"{kind}: no peers' interpreter at {python}: {HOW}"
    module = MODULES[kind]
    probe = subprocess.run([python, "-c", f"import importlib.util as u, sys; sys.exit(0 if u.find_spec({module.split('.')[0]!r}) else 1)"],
                           capture_output=True, text=True)
    if probe.returncode:
        return f"{kind}: {module} is not installed in {python}: {HOW}"
    return None


def model_fields(model: str) -> dict:
    """The shape the peer builds, read from the same config mtds trains (preset or HF config.json)."""
    from mtds.hf.resolve import resolve_model_config
    cfg = resolve_model_config(model)
    if cfg.architecture not in ("gpt2", "llama") or cfg.num_experts:
        raise ValueError(f"{model}: the peer schemes train GPT-2 and Llama models (dense); this is "
                         f"{cfg.architecture}")
    return {"arch": cfg.architecture, "layers": cfg.num_layers, "hidden": cfg.hidden_size, "heads": cfg.num_heads,
            "kv_heads": cfg.num_kv_heads or cfg.num_heads, "ffn": cfg.ffn_hidden_size, "vocab": cfg.vocab_size,
            "max_positions": cfg.max_position_embeddings, "norm_eps": cfg.norm_eps, "tied": cfg.tie_word_embeddings,
            "rope_theta": cfg.rotary_base, "init_std": cfg.init_std}


def write_tokens(path: str, *, steps: int, seq: int, global_batch: int, micro_batch: int, dp: int,
                 seed: int = 1234) -> None:
    """[d, steps, m, 2, b, s] int64: inputs and labels of every micro-batch data-parallel rank i trains on,
    from mtds.data.MicroBatchStream over the shipped corpus (what train.py and compare.hf_entry read)."""
    import numpy as np

    from mtds.data import MicroBatchStream, build_packed_dataset, load_tokenizer
    dataset = build_packed_dataset(None, load_tokenizer(None), seq, show_progress=False)
    m = global_batch // (micro_batch * dp)
    out = np.zeros((dp, steps, m, 2, micro_batch, seq), dtype=np.int64)
    for i in range(dp):
        stream = MicroBatchStream(dataset, global_batch_size=global_batch, micro_batch_size=micro_batch,
                                  dp_rank=i, dp_size=dp, seed=seed)
        for step in range(steps):
            for j in range(m):
                inputs, labels = next(stream)
                out[i, step, j, 0], out[i, step, j, 1] = inputs.numpy(), labels.numpy()
    np.save(path, out)


def write_job(scheme: Scheme, *, world: int, model: str, steps: int, seq_length: int, out_dir: str,
              global_batch: int | None, micro_batch: int | None) -> tuple[str, str]:
    """JOB.json for compare/peer_entry.py (and its token file); returns (job path, effective config path)."""
    os.makedirs(out_dir, exist_ok=True)
    config = effective_config(scheme, out_dir, global_batch, micro_batch)
    with open(config) as f:
        ds = json.load(f)
    B, b, d = ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], scheme.data_parallel(world)
    if B % (b * d):
        raise ValueError(f"{scheme.name}: global batch {B} is not a multiple of micro batch {b} x data parallel {d}")
    params = ds["optimizer"]["params"]
    tokens = os.path.join(out_dir, "tokens.npy")
    write_tokens(tokens, steps=steps, seq=seq_length, global_batch=B, micro_batch=b, dp=d)
    job = {"peer": scheme.kind, "tp": scheme.tp, "pp": scheme.pp, "dp": d, "seq": seq_length, "micro_batch": b,
           "global_batch": B, "steps": steps, "seed": 1234, "data": tokens, "out": os.path.abspath(out_dir),
           "model": model_fields(scheme.model_path(model)), "distributed_optimizer": scheme.zero_stage == 1 and d > 1,
           "optimizer": {"lr": params["lr"], "betas": params["betas"], "eps": params["eps"],
                         "weight_decay": params["weight_decay"], "clip": ds.get("gradient_clipping", 0.0)}}
    path = os.path.join(out_dir, "job.json")
    with open(path, "w") as f:
        json.dump(job, f, indent=2)
    return path, config


def _finish_log(log: str, job_path: str) -> None:
    """Add tokens/s and TFLOP/s per rank (mtds.observe.metrics, the formulas of every other row) to the
    peer's step log."""
    from mtds.observe.metrics import hardware_flops_per_iteration, model_flops_per_iteration
    with open(job_path) as f:
        job = json.load(f)
    m, B, s = job["model"], job["global_batch"], job["seq"]
    world = job["tp"] * job["pp"] * job["dp"]
    flops_model = model_flops_per_iteration(B, s, m["layers"], m["hidden"], m["vocab"])
    flops_hw = hardware_flops_per_iteration(B, s, m["layers"], m["hidden"], m["vocab"])
    with open(log) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    with open(log, "w") as f:
        for r in rows:
            t = r["step_time_s"]
            r.update(tokens_per_s=B * s / t, tflops_model=flops_model / t / world / 1e12,
                     tflops_hw=flops_hw / t / world / 1e12)
            f.write(json.dumps(r) + "\n")


def _launched(scheme, out_dir, config, job, start, commands) -> dict:
    log = os.path.join(out_dir, "log.jsonl")
    if not os.path.exists(log):
        raise RuntimeError(f"{scheme.name}: the peer wrote no step log (see {out_dir})")
    _finish_log(log, job)
    return {"scheme": scheme, "log": log, "probe_dir": os.path.join(out_dir, "probe"), "config": config,
            "wall_s": time.monotonic() - start, "commands": commands}


def _torchrun(nnodes: int, node_rank: int, nproc: int, master: str, port: int, job: str) -> list[str]:
    return [peers_python(), "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--node_rank", str(node_rank),
            "--nproc_per_node", str(nproc), "--master_addr", master, "--master_port", str(port), ENTRY, job]


def _env(extra: dict | None = None) -> dict:
    # the peers' interpreter must not see mtds's site-packages through PYTHONPATH
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONWARNINGS="ignore", **(extra or {}))
    return env


def launch_peer(scheme: Scheme, *, nproc: int, model: str, steps: int, seq_length: int, out_dir: str,
                global_batch: int | None = None, micro_batch: int | None = None, timeout: float = 3600.0) -> dict:
    """The peer scheme on this host (``nproc`` ranks); same return value as compare.launch.launch."""
    why = peer_missing(scheme.kind)
    if why:
        raise RuntimeError(why)
    job, config = write_job(scheme, world=nproc, model=model, steps=steps, seq_length=seq_length, out_dir=out_dir,
                            global_batch=global_batch, micro_batch=micro_batch)
    from mtds.local_ranks.rank_setup import free_port
    cmd = _torchrun(1, 0, nproc, "127.0.0.1", free_port(), job)
    start = time.monotonic()
    with open(os.path.join(out_dir, "stdout.txt"), "w") as out:
        proc = subprocess.run(cmd, cwd=REPO, env=_env(), stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
    if proc.returncode != 0:
        with open(os.path.join(out_dir, "stdout.txt")) as f:
            tail = "".join(f.readlines()[-30:])
        raise RuntimeError(f"{scheme.name} failed (exit {proc.returncode}); last output:\n{tail}")
    return _launched(scheme, out_dir, config, job, start, [" ".join(cmd)])


def launch_peer_on_cluster(cluster, scheme: Scheme, *, model: str, steps: int, seq_length: int, out_dir: str,
                           global_batch: int | None = None, micro_batch: int | None = None,
                           timeout: float = 3600.0, echo=print) -> dict:
    """The peer scheme on every node of the emulated cluster: torchrun per node inside its namespace, gloo
    on the node's shaped link; each rank reads its node's link counters around every step."""
    from mtds.cluster.cluster import DEVICE
    from mtds.cluster.launch import DEFAULT_PORT
    from mtds.cluster.launch import wait_for_nodes
    why = peer_missing(scheme.kind)
    if why:
        raise RuntimeError(why)
    spec = cluster.spec
    job, config = write_job(scheme, world=spec.world, model=model, steps=steps, seq_length=seq_length,
                            out_dir=out_dir, global_batch=global_batch, micro_batch=micro_batch)
    env = _env({"GLOO_SOCKET_IFNAME": DEVICE, "MTDS_LINK_DEVICE": DEVICE})
    start, procs, commands, logs = time.monotonic(), [], [], []
    for i in range(spec.nodes):
        cmd = _torchrun(spec.nodes, i, spec.ranks_per_node, spec.address(0), DEFAULT_PORT, job)
        commands.append(" ".join(cluster.exec_prefix(i) + cmd))
        if echo:
            echo(f"[cluster] node {i}: {commands[-1]}")
        logs.append(os.path.join(out_dir, f"node{i}.log"))
        with open(logs[-1], "w") as f:
            procs.append(cluster.popen(i, ["env", *[f"{k}={v}" for k, v in env.items() if k.isidentifier()], *cmd],
                                       stdout=f, stderr=subprocess.STDOUT, cwd=REPO))
    wait_for_nodes(procs, timeout)
    bad = [(i, p.poll()) for i, p in enumerate(procs) if p.poll() != 0]
    if bad:
        with open(logs[bad[0][0]], errors="replace") as f:
            tail = "".join(f.readlines()[-25:])
        raise RuntimeError(f"{scheme.name} failed on the cluster: node {bad[0][0]}: exit {bad[0][1]}; last output:\n{tail}")
    return _launched(scheme, out_dir, config, job, start, commands)


if __name__ == "__main__":     # `python -m compare.peer_launch`: is each peer runnable here?
    for kind in MODULES:
        print(peer_missing(kind) or f"{kind}: ready ({peers_python()})")
    sys.exit(0)
