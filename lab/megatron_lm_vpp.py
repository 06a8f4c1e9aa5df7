"""By-hand check (not in the suite: 4 ranks of Megatron-LM cost ~45 CPU-s): a checkpoint Megatron-LM 0.19
saves at tp 2 x pp 2 with virtual pipeline chunks (4 layers, one per virtual stage) after one training step
under the distributed optimizer converts with no model flags, and mtds.eval's loss and logits at (2,1) and
(1,1) equal Megatron-LM's own within 1e-5.

    MTDS_MEGATRON_LM=.venv/megatron-lm-0.19 python -m lab.megatron_lm_vpp [WORKDIR]
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist

TOL = 1e-5
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IDS = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(7))
ARGV = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--max-position-embeddings", "32",
        "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
        "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--group-query-attention",
        "--num-query-groups", "2", "--ffn-hidden-size", "192", "--use-distributed-optimizer",
        "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "2", "--vocab-size", "128",
        "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
        "--num-layers-per-virtual-pipeline-stage", "1", "--lr", "1e-2", "--train-iters", "10", "--seed", "1234"]


def _eval(ck: str, layouts) -> dict:
    from mtds.checkpoint.reader import open_checkpoint
    from mtds.eval import build_eval_model, evaluate, full_logits
    from mtds.parallel.layout import ParallelLayout
    from mtds.training.distributed import init_distributed
    init_distributed()
    cfg, out = open_checkpoint(ck).cfg, {}
    for t, p in layouts:
        groups = ParallelLayout.for_world(dist.get_world_size(), tp=t, pp=p).build_groups()
        model = build_eval_model(cfg, groups, ckpt=ck)
        out[(t, p)] = (evaluate(model, IDS.tolist(), cfg, groups)["loss"], full_logits(model, IDS[:, :-1], cfg, groups))
    return out


def main(work: str) -> int:
    from lab.testing import spawn
    from mtds.cli.convert import main as convert
    megatron_lm = os.environ.get("MTDS_MEGATRON_LM") or os.path.join(sys.prefix, "megatron-lm-0.19")
    job = {"world": 4, "ids": IDS.tolist(), "out": os.path.join(work, "megatron.pt"),
           "save": [{"key": "vpp", "root": os.path.join(work, "megatron"), "argv": ARGV, "train_step": True,
                     "micro": 1}]}
    with open(os.path.join(work, "job.json"), "w") as f:
        json.dump(job, f)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([megatron_lm, REPO]), "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "lab.megatron_lm", os.path.join(work, "job.json")], cwd=REPO, env=env,
                   check=True, capture_output=True)
    ref = torch.load(job["out"], weights_only=True)
    ck = os.path.join(work, "mtds")
    convert(["megatron-to-mtds", "--load", os.path.join(work, "megatron"), "--tp", "1", "--pp", "2", "--out", ck])
    got = {}
    for results in spawn(_eval, 2, ck, [(2, 1), (1, 1)], timeout=300):
        got.update({k: v for k, v in results.items() if v[1] is not None})
    loss, logits, worst = float(ref["vpp/loss"].double().mean()), ref["vpp/logits"], 0.0
    for (t, p), (mine, mine_logits) in sorted(got.items()):
        err = max(abs(mine - loss), float((mine_logits - logits).abs().max()))
        worst = max(worst, err)
        print(f"({t},{p}): loss {mine:.7f} vs Megatron-LM {loss:.7f}; max |loss or logit difference| {err:.2e}")
    return 0 if got and worst < TOL else 1


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else tmp))
