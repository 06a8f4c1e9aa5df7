"""Megatron-DeepSpeed checkpoints into mtds (``mtds-convert megatron-deepspeed-to-mtds``), read through
DeepSpeed's DeepSpeedCheckpoint.

Megatron-DeepSpeed cannot run here, so lab/megatron_deepspeed.py builds a DeepSpeed PipelineModule with
GPTModelPipe's specs and parameter names holding an HF GPT-2 with random weights split Megatron-style at
(t, p) = (2, 2), and saves it with DeepSpeed's engine; mtds's logits after the import equal HF's (fp32,
1e-5) at two layouts each. Bad input: one ``error:`` line, exit status 2 (fixtures from the engine-free
writer, whose layer files the first test checks equal to the engine's).
"""
from __future__ import annotations

import argparse
import os

import pytest
import torch
import torch.distributed as dist

from lab import megatron_deepspeed as mds
from lab.testing import spawn

TOL = 1e-5
IDS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(7))
# case: (tied head, query_key_value in blocks (after Megatron-DeepSpeed's FPDT commit), source (t, p),
#        mtds checkpoint's (t, p), mtds evaluation layouts), on t * p = 4 ranks
CASES = {"tied_interleaved": (True, False, (2, 2), (1, 2), ((1, 1), (2, 1))),
         "untied_blocked": (False, True, (2, 2), (2, 1), ((1, 1), (1, 2)))}
RANKS = 4


def _body(root: str, cases: dict) -> dict:
    from mtds.checkpoint.reader import open_checkpoint
    from mtds.cli.convert import main as convert
    from mtds.eval import build_eval_model, full_logits
    from mtds.parallel.layout import ParallelLayout
    from mtds.training.distributed import init_distributed
    init_distributed()
    out = {}
    for case, (tied, blocked, (st, sp), (ct, cp), layouts) in cases.items():
        src, ck = os.path.join(root, case, "mds"), os.path.join(root, case, "mtds")
        box = [None]
        if dist.get_rank() == 0:     # transformers on one rank only; the others get the weights
            model = mds.hf_gpt2(tied=tied)
            with torch.no_grad():
                out[(case, "hf")] = model(IDS).logits
            box = [mds.Weights(model)]
        dist.broadcast_object_list(box, src=0)
        model = box[0]
        mds.engine_write(src, model, tp=st, pp=sp, blocked_qkv=blocked)
        if dist.get_rank() == 0:
            hand = mds.write(os.path.join(root, case, "hand"), model, tp=st, pp=sp, blocked_qkv=blocked)
            out[(case, "hand_differs")] = _layer_files_differ(os.path.join(src, "global_step10"),
                                                              os.path.join(hand, "global_step10"))
            convert(["megatron-deepspeed-to-mtds", "--load", src, "--tp", str(ct), "--pp", str(cp), "--out", ck])
        dist.barrier()
        cfg = open_checkpoint(ck).cfg
        for t, p in layouts:
            groups = ParallelLayout.for_world(dist.get_world_size(), tp=t, pp=p).build_groups()
            logits = full_logits(build_eval_model(cfg, groups, ckpt=ck), IDS, cfg, groups)
            if logits is not None and dist.get_rank() == dist.get_world_size() - 1:
                out[(case, t, p)] = logits
    return out


def _layer_files_differ(a: str, b: str) -> list[str]:
    names = sorted(f for f in os.listdir(a) if f.startswith("layer_"))
    if names != sorted(f for f in os.listdir(b) if f.startswith("layer_")):
        return ["file sets"]
    bad = []
    for f in names:
        x, y = torch.load(os.path.join(a, f)), torch.load(os.path.join(b, f))
        if x.keys() != y.keys() or any(not torch.equal(x[k], y[k]) for k in x):
            bad.append(f)
    return bad


def test_megatron_deepspeed_checkpoint_into_mtds(tmp_path):
    per_rank = spawn(_body, RANKS, str(tmp_path), CASES, timeout=300)
    got = {k: v for r in per_rank for k, v in r.items()}
    for case, (*_, layouts) in CASES.items():
        assert got[(case, "hand_differs")] == [], f"{case}: lab's engine-free writer differs from DeepSpeed's save"
        ref = got[(case, "hf")]
        for t, p in layouts:
            err = (got[(case, t, p)] - ref).abs().max().item()
            assert err < TOL, f"{case} at ({t},{p}): max |mtds - HF| = {err:.3g}"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("mds") / "src")
    return mds.write(root, mds.hf_gpt2(layers=1), tp=2, pp=1)


def _cli(*args):
    from mtds.cli.convert import main
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    return exc.value.code


def _copy(src: str, dst: str) -> str:
    import shutil
    shutil.copytree(src, dst)
    return os.path.join(dst, "global_step10")


def _rewrite_args(tag_dir: str, **fields) -> None:
    for name in os.listdir(tag_dir):
        if name.startswith("mp_rank_"):
            path = os.path.join(tag_dir, name)
            state = torch.load(path, weights_only=False)
            state["args"] = argparse.Namespace(**{**vars(state["args"]), **fields})
            torch.save(state, path)


