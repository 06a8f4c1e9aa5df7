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
INTO_MTDS = {"gpt2": ((2, 2), (1, 2), ((4, 1), (1, 2))), "llama": ((2, 2), (2, 1), ((1, 1), (2, 2)))}
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
