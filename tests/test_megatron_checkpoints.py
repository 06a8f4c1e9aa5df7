"""Megatron-LM torch_dist checkpoints in and out, against Megatron-core itself (lab/megatron_gpt.py):

- in: Megatron-core's GPTModel (GPT-2 style; Llama style with GQA, SwiGLU, RoPE, untied) saves at (2,2)
  through its dist_checkpointing; ``mtds-convert megatron-to-mtds`` writes an mtds checkpoint at another
  layout; mtds evaluates it at two more: logits equal Megatron-core's forward (fp32, 1e-5);
- out: HF models converted to mtds at (2,2), ``mtds-convert mtds-to-megatron``; Megatron-core builds the
  model from the args our common.pt carries, loads it at another layout: logits equal mtds's;
- bad input: one ``error:`` line and exit status 2.
"""
from __future__ import annotations

import argparse
import os

import pytest
import torch
import torch.distributed as dist

from lab.testing import spawn
from tests.test_hf_cases import hf_model

pytest.importorskip("megatron.core")

TOL = 1e-5
IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(7))
# family: (Megatron's (t, p), mtds checkpoint's (t, p), mtds evaluation layouts) on 4 ranks
INTO_MTDS = {"gpt2": ((2, 2), (1, 2), ((4, 1), (1, 2))), "llama": ((2, 2), (2, 1), ((1, 1), (2, 2))),
             "gpt_fused": ((2, 1), (1, 1), ((2, 2),))}
# HF case: (mtds checkpoint's (t, p), Megatron's (t, p) loading our export); vocab 250 = 2 * 125
OUT_OF_MTDS = {"gpt2": ((2, 2), (1, 2)), "llama": ((2, 2), (2, 1))}


def _mtds_logits(ck: str, layouts) -> dict:
    from mtds.checkpoint.reader import open_checkpoint
    from mtds.eval import build_eval_model, full_logits
    from mtds.parallel.layout import ParallelLayout
    cfg = open_checkpoint(ck).cfg
    out = {}
    for t, p in layouts:
        groups = ParallelLayout.for_world(dist.get_world_size(), tp=t, pp=p).build_groups()
        out[(t, p)] = full_logits(build_eval_model(cfg, groups, ckpt=ck), IDS, cfg, groups)
    return out


def _into_mtds(root: str) -> dict:
    from lab import megatron_gpt as mg
    from mtds.cli.convert import main as convert
    from mtds.training.distributed import init_distributed
    init_distributed()
    out = {}
    for family, ((mt, mp), (ct, cp), layouts) in INTO_MTDS.items():
        meg, ck = os.path.join(root, family, "megatron"), os.path.join(root, family, "mtds")
        args = mg.model_args(family)
        with mg.cpu_shims():
            model = mg.build(args, mt, mp)
            if family == "gpt_fused":      # GELU's input from ~0.1 to ~3, where tanh and erf GELU differ
                with torch.no_grad():
                    for name, p in model.named_parameters():
                        p.mul_(25 if "linear_fc1.weight" in name else 1)
            out[(family, "megatron")] = mg.logits(model, IDS)
            mg.save(model, args, meg)
            mg.teardown()
        if dist.get_rank() == 0:
            convert(["megatron-to-mtds", "--load", meg, "--tp", str(ct), "--pp", str(cp), "--out", ck])
        dist.barrier()
        out.update({(family, *layout): x for layout, x in _mtds_logits(ck, layouts).items()})
    return out


def _out_of_mtds(root: str) -> dict:
    from lab import megatron_gpt as mg
    from mtds.cli.convert import main as convert
    from mtds.megatron.common import read_common
    from mtds.megatron.dist_ckpt import resolve_dir
    from mtds.training.distributed import init_distributed
    init_distributed()
    out = {}
    for name, ((ct, cp), (mt, mp)) in OUT_OF_MTDS.items():
        hf_dir, ck, meg = (os.path.join(root, name, d) for d in ("hf", "mtds", "megatron"))
        if dist.get_rank() == 0:
            hf_model(name).save_pretrained(hf_dir)
            convert(["hf-to-mtds", "--hf", hf_dir, "--tp", str(ct), "--pp", str(cp), "--out", ck])
            convert(["mtds-to-megatron", "--ckpt", ck, "--out", meg])
        dist.barrier()
        out[(name, "mtds")] = _mtds_logits(ck, [(ct, cp)])[(ct, cp)]
        args = argparse.Namespace(**read_common(resolve_dir(meg))["args"])     # the args we wrote
        with mg.cpu_shims():
            model = mg.build(args, mt, mp, seed=99)    # other random weights than the export's
            mg.load(model, resolve_dir(meg))
            out[(name, "megatron")] = mg.logits(model, IDS)
            mg.teardown()
    return out