class _Runs:
    """Pickles as a call of print: what a hostile args object would do with os.system."""

    def __reduce__(self):
        return print, ("UNPICKLED-AND-CALLED",)


@pytest.mark.parametrize("change, fragment", [
    ("swiglu", "args.swiglu = True: SwiGLU is not supported"),
    ("gqa", "grouped-query attention is not supported"),
    ("moe", "args.num_experts = [1, 4]: MoE"),
    ("hostile", "refusing to load"),
    ("replicated", "input_layernorm.weight differs between"),
    ("no_zero", "DeepSpeed's reader refuses"),
    ("missing", "does not exist"),
])
def test_bad_input_is_one_error_line(source, tmp_path, capsys, change, fragment):
    tag = _copy(source, str(tmp_path / "in"))
    if change == "swiglu":
        _rewrite_args(tag, swiglu=True)
    elif change == "gqa":
        _rewrite_args(tag, num_key_value_heads=2)
    elif change == "moe":
        _rewrite_args(tag, num_experts=[1, 4])
    elif change == "hostile":
        _rewrite_args(tag, note=_Runs())
    elif change == "replicated":
        path = os.path.join(tag, "layer_02-model_01-model_states.pt")
        state = torch.load(path)
        state["input_layernorm.weight"] = state["input_layernorm.weight"] + 1e-3
        torch.save(state, path)
    elif change == "no_zero":
        for name in os.listdir(tag):
            if name.startswith("zero_pp_rank_"):
                os.remove(os.path.join(tag, name))
    load = str(tmp_path / "nowhere") if change == "missing" else str(tmp_path / "in")
    capsys.readouterr()
    assert _cli("megatron-deepspeed-to-mtds", "--load", load, "--out", str(tmp_path / "out")) == 2
    err = capsys.readouterr()
    lines = err.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], err.err
    assert "UNPICKLED-AND-CALLED" not in err.out + err.err


def test_megatron_enums_read_as_stubs_when_megatron_is_not_installed(source, tmp_path, monkeypatch):
    """Megatron-DeepSpeed pickles its ModelType enum into args: without Megatron importable, a stub stands in."""
    import sys
    from mtds.megatron.common import Opaque
    from mtds.megatron.deepspeed_import import MegatronDeepSpeedCheckpoint
    tag = _copy(source, str(tmp_path / "in"))
    import enum
    import types
    fake = types.ModuleType("megatron.model.enums")

    class AttnMaskType(enum.Enum):
        causal = 2
    AttnMaskType.__module__, AttnMaskType.__qualname__ = fake.__name__, "AttnMaskType"
    fake.AttnMaskType = AttnMaskType
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    parents = [name for name in ("megatron", "megatron.model") if name not in sys.modules]
    for name in parents:        # pickling imports the parents too (no megatron at all on the H200 image)
        package = types.ModuleType(name)
        package.__path__ = []
        monkeypatch.setitem(sys.modules, name, package)
    _rewrite_args(tag, attn_mask_type=AttnMaskType.causal)
    monkeypatch.delitem(sys.modules, fake.__name__)
    for name in parents:
        monkeypatch.delitem(sys.modules, name)
    ckpt = MegatronDeepSpeedCheckpoint(str(tmp_path / "in"))
    assert isinstance(ckpt.args["attn_mask_type"], Opaque) and ckpt.args["attn_mask_type"].args == (2,)
    assert "megatron.model.enums" not in sys.modules and ckpt.cfg.num_layers == 1


@pytest.mark.parametrize("blocked", [False, True])
def test_layers_equal_the_hf_import_with_uneven_stages(tmp_path, blocked):
    """3 blocks at (2,2) (DeepSpeedCheckpoint groups them 1+1+1): every tensor equals what mtds's HF import
    makes of the same GPT-2, bit for bit; the config too."""
    from mtds.hf.init import hf_model_config
    from mtds.hf.load import open_hf_checkpoint
    from mtds.hf.registry import hf_state_to_layers
    from mtds.hf.stream_source import StreamingHFCheckpoint
    from mtds.megatron.deepspeed_import import MegatronDeepSpeedCheckpoint
    model = mds.hf_gpt2(layers=3, tied=not blocked)
    model.save_pretrained(tmp_path / "hf")
    cfg = hf_model_config(str(tmp_path / "hf"))
    want = dict(hf_state_to_layers(cfg, open_hf_checkpoint(cfg, StreamingHFCheckpoint(str(tmp_path / "hf")))))
    ckpt = MegatronDeepSpeedCheckpoint(mds.write(str(tmp_path / "mds"), model, tp=2, pp=2, blocked_qkv=blocked))
    got = dict(ckpt.layers())
    assert sorted(got) == sorted(want) and ckpt.cfg.num_layers == 3 and ckpt.cfg.activation == cfg.activation
    for layer, tensors in want.items():
        assert sorted(got[layer]) == sorted(tensors), layer
        for name, t in tensors.items():
            assert torch.equal(got[layer][name], t), (layer, name)
