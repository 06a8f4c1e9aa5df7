"""Hand-checked values for mtds.observe.metrics (formulas from arXiv 2104.04473 and 2205.05198)."""
import math

import pytest

from mtds.observe.metrics import (
    gpt_param_count,
    hardware_flops_per_iteration,
    model_config_flops,
    model_flops_per_iteration,
    peak_tflops,
    training_flops_per_iteration,
)


def test_gpt3_175b_param_count():
    # 12*96*12288^2 = 173,946,175,488 ; *(1 + 13/147456 + 53248/14155776) -> 174.6e9
    p = gpt_param_count(96, 12288, 51200, 2048)
    assert p == pytest.approx(174.6e9, rel=1e-3)


def test_small_param_count_exact():
    # l=2, h=4, V=10, s=3: 12*2*16 = 384 ; 384*(1 + 13/48 + 13/96) = 384 + 104 + 52 = 540
    assert gpt_param_count(2, 4, 10, 3) == pytest.approx(540.0)


def test_table1_param_counts():
    # PTD-P Table 1 row 1 (1.7B) and last row (1008B)
    assert gpt_param_count(24, 2304, 51200, 2048) / 1e9 == pytest.approx(1.7, abs=0.05)
    assert gpt_param_count(128, 25600, 51200, 2048) / 1e9 == pytest.approx(1008.0, rel=2e-3)


def test_model_flops_small_exact():
    # B=1,s=3,l=2,h=4,V=10: 72*1*3*2*16 = 6912 ; *(1 + 3/24 + 10/96) = 6912*1.2291666 = 8496
    assert model_flops_per_iteration(1, 3, 2, 4, 10) == pytest.approx(8496.0)


def test_hardware_flops_full_and_selective_exact():
    # full: 96*96*(1 + 1/8 + 10/128) = 9216*1.203125 = 11088
    assert hardware_flops_per_iteration(1, 3, 2, 4, 10, "full") == pytest.approx(11088.0)
    # selective: 6912*(1 + 3/12 + 10/96) = 6912*1.3541666 = 9360
    assert hardware_flops_per_iteration(1, 3, 2, 4, 10, "selective") == pytest.approx(9360.0)
    assert hardware_flops_per_iteration(1, 3, 2, 4, 10, "none") == pytest.approx(8496.0)
    with pytest.raises(ValueError):
        hardware_flops_per_iteration(1, 3, 2, 4, 10, "some")


def test_table1_last_row_tflops_consistency():
    # 1T model, 3072 GPUs, batch 3072, 163 TFLOP/s/GPU (Table 1): the iteration time eq. 3 implies,
    # F / (3072 * 163e12), is ~103 s (a wrong constant in the full-recompute count leaves this window)
    f = hardware_flops_per_iteration(3072, 2048, 128, 25600, 51200, "full")
    t = f / (3072 * 163e12)
    assert 90.0 < t < 120.0


def test_korthikanti_mfu_hfu_ratio():
    # Table 5, 22B: HFU/MFU = 43.7/41.5 = 1.053 for SP + selective recompute
    ratio = hardware_flops_per_iteration(4, 2048, 48, 6144, 51200, "selective") / \
        model_flops_per_iteration(4, 2048, 48, 6144, 51200)
    assert ratio == pytest.approx(43.7 / 41.5, rel=5e-3)


@pytest.mark.parametrize("shape", [(1, 3, 2, 4, 10), (8, 1024, 12, 768, 50257), (512, 2048, 96, 12288, 51200)])
@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
def test_general_count_is_ptdp_for_gpt2_shapes(shape, recompute):
    # f = 4h, multi-head attention, GELU: the general count reduces to the closed forms (72 / 96)
    general = training_flops_per_iteration(*shape, ffn_hidden=4 * shape[3], num_heads=4, num_kv_heads=4,
                                           recompute=recompute)
    assert general == pytest.approx(hardware_flops_per_iteration(*shape, recompute), rel=1e-12)


LLAMA_LIKE = dict(vocab_size=100, hidden_size=16, num_layers=3, num_heads=4, num_kv_heads=2, ffn_hidden_size=40,
                  activation="swiglu", normalization="rmsnorm", position_embedding="rotary", qkv_bias=False,
                  linear_bias=False, tie_word_embeddings=False, architecture="llama")


def test_llama_like_count_by_hand():
    from mtds.model.config import ModelConfig
    # B=2, s=8, h=16, 4 heads of 4 dims, 2 KV heads (K, V 8 wide), SwiGLU f=40, V=100, untied head.
    # Per token and layer, forward: QKV 2*16*(16+8+8) = 1024, scores+xV 4*8*16 = 512,
    # out-proj 2*16*16 = 512, MLP 3 matrices 3*2*16*40 = 3840 -> 5888. Logits 2*16*100 = 3200.
    # 16 tokens x 3 passes: 48 * (3*5888 + 3200) = 1,001,472.
    cfg = ModelConfig(**LLAMA_LIKE)
    assert model_config_flops(cfg, 2, 8) == 1_001_472
    # full: layers 4 passes, logits 3: 16 * (4*3*5888 + 3*3200) = 1,284,096
    assert model_config_flops(cfg, 2, 8, recompute="full") == 1_284_096
    # selective: + 4sh = 512 per token and layer, 3 passes: 48 * (3*6400 + 3200) = 1,075,200
    assert model_config_flops(cfg, 2, 8, recompute="selective") == 1_075_200
    # GPT-2's formula would have counted 72*16*3*256*(1 + 8/96 + 100/576) + ... i.e. something else
    assert model_flops_per_iteration(2, 8, 3, 16, 100) != model_config_flops(cfg, 2, 8)


