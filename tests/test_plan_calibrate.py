"""`mtds-plan --calibrate`: a few-second measurement that makes "local" a usable GPU type."""

import pytest

from mtds.plan.calibrate import measure_matmul, measure_memory_bandwidth, save_profile
from mtds.plan.candidate import Candidate, Workload
from mtds.plan.hardware import Cluster, get_gpu
from mtds.plan.model_spec import ModelSpec
from mtds.plan.predict import predict


def test_local_measurements_are_positive():
    assert measure_matmul(n=256) > 0
    assert measure_memory_bandwidth(nbytes=2 ** 22) > 0


def test_profile_drives_predictions(tmp_path):
    prof = {"device": "cpu", "dtype": "fp32", "matmul_tflops": 0.05, "memory_gbps": 5.0,
            "allreduce_busbw_gbps": 1.0, "allreduce_latency_s": 1e-4, "memory_gib": 4.0, "devices_per_node": 2}
    path = save_profile(prof, tmp_path / "p.json")
    gpu = get_gpu("local", profile=path)
    assert gpu.peak_tflops == 0.05 and gpu.calibration.gemm_max_fraction == 1.0
    model = ModelSpec(layers=2, hidden=64, heads=4, vocab=256, seq=32)
    pr = predict(model, Candidate(2, 1, 1, 2, recompute="none"), Workload(4, "fp32"), Cluster(gpu, 2))
    assert pr.fits and pr.step_time_s > 0 and pr.time_breakdown_s["tp_comm"] > 0


# `mtds-plan --calibrate` writing a profile the planner reads: tests/test_plan_check_local.py, whose end-to-end
# test predicts from that profile (one calibration for both; two fresh interpreters each, ~10 CPU-s).


def test_cli_calibrate_refuses_a_gpu_machine(monkeypatch, capsys):
    """--calibrate profiles CPU cores over gloo; where torch sees a GPU that profile would misplan GPU runs
    (seen on an H100: 0.54 TFLOP/s). It refuses with the fix instead (torch.cuda patched: no GPU here)."""
    import torch

    from mtds.cli.plan import main
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SystemExit) as stop:
        main(["--calibrate"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "torch sees 1 GPU(s) here" in err and "CUDA_VISIBLE_DEVICES=" in err, err
