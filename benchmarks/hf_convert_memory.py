"""Peak memory of mtds-convert on a generated ~2 GB (fp32) Llama-style HF checkpoint.

    python benchmarks/hf_convert_memory.py --out /tmp/convert_bench [--layers 8 --hidden 2048]

The HF checkpoint is written one layer per safetensors shard (so generating it needs one layer of
memory too); then each conversion runs in a fresh process and reports its own peak RSS (ru_maxrss).
A benchmark, not a test: it takes minutes and several GB of disk.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_llama(out: str, *, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int) -> int:
    from safetensors.torch import save_file
    os.makedirs(out, exist_ok=True)
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
              "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "intermediate_size": ffn, "vocab_size": vocab, "max_position_embeddings": 2048,
              "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "hidden_act": "silu", "torch_dtype": "float32"}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    kv = kv_heads * (hidden // heads)
    groups = [{"model.embed_tokens.weight": (vocab, hidden)}]
    for i in range(layers):
        p = f"model.layers.{i}."
        groups.append({p + "self_attn.q_proj.weight": (hidden, hidden), p + "self_attn.k_proj.weight": (kv, hidden),
                       p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.o_proj.weight": (hidden, hidden),
                       p + "mlp.gate_proj.weight": (ffn, hidden), p + "mlp.up_proj.weight": (ffn, hidden),
                       p + "mlp.down_proj.weight": (hidden, ffn), p + "input_layernorm.weight": (hidden,),
                       p + "post_attention_layernorm.weight": (hidden,)})
    groups.append({"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)})
    weight_map, total = {}, 0
    g = torch.Generator().manual_seed(0)
    for n, shapes in enumerate(groups):
        name = f"model-{n + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {k: torch.randn(*s, generator=g) * 0.02 for k, s in shapes.items()}
        save_file(tensors, os.path.join(out, name), metadata={"format": "pt"})
        total += sum(t.numel() * 4 for t in tensors.values())
        weight_map.update({k: name for k in tensors})
        del tensors
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return total


def run(args: list[str]) -> dict:
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])), "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "mtds.cli.convert", *args], capture_output=True, text=True, env=env)
    if proc.returncode:
        raise SystemExit(proc.stderr[-2000:])
    rss = float(re.search(r"peak RSS (\d+) MiB", proc.stdout).group(1))
    return {"command": " ".join(args[:1] + args[1:]), "seconds": round(time.perf_counter() - start, 1),
            "peak_rss_mib": rss}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--ffn", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=32000)
    a = ap.parse_args()
    hf = os.path.join(a.out, "hf")
    size = write_llama(hf, layers=a.layers, hidden=a.hidden, heads=16, kv_heads=8, ffn=a.ffn, vocab=a.vocab)
    layer_bytes = 4 * (2 * a.hidden * a.hidden + 2 * a.hidden * a.hidden // 2 + 3 * a.hidden * a.ffn)
    print(f"HF checkpoint: {size / 2 ** 30:.2f} GiB fp32; one block {layer_bytes / 2 ** 20:.0f} MiB, "
          f"embedding {4 * a.vocab * a.hidden / 2 ** 20:.0f} MiB", flush=True)
    results = [
        run(["hf-to-mtds", "--hf", hf, "--tp", "2", "--pp", "2", "--out", os.path.join(a.out, "ck22")]),
        run(["mtds-to-hf", "--ckpt", os.path.join(a.out, "ck22"), "--out", os.path.join(a.out, "back"),
             "--max-shard-size", "500MB"]),
        run(["hf-to-mtds", "--hf", hf, "--tp", "2", "--pp", "1", "--out", os.path.join(a.out, "ck21")]),
    ]
    for r in results:
        print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