def test_explicit_head_dim_count_by_hand():
    from mtds.model.config import ModelConfig
    # Qwen3-like: as above but 4 heads of 8 dims (kv_channels 8: Q 32 wide, K and V 16, not 16 and 8).
    # Per token and layer, forward: QKV 2*16*(32+16+16) = 2048, scores+xV 4*8*32 = 1024,
    # out-proj 2*32*16 = 1024, MLP 3840 -> 7936. Logits 3200. 48 * (3*7936 + 3200) = 1,296,384.
    cfg = ModelConfig(**LLAMA_LIKE, kv_channels=8, qk_norm=True)
    assert model_config_flops(cfg, 2, 8) == 1_296_384
    # selective: + 4sq = 1024 per token and layer, 3 passes: 48 * (3*8960 + 3200) = 1,443,840
    assert model_config_flops(cfg, 2, 8, recompute="selective") == 1_443_840


def test_step_log_reports_the_architecture_flops(tmp_path):
    """The step log's model TFLOP/s is the general count over the step time (a Llama-like model)."""
    import json

    from mtds.model.config import ModelConfig
    from tests.training_helpers import TINY, ds_config, run_layouts, train_config
    cfg = ModelConfig(**{**LLAMA_LIKE, "vocab_size": TINY.vocab_size, "hidden_size": 32, "num_layers": 2,
                         "max_position_embeddings": 64})
    log = tmp_path / "log.jsonl"
    run_layouts(1, [train_config(model=cfg, steps=1, deepspeed_config=ds_config(zero=0), log_jsonl=str(log))])
    [record] = [r for r in map(json.loads, log.read_text().splitlines()) if r.get("step") == 1 and "loss" in r]
    expected = model_config_flops(cfg, 8, 32)
    assert record["tflops_model"] * 1e12 * record["step_time_s"] == pytest.approx(expected, rel=1e-9)


def test_peak_tflops():
    assert peak_tflops("A100-80GB", "bf16") == 312.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "fp16") == 312.0
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.0          # SXM5
    assert peak_tflops("H100-SXM5-80GB", "bf16") == 989.0
    assert peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.0
    assert peak_tflops("NVIDIA H100 NVL", "bf16") == 835.5
    assert peak_tflops("NVIDIA H100 PCIe", "fp32") == 51.0
    assert peak_tflops("NVIDIA H200", "bf16") == 989.0
    assert peak_tflops("NVIDIA GH200 480GB", "bf16") == 989.0 and peak_tflops("NVIDIA GH200 480GB", "tf32") == 494.0
    assert peak_tflops("NVIDIA H800", "bf16") == 989.0 and peak_tflops("NVIDIA H800 PCIe", "bf16") == 756.0
    assert peak_tflops("NVIDIA B200", "bf16") == 2250.0 and peak_tflops("NVIDIA B200", "tf32") == 1100.0
    assert peak_tflops("NVIDIA A800-SXM4-80GB", "bf16") == 312.0
    from mtds.observe.metrics import _gpu_family
    assert _gpu_family("NVIDIA GH200 480GB") == "GH200"        # not "H200" by substring
    assert peak_tflops("NVIDIA H200 NVL", "bf16") == 835.5
    assert peak_tflops("Tesla V100-SXM2-32GB", "fp16") == 125.0
    assert peak_tflops("V100", "bf16") is None
    assert peak_tflops("cpu", "fp32") is None
    assert peak_tflops("A100", "int4") is None
    import torch   # a project dependency: a missing torch must fail here, not skip
    assert peak_tflops("A100", torch.bfloat16) == 312.0
    assert math.isclose(peak_tflops("A100", torch.float32), 19.5)


@pytest.mark.parametrize("call_s, calls", [(0.001, 11), (0.06, 3), (0.2, 2)])
def test_cpu_gemm_peak_stays_within_its_budget_on_a_slow_kernel(monkeypatch, call_s, calls):
    """The CPU's GEMM peak (MFU's denominator) is the best of 10 timed calls after a first one, but a kernel the
    CPU has no instructions for (fp16, bf16 on AVX2: ~0.2 s a 512³ call) stops once 0.1 s is spent: at least one
    timed call, never the ten that cost every rank of every such run 2-3 s. A fake clock times the calls."""
    import torch

    from mtds.observe import gemm_peak
    clock, made = [0.0], []

    def matmul(a, b):
        made.append(1)
        clock[0] += call_s
        return a

    monkeypatch.setattr(gemm_peak.torch, "matmul", matmul)
    monkeypatch.setattr(gemm_peak.time, "perf_counter", lambda: clock[0])
    peak = gemm_peak.cpu_gemm_peak(torch.float32, n=8)
    assert len(made) == calls, made
    assert peak == pytest.approx(2 * 8 ** 3 / call_s)
