"""--profile-step: one step under torch.profiler, summed by kind of work (mtds.observe.step_profile) into the run's
result, the console and a Chrome trace per rank; the kernel names are those an H100 showed (2026-11-24)."""
import os

import pytest

from mtds.observe.step_profile import categorize
from lab.testing import spawn

H100_KERNELS = {
    "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT": "gemm",
    "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64_1x4x1_cga1x1x1_kernel0_": "attention",
    "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
    "TensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor": "optimizer",
    "void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernelTemplate<c10::BFloat16, float, 32>": "norm",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::NormTwoOps<float, float>>>":
        "reduction",
    "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)": "copy/cast",
    "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "collective",
    "void at::native::vectorized_elementwise_kernel<8, at::native::GeluBackwardCUDAKernelImpl": "element-wise/other",
    "aten::mm": "gemm", "aten::_scaled_dot_product_flash_attention_for_cpu": "attention", "aten::copy_": "copy/cast",
    "aten::native_layer_norm": "norm", "aten::sum": "reduction", "aten::gelu": "element-wise/other",
}


@pytest.mark.parametrize("name", sorted(H100_KERNELS))
def test_kernels_fall_into_their_kind_of_work(name):
    assert categorize(name) == H100_KERNELS[name]


def _profiled(workdir):
    from mtds.training import run
    from tests.training_helpers import train_config
    plain = run(train_config(steps=2, eval_split=0.0))
    profiled = run(train_config(steps=3, eval_split=0.0, profile_step=2,
                                profile_trace=os.path.join(workdir, "step.json")))
    return plain.profile, profiled.profile, sorted(os.listdir(workdir))


def _range_names(trace: str) -> list[str]:
    import json
    with open(trace) as f:
        return [e.get("name", "") for e in json.load(f)["traceEvents"] if e.get("name", "").startswith("mtds.")]


def test_profile_step_sums_one_step_by_kind_and_writes_the_trace(tmp_path):
    plain, summary, files = spawn(_profiled, 1, str(tmp_path), timeout=200)[0]
    assert plain is None                                  # off unless asked
    assert files == ["step.rank0.json"]
    kinds = {c: (ms, n) for c, ms, n in summary["rows"]}
    assert kinds["gemm"][0] > 0 and kinds["gemm"][1] > 0 and "optimizer" in kinds
    assert abs(sum(ms for ms, _ in kinds.values()) - summary["busy_ms"]) < 1e-6
    assert 0 < summary["busy_ms"] <= summary["wall_ms"] * 1.05     # own times of one thread's operators
    # mtds's ranges (mtds.observe.ranges: opened only while a profiler records) are in the trace: the step,
    # its optimizer step, a forward and a backward per micro-batch, each hook and each layer's forward
    names = _range_names(str(tmp_path / files[0]))
    assert "mtds.step" in names and "mtds.optimizer" in names, names
    assert names.count("mtds.forward") == names.count("mtds.backward") >= 1, names
    assert names.count("mtds.layer") >= 2 and any(n.startswith("mtds.hook.") for n in names), names


@pytest.mark.parametrize("kwargs, message", [
    ({"profile_step": 4}, "--profile-step 4 is not a step of this run: give 1..3"),
    ({"profile_trace": "t.json"}, "--profile-trace needs --profile-step N"),
])
def test_profile_flags_are_checked(kwargs, message):
    from tests.training_helpers import train_config
    with pytest.raises(ValueError, match=message):
        train_config(steps=3, **kwargs)


def test_cuda_branch_sums_kernels_only():
    """The CUDA branch of the summary (no GPU here): only kernel events (device type CUDA) count, by their
    own device time; the CPU operators that launched them (which also carry device time) do not."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from mtds.observe.step_profile import summarize

    def event(key, device_type, device_us, cpu_us, count):
        return SimpleNamespace(key=key, device_type=device_type, self_device_time_total=device_us,
                               self_cpu_time_total=cpu_us, count=count)
    events = [event("aten::mm", DeviceType.CPU, 18_000, 900, 97),           # launches the nvjet kernels
              event("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", DeviceType.CUDA, 7_000, 0, 97),
              event("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NTT", DeviceType.CUDA, 5_000, 0, 49),
              event("void at::native::vectorized_elementwise_kernel<8, at::native::GeluBackwardCUDAKernelImpl",
                    DeviceType.CUDA, 1_500, 0, 24)]
    prof = SimpleNamespace(key_averages=lambda: events)
    summary = summarize(prof, 0.020, "cuda")
    assert summary["rows"] == [("gemm", 12.0, 146), ("element-wise/other", 1.5, 24)]
    assert summary["busy_ms"] == 13.5 and summary["launches"] == 170 and summary["wall_ms"] == 20.0
