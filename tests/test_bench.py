"""Benchmark smoke tests: the bench script's JSON on a tiny shape, and the tracer's TP bytes equal the
formula 4m((4l+2)bsh + 3bs) + 4 exactly (a real check of mtds.observe.comm_trace and of the layer code)."""
import json
from types import SimpleNamespace

from benchmarks.bench_vs_hf import main
from benchmarks.comm_formulas import params_per_rank, tp_bytes
from benchmarks.layouts import run_layouts
from benchmarks.workloads import Shape

TINY = ["--layers", "2", "--hidden", "64", "--heads", "2", "--seq", "32", "--micro-batch", "2"]


def test_param_formula_matches_gpt2_count():
    # the formula against the parameters real models hold: HF GPT-2 and mtds's model at t = 1
    from transformers import GPT2Config, GPT2LMHeadModel

    from mtds.model.config import ModelConfig
    from mtds.model import GPTModel
    l, h, V, s = 3, 64, 384, 48
    hf = GPT2LMHeadModel(GPT2Config(n_layer=l, n_embd=h, n_head=4, vocab_size=V, n_positions=s))
    ours = GPTModel(ModelConfig(vocab_size=V, hidden_size=h, num_layers=l, num_heads=4, max_position_embeddings=s))
    assert params_per_rank(l, h, V, s) == sum(p.numel() for p in hf.parameters()) \
        == sum(p.numel() for p in ours.parameters())


def test_bench_script_json(tmp_path):
    main([*TINY, "--reps", "1", "--steps", "2", "--warmup", "1", "--layouts", "", "--profile", "never",
          "--out", str(tmp_path)])
    result = json.loads((tmp_path / "bench.json").read_text())
    for side in ("hf", "mtds"):
        for key in ("tokens_per_s", "peak_rss_gib", "train_rss_gib", "phases_s", "losses", "parameters"):
            assert key in result[side], (side, key)
    assert result["hf"]["parameters"] == result["mtds"]["parameters"]      # the same model on both sides
    for key in ("throughput_ratio", "memory_ratio", "throughput_met", "memory_met"):
        assert key in result["goals"]
    assert "Verdict" in result["verdict"] and (tmp_path / "bench.md").stat().st_size > 0


def test_tp_bytes_match_formula_exactly():
    shape = Shape(layers=2, hidden=64, heads=2, vocab=8192, seq=32, micro_batch=2)
    args = SimpleNamespace(layout_steps=2, seed=1234, timeout=300.0)
    (layout,), _ = run_layouts(shape, [(2, 1, 1)], args, with_baseline=False)
    tp_row = next(r for r in layout["comm"] if r["traffic"] == "all_reduce/tp")
    # global batch 2b at d = 1: m = 2 micro-batches per step
    assert tp_row["measured_bytes"] == tp_row["expected_bytes"] == tp_bytes(2, 64, 2, 32, 2)
    assert layout["comm_raw"][0] == layout["comm_raw"][1]                 # both TP ranks move the same


def test_comm_trace_overhead_bench_times_every_way_and_the_tracer_counts_every_call():
    # the benchmark's rank body on a pooled world of 2: three timings per collective and round, and the
    # counting tracer saw each of its calls (a tracer that skipped calls would look cheap)
    from benchmarks.bench_comm_trace import KINDS, WAYS, check_counts, time_rank
    from lab.testing import spawn
    for result in spawn(time_rank, 2, 40, 3):
        check_counts(result, 40, 3)
        assert all(len(result["times"][k][w]) == 3 and min(result["times"][k][w]) > 0 for k in KINDS for w in WAYS)


def _link_probe():
    from benchmarks.link_probe import probe
    return probe(0.5, 1)


def test_link_probe_times_every_pattern():
    """benchmarks/link_probe.py on 4 gloo ranks of one host (the emulated cluster needs root and a minute; its
    numbers are in docs/cluster.md): every pattern runs on every rank, takes time and reports a byte count."""
    from lab.testing import spawn
    for result in spawn(_link_probe, 4, timeout=120):
        assert set(result) == {"allreduce", "ring_rs", "ring_rs_x2", "pairs", "pairs_small"}, result
        assert all(v["s"] > 0 and isinstance(v["tx"], int) for v in result.values()), result


