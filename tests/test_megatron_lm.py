"""Checkpoints of today's Megatron-LM in and out, with Megatron-LM's own training code as writer and reader
(``megatron.training`` of the megatron-core 0.19.2 wheel, run by lab/megatron_lm.py on two CPU gloo ranks):

- in: Megatron-LM's ``save_checkpoint`` (``--ckpt-format torch_dist``, tp 2) of a GPT-2-style model (no
  training step, Megatron's default optimizer) and a Llama-style one (RoPE, RMSNorm eps 1e-6, SwiGLU, untied,
  2 query groups; one training step under ``--use-distributed-optimizer``): 0.19 keeps args, iteration and
  checkpoint version inside the DCP files (no common.pt). ``mtds-convert megatron-to-mtds`` with no model
  flags, mtds.eval at two other
  layouts: loss and logits equal Megatron-LM's own within 1e-5 (fp32). The same tensors with no args and
  only the flags a user would type convert to the same model (Megatron-LM's defaults for the rest).
- defaults: mtds's table of Megatron-LM defaults (mtds/megatron/args.py) equals what Megatron-LM's
  ``parse_args`` + ``validate_args`` set for those flags.
- out: HF Llama (GQA) -> mtds -> ``mtds-convert mtds-to-megatron``; Megatron-LM (``--use-checkpoint-args``)
  ``load_checkpoint`` into a model built from other random weights, forward: logits equal mtds's within 1e-5.
- Transformer Engine's ``_extra_state`` pickles never read; a hostile common state refused by name.

Megatron-LM 0.19 declares Python >= 3.12 and its ``megatron.core`` pulls in triton, so it cannot replace the
0.16.1 oracle of the other Megatron tests in the suite's venv: ``make setup-test`` installs the wheel (no
dependencies) into its own folder, ``$(VENV)/megatron-lm-0.19`` (MTDS_MEGATRON_LM overrides), which only the
subprocess of this test puts on its path. Skipped where that folder holds no ``megatron/training``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from lab.testing import spawn
from tests.test_hf_cases import hf_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEGATRON_LM = os.environ.get("MTDS_MEGATRON_LM") or os.path.join(sys.prefix, "megatron-lm-0.19")
if not os.path.isfile(os.path.join(MEGATRON_LM, "megatron", "training", "checkpointing.py")):
    pytest.skip(f"Megatron-LM's training package is not installed in {MEGATRON_LM} (make setup-test installs it)",
                allow_module_level=True)

TOL = 1e-5
IDS = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(7))
# What a user of Megatron-LM types for the two models (tp 2): everything else is Megatron-LM's default.
GPT2 = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--max-position-embeddings", "32"]
LLAMA = [*GPT2, "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--group-query-attention",
         "--num-query-groups", "2", "--rotary-base", "500000", "--ffn-hidden-size", "192", "--norm-epsilon", "1e-6"]
RUN = ["--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "2", "--vocab-size", "128",
       "--tensor-model-parallel-size", "2", "--lr", "1e-2",
       "--train-iters", "10", "--seed", "1234"]
# family: (Megatron-LM flags, extra run flags, training step, mtds checkpoint's (t, p), mtds eval layouts)
# (Megatron-LM's distributed optimizer cannot save before its first step: DistributedOptimizer.state_dict
# asserts that Adam's step count exists.)
INTO_MTDS = {"gpt2": (GPT2, [], False, (1, 1), ((1, 2), (2, 1))),
             "llama": (LLAMA, ["--use-distributed-optimizer"], True, (1, 2), ((2, 1), (1, 1)))}


def _megatron_lm(job: dict, where: str) -> dict:
    path = os.path.join(where, "job.json")
    job = {"world": 2, "ids": IDS.tolist(), "out": os.path.join(where, "megatron.pt"), **job}
    with open(path, "w") as f:
        json.dump(job, f)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([MEGATRON_LM, REPO]), "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "lab.megatron_lm", path], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-4000:]
    return torch.load(job["out"], weights_only=True)


def _mtds_eval(jobs: list) -> dict:
    """{(name, t, p): (mean loss, logits)} of mtds.eval for each (name, checkpoint, layouts)."""
    from mtds.checkpoint.reader import open_checkpoint
    from mtds.eval import build_eval_model, evaluate, full_logits
    from mtds.parallel.layout import ParallelLayout
    from mtds.training.distributed import init_distributed
    init_distributed()
    out = {}
    for name, ck, layouts in jobs:
        cfg = open_checkpoint(ck).cfg
        for t, p in layouts:
            groups = ParallelLayout.for_world(dist.get_world_size(), tp=t, pp=p).build_groups()
            model = build_eval_model(cfg, groups, ckpt=ck)
            loss = evaluate(model, IDS.tolist(), cfg, groups)["loss"]
            out[(name, t, p)] = (loss, full_logits(model, IDS[:, :-1], cfg, groups))
    return out


def _gather(per_rank: list[dict]) -> dict:
    out = {}
    for results in per_rank:
        out.update({k: v for k, v in results.items() if v[1] is not None})
    return out


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def _convert(*args):
    from tests.test_convert import _cli
    result = _cli(*args)
    assert result.returncode == 0, result.stderr
    return result


def _exported_args(path: str) -> dict:
    from mtds.megatron import dist_ckpt
    from mtds.megatron.common import read_common
    tag = dist_ckpt.resolve_dir(path)
    return read_common(tag, dist_ckpt.object_keys(tag))["args"]


@pytest.fixture(scope="module")
def megatron_lm(tmp_path_factory):
    """One Megatron-LM run: saves both families, loads our export of HF Llama, reports the parsed defaults."""
    root = tmp_path_factory.mktemp("megatron_lm")
    hf_model("llama").save_pretrained(root / "hf")
    _convert("hf-to-mtds", "--hf", str(root / "hf"), "--tp", "2", "--pp", "1", "--out", str(root / "export_mtds"))
    _convert("mtds-to-megatron", "--ckpt", str(root / "export_mtds"), "--out", str(root / "export"))
    # As docs/megatron_checkpoints.md tells a user: the model from the export's args (--use-checkpoint-args),
    # except the norm epsilon, which Megatron-LM does not take from a checkpoint (HF Llama's is 1e-6).
    run = [a for a in RUN if a not in ("--vocab-size", "128")]
    export_argv = [*run, "--use-checkpoint-args", "--norm-epsilon", "1e-6", "--seed", "4321"]  # other weights
    job = {"save": [{"key": name, "root": str(root / name), "argv": [*argv, *RUN, *extra], "train_step": step}
                    for name, (argv, extra, step, _, _) in INTO_MTDS.items()],
           "load": [{"key": "export", "root": str(root / "export"), "argv": export_argv}],
           "defaults": {"argv": [*GPT2, *RUN], "out": str(root / "defaults.json")}}
    return root, _megatron_lm(job, str(root))


def test_megatron_lm_checkpoints_into_mtds_without_model_flags(megatron_lm):
    root, ref = megatron_lm
    for name, (_, _, _, (t, p), _) in INTO_MTDS.items():
        tag = os.path.join(root, name, "iter_0000001")
        assert not os.path.exists(os.path.join(tag, "common.pt")), "0.19 keeps its common state in the DCP files"
        _convert("megatron-to-mtds", "--load", str(root / name), "--tp", str(t), "--pp", str(p),
                 "--out", str(root / f"{name}_mtds"))
    got = _gather(spawn(_mtds_eval, 2, [(name, str(root / f"{name}_mtds"), layouts)
                                        for name, (*_, layouts) in INTO_MTDS.items()], timeout=300))
    for name, (*_, layouts) in INTO_MTDS.items():
        loss, logits = float(ref[f"{name}/loss"].double().mean()), ref[f"{name}/logits"]
        assert logits.shape == (2, 16, 256) and float(logits.abs().max()) > 0.05, name
        for t, p in layouts:
            assert abs(got[(name, t, p)][0] - loss) < TOL, (name, t, p, got[(name, t, p)][0], loss)
            assert _err(got[(name, t, p)][1], logits) < TOL, (name, t, p)


def test_flags_only_conversion_takes_megatron_lms_defaults(megatron_lm, tmp_path):
    """The same tensors without args, and only the flags the user typed: the same model and weights."""
    from mtds.megatron import dist_ckpt, keys
    from mtds.checkpoint.reader import open_checkpoint
    root, _ = megatron_lm
    for name, (argv, *_ ) in INTO_MTDS.items():
        tag = dist_ckpt.resolve_dir(str(root / name))
        shapes = dist_ckpt.tensor_shapes(tag)
        tensors = dist_ckpt.load_tensors(tag, {k: v for k, v in shapes.items() if k.startswith(keys.MODEL_PREFIXES)})
        bare = str(tmp_path / f"{name}_bare")
        dist_ckpt.write(bare, 1, tensors, {"iteration": 1})                 # no args anywhere
        _convert("megatron-to-mtds", "--load", bare, *argv, "--out", str(tmp_path / f"{name}_flags"))
        if not (root / f"{name}_plain").exists():
            _convert("megatron-to-mtds", "--load", str(root / name), "--out", str(root / f"{name}_plain"))
        want, have = open_checkpoint(str(root / f"{name}_plain")), open_checkpoint(str(tmp_path / f"{name}_flags"))
        assert have.cfg == want.cfg, (name, have.cfg, want.cfg)
        a, b = dict(want.layers()), dict(have.layers())
        assert a.keys() == b.keys() and all(torch.equal(a[k][n], b[k][n]) for k in a for n in a[k]), name


def test_defaults_table_matches_megatron_lms_parser(megatron_lm):
    from mtds.megatron.args import ALIASES, DEFAULTS, megatron_lm_args
    root, _ = megatron_lm
    with open(root / "defaults.json") as f:
        parsed = json.load(f)
    parsed.update({name: parsed[alias] for alias, name in ALIASES.items() if alias in parsed})
    it = iter(GPT2)
    typed = {a.lstrip("-").replace("-", "_"): int(v) for a, v in zip(it, it)}
    ours = megatron_lm_args(typed)
    checked = [k for k in DEFAULTS if k not in typed and k != "ffn_hidden_size"]   # FFN: read off the weights
    assert len(checked) >= 18
    differ = {k: (ours[k], parsed.get(k, "<absent>")) for k in checked if parsed.get(k, "<absent>") != ours[k]}
    assert not differ, differ


def test_mtds_export_loads_in_megatron_lm(megatron_lm):
    root, ref = megatron_lm
    got = _gather(spawn(_mtds_eval, 2, [("export", str(root / "export_mtds"), [(2, 1)])], timeout=300))
    mine, theirs = got[("export", 2, 1)][1], ref["export/logits"]
    assert theirs.shape == mine.shape and float(mine.abs().max()) > 0.05
    assert _err(theirs, mine) < TOL, _err(theirs, mine)
    assert abs(float(ref["export/loss"].double().mean()) - got[("export", 2, 1)][0]) < TOL


def test_transformer_engine_extra_state_is_not_read_and_a_hostile_common_state_is_refused(megatron_lm, tmp_path):
    """Transformer Engine's ``_extra_state`` objects (pickles naming TE's classes; here one that would call
    os.system) are never unpickled; the common state is read by torch's weights_only unpickler, which
    refuses os.system by name before anything runs."""
    from mtds.megatron import dist_ckpt, keys
    from tests.test_megatron_checkpoints import _one_error_line
    from tests.test_convert import _cli
    root, _ = megatron_lm
    tag = dist_ckpt.resolve_dir(str(root / "llama"))
    shapes = dist_ckpt.tensor_shapes(tag)
    tensors = dist_ckpt.load_tensors(tag, {k: v for k, v in shapes.items() if k.startswith(keys.MODEL_PREFIXES)})
    marker = tmp_path / "ran"

    class Hostile:
        def __reduce__(self):
            return os.system, (f"touch {marker}",)
    extra = {f"{keys.LAYERS}{m}._extra_state/shard_{i}_2": Hostile() for i in range(2)
             for m in ("self_attention.linear_qkv", "mlp.linear_fc1")}
    args = argparse.Namespace(**{k: v for k, v in _exported_args(str(root / "llama")).items()
                                 if isinstance(v, (bool, int, float, str, type(None)))})
    dist_ckpt.write(str(tmp_path / "te"), 1, tensors, {"iteration": 1, "args": args}, extra, common_inside=True)
    assert not os.path.exists(os.path.join(tmp_path, "te", "iter_0000001", "common.pt"))
    _convert("megatron-to-mtds", "--load", str(tmp_path / "te"), "--out", str(tmp_path / "out"))
    args.hostile = Hostile()
    dist_ckpt.write(str(tmp_path / "bad"), 1, tensors, {"iteration": 1, "args": args}, common_inside=True)
    _one_error_line(_cli("megatron-to-mtds", "--load", str(tmp_path / "bad"), "--out", str(tmp_path / "x")),
                    "unsupported GLOBAL posix.system")
    assert not marker.exists()
