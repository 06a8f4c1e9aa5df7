"""The rulebook (mtds.rules): every rule's one line; train.py's start-up (mtds.training.admit, run up to where it
would build the model) and the planner (mtds.plan.runnable) accept the same jobs over a grid of layouts,
schedules, ZeRO stages, precisions and models; docs/bad_input.md's table is the rulebook's. A refused job on four
ranks is one line: tests/test_cli.py::test_a_refused_job_on_two_ranks_is_one_line."""
import collections
import dataclasses
import itertools
import os

import pytest

from mtds import rules
from mtds.rules import Job, ModelFacts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DENSE = ModelFacts(num_layers=4, hidden_size=64, num_heads=4, kv_heads=4, ffn_size=256)
MOE = dataclasses.replace(DENSE, num_experts=4, moe_ffn_size=96, moe_blocks=(0, 1, 2, 3))

# rule -> (a job breaking it and no other rule, the part of its line a user must read)
RULE_CASES = {
    "schedule-known": (Job(DENSE, 2, pp=2, pipeline_schedule="gpipe"),
                       "unknown --pipeline-schedule 'gpipe': choose one of 1f1b, interleaved, zb-h1, dualpipev"),
    "schedule-chunks": (Job(DENSE, 2, pp=2, pipeline_schedule="zb-h1", virtual_stages=2),
                        "--pipeline-schedule zb-h1 runs one chunk per rank: leave --virtual-stages at 1"),
    "compile-schedule": (Job(DENSE, 2, pp=2, pipeline_schedule="zb-h1", compile=True),
                         "--compile cannot compile the layers of --pipeline-schedule zb-h1"),
    "grid": (Job(DENSE, 1, tp=2, pp=2), "world size 1 is not divisible by tp*pp = 2*2 = 4"),
    "router-flags": (Job(DENSE, 1, moe_capacity=True),
                     "--moe-expert-capacity-factor needs a mixture-of-experts model"),
    "seq-aux-loss": (Job(MOE, 2, pp=2, moe_seq_aux=True),
                     "--moe-router-load-balancing-type seq_aux_loss with --pp 2 is not built yet"),
    "model-shards": (Job(DENSE, 3, tp=3), "tensor parallel size 3 does not divide the 4 attention heads: "
                                          "choose --tp from 1, 2, 4"),
    "experts-split": (Job(dataclasses.replace(MOE, num_experts=3), 2, ep=2),
                      "--expert-model-parallel-size 2 does not divide the model's 3 experts"),
    "sequence-parallel": (Job(DENSE, 2, tp=2, sequence_parallel=True, seq_length=33),
                          "--sequence-parallel needs --seq-length divisible by --tp 2, got 33"),
    "cp-shapes": (Job(DENSE, 2, cp=2, seq_length=6), "--context-parallel-size 2 needs --seq-length divisible by "
                                                      "2*C = 4"),
    "cp-features": (Job(dataclasses.replace(DENSE, sliding_window=16), 2, cp=2),
                    "a sliding attention window (16) with --cp 2 is not supported yet"),
    "pipeline-layout": (Job(DENSE, 2, pp=2, pipeline_layout="Et*2|t*3L"),
                        "holds 5 transformer blocks but the model has 4"),
    "zero-stage": (Job(DENSE, 1, zero_stage=4), "zero_optimization.stage must be 0-3, got 4"),
    "zero-pipeline": (Job(DENSE, 2, pp=2, zero_stage=3, precision="bf16"),
                      "ZeRO-3 with --pp 2 in bf16 accumulates its gradients in fp32 (DeepSpeed's BF16_Optimizer): "
                      "set data_types.grad_accum_dtype to \"fp32\""),
    "one-precision": (Job(DENSE, 1, both_precisions=True), "enables both fp16 and bf16: keep one"),
    "batch": (Job(DENSE, 1, global_batch=10, micro_batch=4),
              "train_batch_size 10 is not divisible by micro batch 4 x data parallel size 1: use a multiple of 4"),
    "micro-batches": (Job(DENSE, 2, pp=2, pipeline_schedule="dualpipev", global_batch=12, micro_batch=4),
                      "dualpipev needs at least 2 x pp = 4 micro-batches per step, got 3: use --global-batch-size "
                      "16, which makes the micro-batches per step 4"),
    "weight-pass-hooks": (Job(DENSE, 2, pp=2, pipeline_schedule="zb-h1", zero_overlap_comm=True),
                          "--pipeline-schedule zb-h1 cannot use zero_optimization.overlap_comm"),
    "deepspeed-range": (Job(DENSE, 2, pp=2, pipeline_schedule="dualpipev", deepspeed_version="0.20.1"),
                        "DeepSpeed 0.20.1 is outside the range mtds's pipeline schedules are built on"),
    "expert-parallel-zero": (Job(MOE, 2, ep=2, precision="bf16"),
                             "--expert-model-parallel-size 2 with bf16 needs ZeRO-1 or 2"),
    "overlap-comm": (Job(MOE, 2, ep=2, moe_overlap_comm=True),
                     "--overlap-moe-expert-parallel-comm overlaps an MoE block's dispatch all-to-all with its shared "
                     "expert, or on --pipeline-schedule dualpipev one chunk's all-to-alls with the other chunk's "
                     "compute: it needs --expert-model-parallel-size > 1"),
    "dualpipev-overlap": (Job(MOE, 8, tp=2, pp=2, ep=2, pipeline_schedule="dualpipev", moe_overlap_comm=True),
                          "--overlap-moe-expert-parallel-comm on dualpipev (one chunk's forward beside the other's "
                          "backward, on two threads) with --tp 2 --context-parallel-size 1 is not built"),
    "expert-width": (Job(dataclasses.replace(MOE, moe_ffn_size=98), 4, tp=4),
                     "tensor parallel size 4 does not divide the expert FFN size 98"),
    "async-save-needs-save": (Job(DENSE, 1, async_save=True), "--async-save without --save"),
}