def test_bench_moe_deepspeed_layer_computes_mtds_block():
    """benchmarks/bench_moe.py's "same work": DeepSpeed's MoE layer as it builds it, with mtds's weights copied
    in, gives mtds's block output and input gradient (one process, e = 1); its all-to-all formula as traced
    there (h 256, E 8, N 512, e 2)."""
    import torch

    from benchmarks.bench_moe import copy_into_deepspeed, deepspeed_moe, model_config, mtds_all_to_all_bytes, parse_args
    from mtds.model.moe import MoEBlock
    args = parse_args(["--hidden", "32", "--experts", "4", "--ffn", "16", "--ranks", "1"])
    torch.manual_seed(0)
    block, ds = MoEBlock(model_config(args)), deepspeed_moe(args, 1)
    copy_into_deepspeed(ds, block)
    x, up = torch.randn(2, 64, 32, generator=torch.Generator().manual_seed(1))
    for out in (block(xm := x.clone().requires_grad_(True)), ds(xd := x.clone().requires_grad_(True))[0]):
        out.backward(up)
    grads = [xm.grad, xd.grad]
    torch.testing.assert_close(ds(x)[0], block(x), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-7)
    assert mtds_all_to_all_bytes(2, 8, 256, 512, 2) == 8_388_736


def test_bench_moe_megatron_layer_computes_mtds_block(tmp_path):
    """benchmarks/bench_moe.py's Megatron-core side: Megatron-core's ``MoELayer`` as benchmarks/megatron_moe.py
    builds it in the peers' interpreter, with mtds's weights copied in, gives mtds's block output, input gradient
    and weight gradients (router, each expert's gate|up and down) in one process at e = 1, tiny shapes. Skipped
    only where the peers' interpreter (PEERS_PYTHON / PEERS_WORK) or its megatron-core is missing."""
    import os
    import subprocess

    import pytest
    import torch

    from benchmarks.bench_moe import (REPO, megatron_all_to_all_bytes, model_config, parse_args, rank_inputs,
                                      write_megatron_job)
    from benchmarks.peer_runner import peer_python_missing, peers_python
    from mtds.model.moe import MoEBlock
    # the formula as traced on 2 ranks (h 64, N 256, top-2; docs/moe.md): rows 16·h·e·N·k, weights 8·e·N·k
    assert megatron_all_to_all_bytes(2, 64, 256, 2) == 1_056_768 and megatron_all_to_all_bytes(1, 64, 256, 2) == 0
    why = peer_python_missing("megatron.core")
    if why:
        pytest.skip(why)
    args = parse_args(["--hidden", "32", "--experts", "4", "--ffn", "16", "--tokens", "96", "--ranks", "1"])
    write_megatron_job(args, str(tmp_path))
    torch.manual_seed(args.seed)
    block = MoEBlock(model_config(args))        # the job's weights (write_megatron_job draws them the same way)
    tokens, upstream = rank_inputs(args, 0)
    x = tokens.clone().requires_grad_(True)
    out = block(x)
    out.backward(upstream)
    script = os.path.join(REPO, "benchmarks", "megatron_moe.py")
    p = subprocess.run([peers_python(), script, "--job", str(tmp_path), "--ranks", "1", "--iters", "1", "--warmup",
                        "0", "--out", str(tmp_path / "r.json"), "--grads", str(tmp_path / "g.pt")],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    theirs = torch.load(tmp_path / "g.pt")
    # the values are ~1e-3 (outputs, input gradients) to ~1e-1 (expert gradients); they agree to ~1e-8 here
    close = dict(rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(theirs["output"], out.detach(), **close)
    torch.testing.assert_close(theirs["input_grad"], x.grad, **close)
    torch.testing.assert_close(theirs["router_grad"], block.router.weight.grad, **close)
    torch.testing.assert_close(torch.stack(theirs["fc1_grads"]), block.experts.gate_up.grad, **close)
    torch.testing.assert_close(torch.stack(theirs["fc2_grads"]), block.experts.down.grad, **close)
