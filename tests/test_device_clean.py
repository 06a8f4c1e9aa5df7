"""Device-clean code paths, checked without a GPU. Under NCCL every tensor a collective or a GPU kernel
touches must be on the rank's device; CPU gloo accepts host tensors and hides a forgotten
``device=``. Two checks stand in for a GPU:
  - the ``meta`` device: the entry points' single-rank paths run with the device set to ``meta`` (weights,
    forward, SDPA run there; any op mixing a meta and a host tensor raises) and every collective is
    replaced by one that refuses a tensor on another device -- what NCCL would do;
  - a static scan: every torch tensor factory on the hot paths names its device, or is on the list below
    with the reason it belongs on the host.
"""
from __future__ import annotations

import ast
import os

from lab.testing import spawn
from tests.test_hf_cases import VOCAB, hf_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FACTORIES = {"empty", "zeros", "ones", "full", "tensor", "arange", "randn", "rand", "randint", "linspace", "eye",
             "as_tensor", "randperm"}
HOT_PATHS = ("mtds/eval.py", "mtds/training", "mtds/pipe", "mtds/tp", "mtds/model", "mtds/safety",
             "mtds/checkpoint/reshard_zero0.py", "mtds/data/micro_batches.py")
# (file, line's call as written) -> why it is built on the host
ON_THE_HOST = {
    ("mtds/data/micro_batches.py", "torch.zeros(b, s, dtype=torch.long)"): "host batches; the step moves them",
    ("mtds/model/norms.py", "torch.ones(hidden_size)"):
        "a parameter: modules are built on the host, then moved by DeepSpeed / .to(device)",
    ("mtds/model/router.py", "torch.empty(cfg.num_experts, cfg.hidden_size)"): "the MoE router's parameter (as above)",
    ("mtds/model/router.py", "torch.zeros(cfg.num_experts, dtype=torch.float32)"):
        "the expert-bias buffer: a module's buffer, moved with the module (as above)",
    ("mtds/model/latent_attention.py", "torch.empty(out_features, in_features)"):
        "latent attention's replicated projection, a parameter (as above)",
    ("mtds/model/shared_expert.py", "torch.empty(1, cfg.hidden_size)"): "the shared expert's gate, a parameter (as above)",
    ("mtds/model/router.py", "torch.zeros(cfg.num_experts)"): "GPT-OSS's router bias, a parameter (as above)",
    ("mtds/model/experts.py", "torch.zeros(rows[1] - rows[0], h)"): "GPT-OSS's experts' down bias, a parameter (as above)",
    # init_shard: a parameter's initial values come from the CPU generator (the same on every device)
    ("mtds/tp/init_shard.py", "torch.zeros(shape, dtype=torch.float32)"): "a parameter's full fill (as above)",
    ("mtds/tp/init_shard.py", "torch.zeros(local_shape, dtype=torch.float32)"): "a parameter's shard (as above)",
    ("mtds/tp/init_shard.py", "torch.empty((r1 - r0, *shape[1:]), dtype=torch.float32)"): "a fill chunk (as above)",
    ("mtds/tp/init_shard.py", "torch.empty(n + tail, dtype=torch.float32)"): "draws that advance the CPU generator",
    # yarn's frequency ramp: transformers' own formula builds these on the host, then moves them (same bits)
    ("mtds/model/rotary.py", "torch.arange(dim // 2, dtype=torch.float32)"): "yarn's ramp, moved to the device",
    ("mtds/model/rotary.py", "torch.arange(0, dim, 2)"): "yarn's frequencies, moved to the device",
}


def _hot_files():
    for entry in HOT_PATHS:
        path = os.path.join(ROOT, entry)
        if path.endswith(".py"):
            yield entry
            continue
        for folder, _, files in os.walk(path):
            yield from (os.path.relpath(os.path.join(folder, f), ROOT) for f in files if f.endswith(".py"))