def test_every_rule_has_its_line():
    assert set(RULE_CASES) == {rule.name for rule in rules.ALL_RULES}
    for name, (job, line) in RULE_CASES.items():
        found = rules.problems(job)
        assert [p.rule for p in found] == [name], (name, found)
        assert line in found[0].message and "\n" not in found[0].message, (name, found[0].message)
        with pytest.raises(rules.JobRefused) as refused:
            rules.check(job, rules.ALL_RULES)
        assert str(refused.value) == found[0].message and refused.value.same_on_every_rank


def test_eval_takes_moe_pipelines_and_converters_the_shards():
    # evaluation carries no router statistics (the LM loss only): any p, any schedule flag left at its default
    assert rules.problems(Job(MOE, 2, pp=2, purpose=rules.EVAL)) == []
    # training carries the router statistics, and the packed documents' ids, on every schedule
    # (tests/test_moe_schedules.py)
    for schedule in ("1f1b", "interleaved", "zb-h1", "dualpipev"):
        v = 2 if schedule == "interleaved" else 1
        for model, documents in ((MOE, {}), (MOE, dict(reset_position_ids=True, reset_attention_mask=True)),
                                 (DENSE, dict(reset_attention_mask=True))):
            job = Job(model, 4, pp=2, ep=2 if model is MOE else 1, pipeline_schedule=schedule, virtual_stages=v,
                      **documents)
            assert rules.problems(job) == [], (schedule, documents)
    with pytest.raises(rules.JobRefused, match="does not divide the expert FFN size 98"):
        rules.check_shards(dataclasses.replace(MOE, moe_ffn_size=98), tp=4, pp=1)
    rules.check_shards(DENSE, tp=2, pp=2)


