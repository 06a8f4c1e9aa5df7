"""`mtds-plan --calibrate`: a few-second measurement that makes "local" a usable GPU type."""
import json


from mtds.plan.calibrate import measure_matmul, measure_memory_bandwidth, save_profile
from mtds.plan.candidate import Layout, Workload
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
    pr = predict(model, Layout(2, 1, 1, 2, recompute="none"), Workload(4, "fp32"), Cluster(gpu, 2))
    assert pr.fits and pr.step_time_s > 0 and pr.time_breakdown_s["tp_comm"] > 0


def test_cli_calibrate_writes_profile(tmp_path, capsys):
    from mtds.cli.plan import main

    out = tmp_path / "prof.json"
    assert main(["--calibrate", "--profile", str(out), "--json"]) == 0
    prof = json.loads(out.read_text())
    for key in ("matmul_tflops", "memory_gbps", "allreduce_busbw_gbps", "allreduce_latency_s",
                "optimizer_s_per_param"):
        assert prof[key] > 0
    assert prof["concurrency"] == 2 and prof["host_cores"] >= 1     # the contention it was measured at
    assert main(["--gpu", "local", "--profile", str(out), "--layers", "2", "--hidden", "64", "--heads", "4",
                 "--vocab", "256", "--seq", "32", "--gpus", "2", "--global-batch", "4", "--tp", "2", "--pp", "1",
                 "--json"]) == 0
