"""Launch one scheme: its DeepSpeed config with the shared batch written to the output directory, then
``torchrun -m compare.entry`` (train.py's CLI plus a collective counter) as a subprocess."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from mtds.local_ranks.rank_setup import free_port

from .schemes import REPO, Scheme


def effective_config(scheme: Scheme, out_dir: str, global_batch: int | None, micro_batch: int | None) -> str:
    """The scheme's config with the batch every scheme shares (same samples per step, same order)."""
    with open(scheme.config) as f:
        config = json.load(f)
    if global_batch:
        config["train_batch_size"] = global_batch
    if micro_batch:
        config["train_micro_batch_size_per_gpu"] = micro_batch
    config.pop("gradient_accumulation_steps", None)     # derived by mtds from B, b and d
    path = os.path.join(out_dir, "ds_config.json")
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
    return path


def entry_args(scheme: Scheme, *, config: str, model: str, steps: int, seq_length: int, out_dir: str,
               extra: list[str] = ()) -> list[str]:
    """``compare.entry`` and its arguments (probe directory, then train.py's), same for every launcher;
    HF baselines: ``compare.hf_entry`` and its arguments. A scheme with its own model trains that."""
    model = scheme.model_path(model)
    if scheme.hf:
        return ["compare.hf_entry", os.path.join(out_dir, "probe"), "--deepspeed_config", config, "--model", model,
                "--steps", str(steps), "--seq-length", str(seq_length), "--log-jsonl", os.path.join(out_dir, "log.jsonl"),
                *(["--autotp", str(scheme.tp)] if scheme.kind == "autotp" else []), *extra]
    return ["compare.entry", os.path.join(out_dir, "probe"),
            "--deepspeed_config", config, "--tp", str(scheme.tp), "--pp", str(scheme.pp), "--model", model,
            "--steps", str(steps), "--seq-length", str(seq_length), "--log-jsonl", os.path.join(out_dir, "log.jsonl"),
            "--no-progress", "--eval-split", "0", "--lr-decay", "constant",
            *(["--sequence-parallel"] if scheme.sp else []),
            *(["--cp", str(scheme.cp), "--cp-comm-type", scheme.comm] if scheme.cp > 1 else []),
            *(["--zero1-grad-reduce", scheme.grad_reduce] if scheme.grad_reduce != "reduce-scatter" else []),
            *(["--pipeline-schedule", scheme.schedule, "--virtual-stages", str(scheme.v)]
              if scheme.schedule != "1f1b" else []),
            # pipelines: the measured bubble (idle / step time per stage) in every step's log
            *(["--timeline", os.path.join(out_dir, "timeline.json")] if scheme.pp > 1 else []), *extra]


def launch(scheme: Scheme, *, nproc: int, model: str, steps: int, seq_length: int, out_dir: str,
           global_batch: int | None = None, micro_batch: int | None = None, extra: list[str] = (),
           timeout: float = 3600.0) -> dict:
    """Run the scheme to completion; return where its logs are and how long it took."""
    scheme.data_parallel(nproc)
    os.makedirs(out_dir, exist_ok=True)
    config = effective_config(scheme, out_dir, global_batch, micro_batch)
    log = os.path.join(out_dir, "log.jsonl")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(free_port()), "-m",
           *entry_args(scheme, config=config, model=model, steps=steps, seq_length=seq_length, out_dir=out_dir,
                       extra=extra)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    start = time.monotonic()
    with open(os.path.join(out_dir, "stdout.txt"), "w") as out:
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout)
    if proc.returncode != 0:
        with open(os.path.join(out_dir, "stdout.txt")) as f:
            tail = "".join(f.readlines()[-30:])
        raise RuntimeError(f"{scheme.name} failed (exit {proc.returncode}); last output:\n{tail}")
    return {"scheme": scheme, "log": log, "probe_dir": os.path.join(out_dir, "probe"), "config": config,
            "wall_s": time.monotonic() - start, "command": cmd}