def test_moe_with_context_parallelism():
    """MoE models train with --cp > 1 (ring and Ulysses; with experts split over d·c; on a pipeline,
    tests/test_moe_families.py); with a capacity factor or in mtds-eval they are refused; e divides d·c, not d
    alone."""
    assert rules.problems(Job(MOE, 2, cp=2)) == []
    assert rules.problems(Job(MOE, 2, cp=2, cp_comm_type="a2a", moe_z_loss=True)) == []
    assert rules.problems(Job(MOE, 4, cp=2, ep=4)) == []         # e over d·c = 2·2
    for schedule in ("1f1b", "zb-h1"):
        assert rules.problems(Job(MOE, 4, cp=2, pp=2, pipeline_schedule=schedule)) == [], schedule
    for job, line in ((Job(MOE, 2, cp=2, purpose=rules.EVAL), "mtds-eval of a mixture-of-experts model with --cp 2"),
                      (Job(MOE, 2, cp=2, moe_capacity=True), "--moe-expert-capacity-factor with --cp 2 is not "
                                                                 "built"),
                      (Job(MOE, 6, cp=3, ep=4), "--expert-model-parallel-size 4 does not divide d·c = 2·3 = 6"),
                      (Job(dataclasses.replace(MOE, attention_sinks=True), 2, cp=2), "attention sinks (GPT-OSS) with "
                                                                                     "--cp 2 are not built"),
                      (Job(MOE, 2, cp=2, moe_seq_aux=True), "seq_aux_loss with --cp 2 is not built yet")):
        assert [p.message for p in rules.problems(job)] and line in rules.problems(job)[0].message, (job, line)


def test_micro_batches_come_from_the_batch_as_the_config_states_it():
    """m = B / (b d); a config without train_batch_size states m itself (gradient_accumulation_steps, else 1)."""
    dualpipev = dict(pp=2, pipeline_schedule="dualpipev", micro_batch=2)
    for given, m in ((dict(global_batch=6), 3), (dict(accumulation=3), 3), ({}, 1), (dict(global_batch=16), None)):
        found = rules.problems(Job(DENSE, 2, **dualpipev, **given))
        assert [p.message for p in found] == ([] if m is None else [
            f"dualpipev needs at least 2 x pp = 4 micro-batches per step, got {m}: use --global-batch-size 8, which "
            f"makes the micro-batches per step 4"]), (given, found)


def test_the_rulebook_is_torch_free():
    import subprocess
    import sys
    code = ("import sys, mtds.rules, mtds.plan.runnable; "
            "print(sorted(m for m in ('torch', 'deepspeed') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_bad_input_doc_holds_the_rulebook():
    doc = open(os.path.join(ROOT, "docs", "bad_input.md")).read()
    assert rules.markdown_table() in doc, "docs/bad_input.md: paste `python -m mtds.rules` in its rulebook section"


# ---- the grid: train.py's start-up and the planner accept the same jobs ---------------------------------------
SCHEDULES = ("1f1b", "interleaved", "zb-h1", "dualpipev")
# bf16 as the shipped configs (ds_configs/cpu_bf16.json, ptdp_bf16.json) and the planner have it: fp32 accumulation
PRECISIONS = {"fp32": {}, "bf16": {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}},
              "fp16": {"fp16": {"enabled": True}}}


def _models():
    from mtds.model.config import PRESETS, ModelConfig
    dense = PRESETS["gpt2-tiny"]
    moe = ModelConfig(vocab_size=8192, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                      ffn_hidden_size=128, max_position_embeddings=256, position_embedding="rotary",
                      normalization="rmsnorm", activation="swiglu", qkv_bias=False, linear_bias=False,
                      tie_word_embeddings=False, architecture="mixtral", num_experts=4, moe_top_k=2,
                      moe_ffn_hidden_size=64)
    # experts in the last two blocks only: at p = 2 the first stage holds none (the partition rule)
    late = dataclasses.replace(moe, architecture="qwen3_moe", mlp_only_layers=(0, 1))
    return {"dense": dense, "moe": moe, "moe-late": late}


