"""Context parallelism on CPU ranks: tokens/s of train.py at long sequences for C in {1, 2, 4}, ring (p2p)
against Ulysses (a2a), beside the bytes each rank sends per step by the formulas of docs/long_context.md.

    python benchmarks/bench_cp.py [--seq 4096 8192 16384] [--cp 1 2 4] [--steps 4] [--out docs/benchmarks_cp.md]

One launch of train.py (torch.distributed.run, C ranks, t = p = d = 1) per (seq, C, comm type), all cases of
one sequence length back to back, so that they share the machine's state; a Llama-style model (RoPE, RMSNorm,
SwiGLU, 8 query / 4 KV heads, hidden --hidden, --layers blocks), one sequence per step, fp32, dropout 0.
Tokens/s: the median over steps 2..N of the step log's ``tokens_per_s`` (step 1 is warm-up). On a machine
with fewer cores than ranks the C = 4 runs share cores: read the table for the communication volumes and the
a2a/p2p comparison at equal C, not for a speed-up over C = 1.

Bytes a rank sends per step, forward + backward, per layer and micro-batch of b sequences, e = head dim,
w = bytes per value (4 in fp32); the formulas tests/test_context_parallel.py holds the tracer to:
    p2p: 2 * b * (s/C) * h_kv * e * (2 (C - 1) w + 4 C)      (K/V hops both ways, C hops of fp32 dK/dV)
    a2a: 2 * (C - 1)/C * 2 * b * (s/C) * (h_q + h_kv) * e * w  (four all-to-alls each way)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)      # lab/ (free_port) when run as a script
HEADS, KV_HEADS = 8, 4


def write_model(path: str, seq: int, hidden: int, layers: int) -> str:
    """A Llama-style model with room for ``seq`` positions, as a HF config.json (what --model reads)."""
    from mtds.hf import hf_config_from_model_config
    from mtds.model.config import ModelConfig
    cfg = ModelConfig(vocab_size=8192, hidden_size=hidden, num_layers=layers, num_heads=HEADS, num_kv_heads=KV_HEADS,
                      ffn_hidden_size=2 * hidden, max_position_embeddings=seq, position_embedding="rotary",
                      normalization="rmsnorm", activation="swiglu", qkv_bias=False, linear_bias=False,
                      architecture="llama", tie_word_embeddings=False)
    hf_config_from_model_config(cfg).save_pretrained(path)
    return path


def write_ds_config(path: str) -> str:
    with open(os.path.join(REPO, "ds_configs", "cpu_fp32.json")) as f:
        config = json.load(f)
    config.update(train_batch_size=1, train_micro_batch_size_per_gpu=1)
    config.pop("gradient_accumulation_steps", None)
    with open(path, "w") as f:
        json.dump(config, f, indent=2)
    return path


def bytes_per_step(comm: str, c: int, seq: int, hidden: int, layers: int, b: int = 1, w: int = 4) -> float:
    """The formulas of the module docstring, all layers."""
    if c == 1:
        return 0.0
    e, sl = hidden // HEADS, seq / c
    if comm == "p2p":
        return 2 * b * sl * KV_HEADS * e * (2 * (c - 1) * w + 4 * c) * layers
    return 2 * (c - 1) / c * 2 * b * sl * (HEADS + KV_HEADS) * e * w * layers


def train_command(case: str, seq: int, c: int, comm: str, steps: int, hidden: int, layers: int,
                  positions: int | None = None) -> tuple[list[str], str]:
    """train.py on C ranks for one case folder (model, DeepSpeed JSON and step log written there): the
    command and its step log. ``positions``: the model's room (default ``seq``)."""
    from lab.testing import free_port
    os.makedirs(case, exist_ok=True)
    model = write_model(os.path.join(case, "model"), positions or seq, hidden, layers)
    jsonl = os.path.join(case, "log.jsonl")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(c), "--master_port",
           str(free_port()), os.path.join(REPO, "train.py"), "--deepspeed_config",
           write_ds_config(os.path.join(case, "ds.json")), "--model", model, "--seq-length", str(seq),
           "--cp", str(c), "--cp-comm-type", comm, "--steps", str(steps), "--eval-split", "0",
           "--lr-decay", "constant", "--no-progress", "--log-jsonl", jsonl]
    return cmd, jsonl


def write_table(rows: list[str], out: str | None) -> None:
    """Print the markdown table, and write it to ``out`` when given."""
    table = "\n".join(rows)
    print(table)
    if out:
        with open(out, "w") as f:
            f.write(table + "\n")


def launch(seq: int, c: int, comm: str, args, work: str) -> dict:
    from benchmarks.bench_schedules import run_train
    case = os.path.join(work, f"s{seq}_c{c}_{comm}")
    cmd, jsonl = train_command(case, seq, c, comm, args.steps, args.hidden, args.layers)
    start = time.monotonic()
    error = run_train(cmd, case)
    if error:
        return {"error": error}
    with open(jsonl) as f:
        steps = [r for r in map(json.loads, f) if r.get("kind", "train") == "train" and "tokens_per_s" in r]
    rates = [r["tokens_per_s"] for r in steps if r["step"] >= 2]
    return {"tokens_per_s": statistics.median(rates), "wall_s": time.monotonic() - start}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[4096, 8192, 16384])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default=None, help="also write the markdown table here")
    parser.add_argument("--work", default=None, help="folder for the runs' logs [a temporary one]")
    args = parser.parse_args(argv)
    work = args.work or tempfile.mkdtemp(prefix="mtds-bench-cp-")
    rows = ["| seq | C | comm | tokens/s | MB sent per rank and step (formula) | wall s |", "|---|---|---|---|---|---|"]
    for seq in args.seq:
        for c in args.cp:
            for comm in ("p2p",) if c == 1 else ("p2p", "a2a"):
                r = launch(seq, c, comm, args, work)
                mb = bytes_per_step(comm, c, seq, args.hidden, args.layers) / 1e6
                if "error" in r:
                    rows.append(f"| {seq} | {c} | {comm if c > 1 else '-'} | {r['error']} | {mb:.1f} | |")
                else:
                    rows.append(f"| {seq} | {c} | {comm if c > 1 else '-'} | {r['tokens_per_s']:,.0f} | {mb:.1f} | "
                                f"{r['wall_s']:.0f} |")
                print(rows[-1], flush=True)
    write_table(rows, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
