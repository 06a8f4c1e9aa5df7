"""mtds logits and `mtds-eval` loss equal HF's (fp32, 1e-5) for GPT-2, GPT-NeoX and Llama at
(t, p) in {(1,1), (2,1), (1,2), (2,2), (4,1)}, from HF weights and from mtds checkpoints saved at another
layout. The vocabulary (250) is not divisible by 128*t and each of the 2 stages holds 1 (odd) block.
A Mixtral (every block MoE) at (t, p) = (1, 2) and (2, 2), from HF weights and from a checkpoint: the same.
Context parallelism (--cp 2) on the Llamas at c = 2 and t = 2 x c = 2 (both comm types) and c = 2 x p = 2 (a2a):
rows of 5, 17, 9 and 2 tokens are padded to a multiple of 2c = 4, and the loss and the gathered logits still
equal HF's.
"""
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from lab.testing import needs_ranks, spawn
from tests.test_hf_cases import VOCAB, hf_model

TOL = 1e-5
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# world size -> layouts; llama_t4 (8 heads, 4 kv heads) where t = 4 must divide the kv heads.
LAYOUTS = {1: [(1, 1)], 2: [(2, 1), (1, 2)], 4: [(2, 2), (4, 1)]}
NAMES = {1: ("gpt2", "neox", "llama"), 2: ("gpt2", "neox", "llama", "mixtral"), 4: ("gpt2", "neox", "llama_t4", "mixtral")}
# a Mixtral (4 experts, top-2) on pipelines only: evaluation carries no router statistics between stages
MOE_LAYOUTS = {2: [(1, 2)], 4: [(2, 2)]}
# world -> (t, c, p, comm, source) evaluated on the Llama of that world (a2a: its heads per TP rank divide by c)
CP_LAYOUTS = {1: [], 2: [(1, 2, 1, "p2p", "hf"), (1, 2, 1, "a2a", "ckpt")],
              4: [(2, 2, 1, "p2p", "ckpt"), (2, 2, 1, "a2a", "hf"), (1, 2, 2, "a2a", "ckpt")]}


def rows():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 17, 9, 32, 2)]


def hf_reference(hf, rows_):
    """(mean next-token loss over all tokens, token count) of the HF model."""
    total, count = 0.0, 0
    with torch.no_grad():
        for row in rows_:
            ids = torch.tensor([row])
            total += hf(ids, labels=ids).loss.item() * (len(row) - 1)
            count += len(row) - 1
    return total / count, count


def _split_spec_matches(model, cfg):
    """mtds.checkpoint.shard_spec's table agrees with the attributes the tp layers put on real parameters."""
    from mtds.hf.init import stage_modules
    from mtds.checkpoint.shard_spec import split_of
    for layer, module in stage_modules(model, cfg).items():
        for name, p in module.named_parameters():
            s = split_of(cfg, layer, name)
            sharded = getattr(p, "tensor_model_parallel", False)
            if dist.get_world_size() > 1 and sharded:
                assert s.dim == p.partition_dim and s.segments == p.partition_segments, (layer, name)
            if not sharded:
                assert s.dim is None, (layer, name)


def _rank_parity(root: str, world: int):
    from mtds.cli.convert import main as convert
    from mtds.eval import build_eval_model, evaluate, full_logits
    from mtds.hf.init import hf_model_config
    from mtds.parallel.layout import ParallelLayout
    from mtds.training.distributed import init_distributed
    init_distributed()
    out = {}
    data = rows()
    for name in NAMES[world]:
        hf = hf_model(name)
        hf_dir, ck_dir = os.path.join(root, name, "hf"), os.path.join(root, name, f"ck{world}")
        if dist.get_rank() == 0:
            hf.save_pretrained(hf_dir)
            # A checkpoint at a different layout than the ones evaluated below: weights reshard on load.
            convert(["hf-to-mtds", "--hf", hf_dir, "--tp", "2" if world == 1 else "1", "--pp", "1",
                     "--out", ck_dir])
        dist.barrier()
        cfg = hf_model_config(hf_dir)
        ref_loss, ref_tokens = hf_reference(hf, data)
        ids = torch.tensor([data[3]])
        with torch.no_grad():
            ref_logits = hf(ids).logits
        for t, p in MOE_LAYOUTS[world] if name == "mixtral" else LAYOUTS[world]:
            groups = ParallelLayout.for_world(world, tp=t, pp=p).build_groups()
            for source in ("hf", "ckpt"):
                model = build_eval_model(cfg, groups, hf=hf_dir) if source == "hf" else \
                    build_eval_model(cfg, groups, ckpt=ck_dir)
                _split_spec_matches(model, cfg)
                logits = full_logits(model, ids, cfg, groups)
                result = evaluate(model, data, cfg, groups)
                out[(name, t, p, source)] = {
                    "logits": None if logits is None else float((logits.cpu() - ref_logits).abs().max()),
                    "loss": abs(result["loss"] - ref_loss), "tokens": (result["tokens"], ref_tokens)}
        for t, c, p, comm, source in CP_LAYOUTS[world] if name.startswith("llama") else ():
            groups = ParallelLayout.for_world(world, tp=t, pp=p, cp=c).build_groups()
            model = build_eval_model(cfg, groups, cp_comm_type=comm, **{source: hf_dir if source == "hf" else ck_dir})
            logits = full_logits(model, ids, cfg, groups)
            result = evaluate(model, data, cfg, groups)
            out[(name, t, f"p{p} cp{c} {comm}", source)] = {
                "logits": None if logits is None else float((logits.cpu() - ref_logits).abs().max()),
                "loss": abs(result["loss"] - ref_loss), "tokens": (result["tokens"], ref_tokens)}
    return out