def grid():
    """(t, c, p, d) in {1, 2}^4 x every schedule x ZeRO 0-3 x EP {1, 2} x SP x dense/MoE/late MoE x precision."""
    for (t, c, p, d), schedule, zero, ep, sp, model, precision in itertools.product(
            itertools.product((1, 2), repeat=4), SCHEDULES, range(4), (1, 2), (False, True),
            ("dense", "moe", "moe-late"), PRECISIONS):
        yield dict(t=t, c=c, p=p, d=d, schedule=schedule, zero=zero, ep=ep, sp=sp, model=model, precision=precision)


def _trainer_accepts(case, models, device) -> tuple[bool, str]:
    """train.py's start-up, up to where it would build the model: the flags, the DeepSpeed config, the admission."""
    from mtds.training.admit import admit
    from mtds.training.config import TrainConfig
    ds = {"train_micro_batch_size_per_gpu": 1, "train_batch_size": 8 * case["d"],
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": case["zero"]}, **PRECISIONS[case["precision"]]}
    v = 2 if case["schedule"] == "interleaved" else 1
    cfg = TrainConfig(deepspeed_config=ds, tp=case["t"], pp=case["p"], context_parallel_size=case["c"],
                      expert_model_parallel_size=case["ep"], sequence_parallel=case["sp"],
                      pipeline_schedule=case["schedule"], virtual_stages=v, model=models[case["model"]], seq_length=64)
    try:
        admit(cfg, case["t"] * case["c"] * case["p"] * case["d"], models[case["model"]], device)
    except rules.JobRefused as err:
        return False, str(err)
    return True, ""


def _planner_accepts(case, specs, capacity) -> tuple[bool, list[str]]:
    from mtds.plan import Candidate, Workload
    from mtds.plan.runnable import rule_problems
    v = 2 if case["schedule"] in ("interleaved", "dualpipev") else 1
    layout = Candidate(case["t"], case["p"], case["d"], 1, virtual_stages=v, zero_stage=case["zero"],
                       recompute="none", sequence_parallel=case["sp"], pipeline_schedule=case["schedule"],
                       cp=case["c"], ep=case["ep"])
    found = rule_problems(specs[case["model"]], layout, Workload(8 * case["d"], precision=case["precision"]),
                          capacity)
    return not found, [p.message for p in found]


def test_the_planner_runs_what_train_py_starts(monkeypatch):
    """For 9,216 job descriptions (no training): the planner's runnable set is the set train.py's start-up
    admits, and where both refuse, train.py's line is the planner's first."""
    import torch
    from deepspeed.accelerator import get_accelerator

    from mtds.plan import ModelSpec
    from mtds.training.stage_plan import device_memory_bytes
    monkeypatch.setattr(get_accelerator(), "is_fp16_supported", lambda: True)     # as a GPU says: not a rule
    models = _models()
    specs = {name: ModelSpec.from_config(cfg, seq=64) for name, cfg in models.items()}
    device = torch.device("cpu")
    capacity = device_memory_bytes(device)
    cases, admitted, differ, refused_by = 0, 0, [], collections.Counter()
    for case in grid():
        trainer, line = _trainer_accepts(case, models, device)
        planner, reasons = _planner_accepts(case, specs, capacity)
        cases, admitted = cases + 1, admitted + trainer
        refused_by[line.split(" ")[0] if line else "admitted"] += 1
        if trainer != planner or (not trainer and reasons[0] != line):
            differ.append((case, line, reasons))
    assert cases == 9216 and not differ, (len(differ), differ[:5])
    assert 500 < admitted < cases - 500, admitted       # both sides of the line are exercised
    print(refused_by)


def test_zero_on_a_pipeline_refuses_offloading():
    """ZeRO-2/3 at p > 1 run on DeepSpeed's stage-1 optimizer with mtds's reduction: offloading is refused, not
    ignored (``zero-pipeline``); at p = 1 DeepSpeed offloads."""
    job = Job(DENSE, 4, pp=2, zero_stage=3, zero_offload=True)
    assert [p.rule for p in rules.problems(job)] == ["zero-pipeline"]
    assert "offloading is not built there" in rules.problems(job)[0].message
    assert not rules.problems(dataclasses.replace(job, pp=1))