def _gather(per_rank: list[dict]) -> dict:
    """{key: logits} from whichever rank holds them (the last pipeline stage)."""
    out = {}
    for results in per_rank:
        out.update({k: v for k, v in results.items() if v is not None})
    return out


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def test_megatron_core_checkpoint_into_mtds(tmp_path):
    got = _gather(spawn(_into_mtds, 4, str(tmp_path), timeout=300))
    for family, (_, _, layouts) in INTO_MTDS.items():
        ref = got[(family, "megatron")]
        assert ref.shape == (*IDS.shape, 128) and float(ref.abs().max()) > 0.05, family
        for layout in layouts:
            assert _err(got[(family, *layout)], ref) < TOL, (family, layout)


def test_mtds_checkpoint_into_megatron_core(tmp_path):
    got = _gather(spawn(_out_of_mtds, 4, str(tmp_path), timeout=300))
    for name in OUT_OF_MTDS:
        assert got[(name, "megatron")].shape == got[(name, "mtds")].shape
        assert _err(got[(name, "megatron")], got[(name, "mtds")]) < TOL, name


# ---- one process: the flags path, the round trip, bad input ---------------------------------------------
LLAMA_FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
               "--max-position-embeddings", "32", "--group-query-attention", "--num-query-groups", "2",
               "--position-embedding-type", "rope", "--rotary-base", "500", "--normalization", "RMSNorm",
               "--norm-epsilon", "1e-6", "--swiglu", "--untie-embeddings-and-output-weights", "--disable-bias-linear"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """HF Llama (GQA) -> mtds at (2,1) -> Megatron torch_dist: (mtds dir, Megatron root)."""
    from mtds.cli.convert import main as convert
    root = tmp_path_factory.mktemp("megatron_export")
    hf_model("llama").save_pretrained(root / "hf")
    convert(["hf-to-mtds", "--hf", str(root / "hf"), "--tp", "2", "--pp", "1", "--out", str(root / "mtds")])
    convert(["mtds-to-megatron", "--ckpt", str(root / "mtds"), "--out", str(root / "megatron"), "--iteration", "7"])
    return str(root / "mtds"), str(root / "megatron")


def _cli(*args):
    from tests.test_convert import _cli as cli
    return cli(*args)


def _one_error_line(result, fragment):
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    assert fragment in lines[0], lines[0]


def _layers(ck):
    from mtds.checkpoint.reader import open_checkpoint
    return dict(open_checkpoint(ck).layers())


def test_round_trip_and_flags_where_common_pt_has_no_args(exported, tmp_path):
    """mtds -> Megatron -> mtds is bit-exact; without args in common.pt the flags give the model, and a
    missing one is named."""
    import shutil
    mtds_dir, megatron = exported
    assert open(os.path.join(megatron, "latest_checkpointed_iteration.txt")).read() == "7"
    assert _cli("megatron-to-mtds", "--load", megatron, "--tp", "1", "--pp", "2",
                "--out", str(tmp_path / "back")).returncode == 0
    bare = str(tmp_path / "bare")
    shutil.copytree(megatron, bare)
    torch.save({"iteration": 7}, os.path.join(bare, "iter_0000007", "common.pt"))   # Megatron-core alone
    _one_error_line(_cli("megatron-to-mtds", "--load", bare, "--out", str(tmp_path / "x")), "pass --num-layers")
    assert _cli("megatron-to-mtds", "--load", bare, *LLAMA_FLAGS, "--out", str(tmp_path / "flags")).returncode == 0
    original = _layers(mtds_dir)
    bf16 = str(tmp_path / "bf16")
    assert _cli("mtds-to-megatron", "--ckpt", mtds_dir, "--out", bf16, "--dtype", "bf16").returncode == 0
    assert _cli("megatron-to-mtds", "--load", bf16, "--out", str(tmp_path / "bf16_back")).returncode == 0
    for layer, tensors in _layers(str(tmp_path / "bf16_back")).items():      # kept in the stored dtype
        assert all(torch.equal(t, original[layer][n].to(torch.bfloat16)) for n, t in tensors.items()), layer
    for ck in ("back", "flags"):
        again = _layers(str(tmp_path / ck))
        assert again.keys() == original.keys()
        for layer, tensors in original.items():
            assert again[layer].keys() == tensors.keys()
            assert all(torch.equal(again[layer][n], t) for n, t in tensors.items()), (ck, layer)