@pytest.mark.parametrize("world", sorted(LAYOUTS))
def test_logits_and_loss_match_hf(tmp_path, world):
    per_rank = spawn(_rank_parity, world, str(tmp_path), world, timeout=600)
    checked_logits = set()
    for results in per_rank:
        for key, r in results.items():
            assert r["loss"] < TOL, (key, r)
            assert r["tokens"][0] == r["tokens"][1], (key, r)
            if r["logits"] is not None:     # last pipeline stage
                assert r["logits"] < TOL, (key, r)
                checked_logits.add(key)
    assert len(checked_logits) == len(per_rank[0])   # every case compared its logits somewhere


def test_eval_cp_flags_and_refusals():
    """--cp/--context-parallel-size and --cp-comm-type as train.py spells them; what the rulebook refuses of the
    layout, one line, for the longest row once padded (dropout, off in evaluation, is not refused); rows padded
    past the learned positions."""
    import argparse

    from mtds.cp import ContextParallelError
    from mtds.eval import admit_eval, build_parser, padded_length
    from mtds.model.config import ModelConfig
    from mtds.rules import JobRefused
    base = ["--hf", "d", "--data", "x"]
    args = build_parser().parse_args(base)
    assert (args.context_parallel_size, args.cp_comm_type) == (1, "p2p")
    args = build_parser().parse_args(base + ["--context-parallel-size", "4", "--cp-comm-type", "a2a"])
    assert (args.context_parallel_size, args.cp_comm_type) == (4, "a2a")
    assert [padded_length(n, 2) for n in (2, 5, 8, 9)] == [4, 8, 8, 12] and padded_length(5, 1) == 5
    llama = ModelConfig(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                        position_embedding="rotary", max_position_embeddings=32, hidden_dropout=0.1)
    gpt2 = ModelConfig(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=4, max_position_embeddings=30)
    rows_ = [[1] * 30, [2] * 5]

    def flags(cp, comm, tp=1, pp=1):
        return argparse.Namespace(tp=tp, pp=pp, context_parallel_size=cp, cp_comm_type=comm)
    assert admit_eval(flags(2, "a2a"), llama, 2, rows_).cp == 2          # dropout: no refusal
    assert admit_eval(flags(3, "p2p"), gpt2, 3, rows_).cp == 3           # 30 needs no padding at 2c = 6
    from mtds.hf import model_config_from_hf
    from tests.test_hf_cases import hf_config
    mixtral = model_config_from_hf(hf_config("mixtral"))
    assert admit_eval(flags(1, "p2p", tp=2, pp=2), mixtral, 4, rows_).pp == 2     # MoE pipelines evaluate
    for args_, cfg, world, error, message in [
            (flags(4, "a2a"), llama, 4, JobRefused, "--cp-comm-type a2a needs the 4 query heads per TP rank and 2 "
                                                    "key/value heads per TP rank divisible by C=4"),
            (flags(2, "p2p"), gpt2, 2, ContextParallelError, "--cp 2 pads rows to a multiple of 2*C = 4: a row of 32 "
                                                             "tokens exceeds the model's 30 learned positions: use "
                                                             "--seq-length 28"),
            (flags(1, "p2p", tp=3), gpt2, 3, JobRefused, "tensor parallel size 3 does not divide the 4 attention "
                                                         "heads")]:
        with pytest.raises(error) as err:
            admit_eval(args_, cfg, world, rows_)
        assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_eval_cli_under_torchrun(tmp_path):
    """The user's path: convert at (2,2), evaluate the checkpoint at (1,2) via torchrun."""
    needs_ranks(2)      # a launcher starts 2 ranks: under MTDS_TEST_DEVICE=cuda, one GPU each
    from mtds.cli.convert import main as convert
    hf = hf_model("llama")
    hf.save_pretrained(tmp_path / "hf")
    convert(["hf-to-mtds", "--hf", str(tmp_path / "hf"), "--tp", "2", "--pp", "2", "--out", str(tmp_path / "ck")])
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows()))
    ref_loss, ref_tokens = hf_reference(hf, rows())
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])), "OMP_NUM_THREADS": "1"}
    from lab.testing import free_port
    from mtds.local_ranks.rank_setup import PORT_IN_USE
    for source, t, p in ((["--ckpt", str(tmp_path / "ck")], 1, 2),):
        for _ in range(3):      # the free port can be taken before torchrun binds it (another process's socket)
            proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                                   "--master_port", str(free_port()), "-m", "mtds.eval", *source, "--tp", str(t),
                                   "--pp", str(p), "--data", str(data)],
                                  capture_output=True, text=True, env=env, timeout=300)
            if PORT_IN_USE not in proc.stderr:
                break
        assert proc.returncode == 0, proc.stderr[-3000:]
        result = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
        assert abs(result["loss"] - ref_loss) < TOL and result["tokens"] == ref_tokens, (result, ref_loss)
    # Bad input: one line, non-zero exit (single process, no launcher needed).
    proc = subprocess.run([sys.executable, "-m", "mtds.eval", "--ckpt", str(tmp_path / "ck"), "--data",
                           str(tmp_path / "missing.jsonl")], capture_output=True, text=True, env=env, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and len(errors) == 1 and "missing.jsonl" in errors[0], proc.stderr[-2000:]
