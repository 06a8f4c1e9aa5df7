"""Hand-checked values for mtds.metrics (formulas from arXiv 2104.04473 and 2205.05198)."""
import math

import pytest

from mtds.metrics import (
    gpt_param_count,
    hardware_flops_per_iteration,
    model_flops_per_iteration,
    peak_tflops,
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
    # 1T model, 3072 GPUs, batch 3072, 163 TFLOP/s/GPU => aggregate 502 PFLOP/s (Table 1),
    # so the iteration time implied by eq. 3 is F / (3072 * 163e12).
    f = hardware_flops_per_iteration(3072, 2048, 128, 25600, 51200, "full")
    t = f / (3072 * 163e12)
    assert 3072 * 163e12 / 1e15 == pytest.approx(502.0, rel=5e-3)  # 163 is rounded
    assert 90.0 < t < 120.0


def test_korthikanti_mfu_hfu_ratio():
    # Table 5, 22B: HFU/MFU = 43.7/41.5 = 1.053 for SP + selective recompute
    ratio = hardware_flops_per_iteration(4, 2048, 48, 6144, 51200, "selective") / \
        model_flops_per_iteration(4, 2048, 48, 6144, 51200)
    assert ratio == pytest.approx(43.7 / 41.5, rel=5e-3)


def test_peak_tflops():
    assert peak_tflops("A100-80GB", "bf16") == 312.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "fp16") == 312.0
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.0
    assert peak_tflops("Tesla V100-SXM2-32GB", "fp16") == 125.0
    assert peak_tflops("V100", "bf16") is None
    assert peak_tflops("cpu", "fp32") is None
    assert peak_tflops("A100", "int4") is None
    torch = pytest.importorskip("torch")
    assert peak_tflops("A100", torch.bfloat16) == 312.0
    assert math.isclose(peak_tflops("A100", torch.float32), 19.5)