def test_training_state_beside_the_model_is_left_behind(exported, tmp_path):
    """A Megatron-LM checkpoint also holds optimizer.* tensors (and rng/rerun objects): not the model's."""
    from mtds.megatron import dist_ckpt, keys
    from mtds.megatron.common import read_common
    _, megatron = exported
    tag = dist_ckpt.resolve_dir(megatron)
    shapes = dist_ckpt.tensor_shapes(tag)
    tensors = dist_ckpt.load_tensors(tag, {k: v for k, v in shapes.items() if k.startswith(keys.MODEL_PREFIXES)})
    tensors["optimizer.state.exp_avg.decoder.layers.mlp.linear_fc2.weight"] = torch.zeros(2, 64, 96)
    common = read_common(tag)
    common["args"] = argparse.Namespace(**common["args"])
    dist_ckpt.write(str(tmp_path / "with_optimizer"), 7, tensors, common)
    assert _cli("megatron-to-mtds", "--load", str(tmp_path / "with_optimizer"),
                "--out", str(tmp_path / "out")).returncode == 0


def test_bad_input_is_one_error_line(exported, tmp_path):
    import json
    import shutil
    mtds_dir, megatron = exported
    out = str(tmp_path / "out")
    _one_error_line(_cli("megatron-to-mtds", "--load", "/no/such/dir", "--out", out), "does not exist")
    os.makedirs(tmp_path / "empty")
    _one_error_line(_cli("megatron-to-mtds", "--load", str(tmp_path / "empty"), "--out", out),
                    "no metadata.json and no latest_checkpointed_iteration.txt")
    _one_error_line(_cli("megatron-to-mtds", "--load", megatron, "--num-layers", "3", "--out", out),
                    "--num-layers 3 contradicts the checkpoint's args.num_layers = 2")
    _one_error_line(_cli("megatron-to-mtds", "--load", megatron, "--tp", "4", "--out", out), "4")
    zarr = str(tmp_path / "zarr")
    shutil.copytree(megatron, zarr)
    with open(os.path.join(zarr, "iter_0000007", "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "zarr"}, f)
    _one_error_line(_cli("megatron-to-mtds", "--load", zarr, "--out", out), "is a 'zarr' checkpoint")
    bare = str(tmp_path / "bare")        # no args: flags that describe another model than the tensors
    shutil.copytree(megatron, bare)
    torch.save({}, os.path.join(bare, "iter_0000007", "common.pt"))
    flags = [f for f in LLAMA_FLAGS if f != "--swiglu"]
    _one_error_line(_cli("megatron-to-mtds", "--load", bare, *flags, "--out", out),
                    "decoder.layers.mlp.linear_fc1.weight has shape [2, 192, 64], the arguments give [2, 96, 64]")
    flags = [f for f in LLAMA_FLAGS if f != "--untie-embeddings-and-output-weights"]
    _one_error_line(_cli("megatron-to-mtds", "--load", bare, *flags, "--out", out), "have no place in the model")
    _one_error_line(_cli("mtds-to-megatron", "--ckpt", mtds_dir, "--out", megatron), "is not empty")


def test_qk_norm_is_refused_on_export(tmp_path):
    from mtds.cli.convert import main as convert
    hf_model("qwen3").save_pretrained(tmp_path / "hf")
    convert(["hf-to-mtds", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "mtds")])
    _one_error_line(_cli("mtds-to-megatron", "--ckpt", str(tmp_path / "mtds"), "--out", str(tmp_path / "m")),
                    "ModelConfig.qk_norm = True has no Megatron-LM equivalent")


def test_common_pt_with_megatron_lm_classes_reads_without_importing_them(tmp_path, monkeypatch):
    """Megatron-LM's args hold its enums and functions: read as opaque stubs, the plain fields as saved."""
    import enum
    import sys
    import types
    import torch.nn.functional as F
    from mtds.megatron.common import Opaque, read_common
    fake = types.ModuleType("megatron_lm_not_installed")      # a module the reading process cannot import

    class Backend(enum.Enum):
        auto = 5
    Backend.__module__, Backend.__qualname__ = fake.__name__, "Backend"
    fake.Backend = Backend
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    args = argparse.Namespace(num_layers=2, attention_backend=Backend.auto, activation_func=F.gelu,
                              params_dtype=torch.bfloat16)
    torch.save({"args": args, "iteration": 3}, tmp_path / "common.pt")
    monkeypatch.delitem(sys.modules, fake.__name__)
    state = read_common(str(tmp_path))
    assert state["iteration"] == 3 and state["args"]["num_layers"] == 2
    assert state["args"]["params_dtype"] is torch.bfloat16
    assert isinstance(state["args"]["attention_backend"], Opaque) and state["args"]["attention_backend"].args == (5,)
    assert issubclass(state["args"]["activation_func"], Opaque)      # a function reference: the stub class