def factories_without_device(source: str, filename: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in FACTORIES \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch" \
                and not any(k.arg == "device" for k in node.keywords) \
                and (filename, ast.unparse(node)) not in ON_THE_HOST:
            found.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_every_listed_host_tensor_still_exists():
    """The allow-list cannot outlive the code it excuses."""
    for filename, call in ON_THE_HOST:
        with open(os.path.join(ROOT, filename)) as f:
            calls = {ast.unparse(node) for node in ast.walk(ast.parse(f.read())) if isinstance(node, ast.Call)}
        assert call in calls, f"{filename}: {call} is listed in ON_THE_HOST but no longer in the file"


def test_every_tensor_factory_on_the_hot_paths_names_its_device():
    found = []
    for name in _hot_files():
        with open(os.path.join(ROOT, name)) as f:
            found += factories_without_device(f.read(), name)
    assert not found, "tensor factories without device= (add it, or list why it is a host tensor):\n" + \
        "\n".join(found)
    assert factories_without_device("import torch\nx = torch.tensor([1])\n", "x.py")   # the scan sees one


class _DeviceCheckedCollectives:
    """Replace torch.distributed's collectives by no-ops that raise for a tensor not on ``device``
    (NCCL's behaviour for host tensors); restored on exit."""

    NAMES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "send",
             "recv", "isend", "irecv", "reduce")

    def __init__(self, device):
        self.device, self.saved = device, {}

    def __enter__(self):
        import torch
        import torch.distributed as dist

        def check(name):
            def collective(*args, **kwargs):
                tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
                tensors += [t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, torch.Tensor)]
                for t in tensors:
                    if t.device.type != self.device.type:
                        raise RuntimeError(f"{name} got a tensor on {t.device}, the run's device is {self.device}")
            return collective
        for name in self.NAMES:
            self.saved[name] = getattr(dist, name)
            setattr(dist, name, check(name))
        return self

    def __exit__(self, *exc):
        import torch.distributed as dist
        for name, fn in self.saved.items():
            setattr(dist, name, fn)
        return False


def _eval_on_meta(root: str):
    """mtds-eval's single-rank path (build, load weights, evaluate) with the device set to meta."""
    import torch

    from mtds.eval import build_eval_model, evaluation_totals
    from mtds.hf.init import hf_model_config
    from mtds.parallel.layout import ParallelLayout
    hf_dir = os.path.join(root, "gpt2")
    hf_model("gpt2").save_pretrained(hf_dir)
    cfg = hf_model_config(hf_dir)
    groups = ParallelLayout.for_world(1, tp=1, pp=1).build_groups()
    meta = torch.device("meta")
    model = build_eval_model(cfg, groups, hf=hf_dir, device=meta)
    rows = [[1, 2, 3, 4, 5], [7, 8, VOCAB - 1]]
    with _DeviceCheckedCollectives(meta):
        totals = evaluation_totals(model, rows, cfg, groups, meta)
    return {p.device.type for p in model.parameters()}, totals.device.type, tuple(totals.shape)


def test_eval_runs_on_the_run_device_only(tmp_path):
    params, totals, shape = spawn(_eval_on_meta, 1, str(tmp_path))[0]
    assert params == {"meta"} and totals == "meta" and shape == (2,)


def test_fp32_on_cuda_turns_tf32_on_and_nothing_else_does():
    import torch

    from mtds.training.distributed import configure_matmul_precision
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        assert not configure_matmul_precision(torch.device("cpu"), "fp32")
        assert not configure_matmul_precision(torch.device("cuda", 0), "bf16")
        assert not torch.backends.cuda.matmul.allow_tf32
        assert configure_matmul_precision(torch.device("cuda", 0), "fp32")
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_a_local_rank_without_a_gpu_is_a_layout_error(monkeypatch):
    """Two ranks on a one-GPU node (seen on an H100 when a launcher started 2): one error line naming the
    GPUs and the launcher flag, not ``set_device``'s "invalid device ordinal" reported as a rendezvous
    timeout. torch.cuda is patched: this machine has no GPU."""
    import pytest
    import torch

    from mtds.parallel.layout import LayoutError
    from mtds.training.distributed import device_and_backend
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert device_and_backend() == (torch.device("cuda", 0), "nccl") and chosen == [0]
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(LayoutError, match=r"local rank 1 has no GPU of its own: 1 GPU\(s\) visible .*--num_gpus 1"):
        device_and_backend()
    assert chosen == [0]
