"""Unit tests of the planner's formulas, search and command line (hand-checked numbers)."""
import json

import pytest

from mtds.plan import comm
from mtds.plan.candidate import Candidate, Workload
from mtds.plan.hardware import Cluster, get_gpu
from mtds.plan.memory import activation_bytes_per_layer, model_state_bytes, predict_memory
from mtds.plan.model_spec import ModelSpec
from mtds.plan.predict import predict
from mtds.plan.search import evaluate, plan

A100 = get_gpu("A100-80GB")
GPT3 = ModelSpec(layers=96, hidden=12288, heads=96, vocab=51200, seq=2048)


def test_gpu_table_and_aliases():
    assert A100.peak_tflops == 312 and A100.gpus_per_node == 8 and A100.hbm_gib == 80
    assert get_gpu("H100").peak_tflops == 989
    assert get_gpu("V100", "fp16").peak_tflops == 125
    with pytest.raises(ValueError):
        get_gpu("V100", "bf16")
    with pytest.raises(ValueError):
        get_gpu("TPU")


def test_general_ffn_flops_match_metrics_at_4h():
    from mtds.observe import metrics

    a = ModelSpec(layers=4, hidden=256, heads=4, vocab=1000, seq=128)
    for mode in ("none", "selective", "full"):
        assert a.hardware_flops(8, mode) == pytest.approx(metrics.hardware_flops_per_iteration(8, 128, 4, 256, 1000, mode))
    # general path (f = 4h + 1): one extra MLP column adds 2 matmuls x 2 FLOPs x h per token-layer, x3 passes
    b = ModelSpec(layers=4, hidden=256, heads=4, vocab=1000, seq=128, ffn_hidden=1025)
    ref = metrics.model_flops_per_iteration(8, 128, 4, 256, 1000)
    assert b.model_flops(8) == pytest.approx(ref + 3 * 8 * 128 * 4 * (4 * 256))
    full_ref = metrics.hardware_flops_per_iteration(8, 128, 4, 256, 1000, "full")
    assert b.hardware_flops(8, "full") == pytest.approx(full_ref + 4 * 8 * 128 * 4 * (4 * 256))


def test_vocab_padding():
    assert GPT3.padded_vocab(1) == 51200
    assert ModelSpec(2, 64, 4, 50257, 128).padded_vocab(8) == 51200   # ceil(50257/1024)*1024


def test_zero_model_state_bytes():
    # ZeRO paper Section 3.1 / Fig. 1: Psi=7.5B, d=64 -> 120 GB baseline, 31.4 GB P_os, 16.6 GB P_os+g, 1.9 GB P_os+g+p
    psi, work = 7.5e9, Workload(64)
    totals = [sum(model_state_bytes(psi, Candidate(1, 1, 64, 1, zero_stage=z), work)) / 1e9 for z in range(4)]
    assert totals == pytest.approx([120.0, 31.4, 16.6, 1.875], rel=0.01)


def test_korthikanti_activation_formulas():
    m = ModelSpec(layers=1, hidden=12288, heads=96, vocab=51200, seq=2048)
    w = Workload(1)
    sbh = 2048 * 12288
    lay = lambda **kw: Candidate(8, 1, 1, 1, **kw)
    attn = 5 * 96 * 2048 / (12288 * 8)
    assert activation_bytes_per_layer(m, lay(recompute="none"), w) == pytest.approx(sbh * (10 + 24 / 8 + attn))
    assert activation_bytes_per_layer(m, lay(recompute="none", sequence_parallel=True), w) == \
        pytest.approx(sbh * (34 / 8 + attn))
    assert activation_bytes_per_layer(m, lay(recompute="selective", sequence_parallel=True), w) == \
        pytest.approx(sbh * 34 / 8)
    assert activation_bytes_per_layer(m, lay(recompute="full"), w) == pytest.approx(2 * sbh)


def test_ring_collective_costs():
    # 8 GPUs in one node: 2*(7/8)*1 GB / (300 GB/s * 0.77) + 14 * 5 us
    c = Cluster(A100, 8)
    assert comm.all_reduce(1e9, 8, 1, c) == pytest.approx(2 * 7 / 8 * 1e9 / 231e9 + 14 * 5e-6)
    # a 2-rank group with stride 8 spans two nodes: InfiniBand, 25 GB/s * 0.9
    c16 = Cluster(A100, 16)
    assert comm.all_gather(1e9, 2, 8, c16) == pytest.approx(0.5e9 / 22.5e9 + 5e-6)
    assert comm.all_reduce(1e9, 1, 1, c) == 0.0


def test_bubble_shrinks_with_virtual_stages():
    work, cluster = Workload(64), Cluster(A100, 64)
    base = dict(tp=8, pp=8, dp=1, microbatch=1, recompute="full")
    p1 = predict(GPT3, Candidate(**base, virtual_stages=1), work, cluster)
    p4 = predict(GPT3, Candidate(**base, virtual_stages=4), work, cluster)
    # bubble = (p-1)/v of one microbatch's stage time: ratio exactly 4
    assert p1.time_breakdown_s["bubble"] / p4.time_breakdown_s["bubble"] == pytest.approx(4.0)
    assert p4.time_breakdown_s["pp_comm"] > p1.time_breakdown_s["pp_comm"]
    m = 64
    # compute also carries the last stage's logits and the optimizer step, which the bubble does not
    assert p1.time_breakdown_s["bubble"] / (p1.time_breakdown_s["compute"] + p1.time_breakdown_s["tp_comm"]) == \
        pytest.approx(7 / m, rel=0.08)


def test_prediction_internal_consistency():
    work, cluster = Workload(1536), Cluster(A100, 1536)
    pr = predict(GPT3, Candidate(8, 12, 16, 1, 2, 0, "full"), work, cluster)
    assert pr.step_time_s == pytest.approx(sum(pr.time_breakdown_s.values()))
    assert pr.tflops_per_gpu > pr.model_tflops_per_gpu          # full recompute executes 4/3 x
    assert pr.mfu == pytest.approx(pr.model_tflops_per_gpu / 312)
    # days ~ 8 T P / (n X) under full recompute (PTD-P Section 5.1; it drops the s/(6h) attention
    # term, 2.8% for GPT-3), X = hardware FLOP/s
    days = 8 * 300e9 * GPT3.params / (1536 * pr.tflops_per_gpu * 1e12) / 86400
    assert pr.days_to_train == pytest.approx(days * (1 + 2048 / (6 * 12288)), rel=0.01)
    assert pr.memory.total == predict_memory(GPT3, pr.layout, work, cluster).total


def test_infeasible_reasons():
    work, cluster = Workload(1536), Cluster(A100, 1536)
    pr = predict(GPT3, Candidate(8, 7, 1536 // 56, 1), work, cluster)
    assert any("t*p*d" in r for r in pr.reasons) and any("layers=96" in r for r in pr.reasons)
    pr = predict(GPT3, Candidate(1, 1, 1536, 1, zero_stage=0, recompute="none"), work, cluster)
    assert not pr.fits and any("GiB" in r for r in pr.reasons)
    pr = predict(GPT3, Candidate(8, 12, 16, 1, zero_stage=3), Workload(1536, "fp16"), cluster)   # not built: runnable,
    assert pr.feasible and pr.as_dict()["runnable"] is False                                    # not reasons
    assert any("ZeRO-3 with --pp 12 is built for fp32 and bf16" in r for r in pr.not_runnable)


def test_search_ranks_and_respects_fixed_knobs():
    model = ModelSpec(layers=24, hidden=2304, heads=24, vocab=51200, seq=2048)
    res = plan(model, Workload(512), Cluster(A100, 32), keep_infeasible=True, recompute="full", zero_stage=0)
    times = [pr.step_time_s for pr in res.feasible]
    assert times == sorted(times) and len(times) > 5
    assert all(pr.layout.recompute == "full" and pr.layout.zero_stage == 0 for pr in res.feasible)
    assert all(pr.fits for pr in res.feasible)
    assert res.infeasible and all(reasons for _, reasons in res.infeasible)
    ev = evaluate(model, Workload(512), Cluster(A100, 32), tp=1, pp=1)
    assert ev.layout.tp == 1 and ev.layout.pp == 1 and ev.layout.dp == 32 and ev.feasible


def test_selective_beats_full_recompute_korthikanti():
    # Table 5 trend: SP + selective is ~25% faster than full recompute at the same layout
    work, cluster = Workload(64), Cluster(A100, 64)
    full = predict(GPT3, Candidate(8, 8, 1, 1, 1, 0, "full"), work, cluster)
    sel = predict(GPT3, Candidate(8, 8, 1, 1, 1, 0, "selective", True), work, cluster)
    assert 0.65 < sel.step_time_s / full.step_time_s < 0.85


def _run_cli(capsys, *argv):
    from mtds.cli.plan import main

    rc = main(list(argv))
    return rc, capsys.readouterr().out


def test_cli_evaluate_json(capsys):
    rc, out = _run_cli(capsys, "--layers", "96", "--hidden", "12288", "--heads", "96", "--vocab", "51200",
                       "--seq", "2048", "--gpu", "A100-80GB", "--gpus", "1536", "--global-batch", "1536",
                       "--tp", "8", "--pp", "12", "--microbatch", "1", "--recompute", "full", "--json")
    d = json.loads(out)
    assert rc == 0
    for key in ("tflops_per_gpu", "model_tflops_per_gpu", "mfu", "step_time_s", "memory_gib_per_gpu", "fits",
                "virtual_stages", "zero_stage", "sequence_parallel", "time_breakdown_s", "memory_breakdown_gib"):
        assert key in d
    assert d["tp"] == 8 and d["pp"] == 12 and d["dp"] == 16 and d["fits"] is True
    assert 130 < d["tflops_per_gpu"] < 175


def test_cli_zero3_json(capsys):
    rc, out = _run_cli(capsys, "--layers", "96", "--hidden", "12288", "--heads", "96", "--gpus", "1536",
                       "--global-batch", "1536", "--zero-stage", "3", "--tp", "1", "--pp", "1", "--json")
    d = json.loads(out)
    assert d["zero_stage"] == 3 and d["dp"] == 1536 and d["tflops_per_gpu"] < 80


def test_cli_rank_json_and_table(capsys):
    args = ["--layers", "4", "--hidden", "256", "--heads", "4", "--vocab", "1000", "--seq", "128",
            "--gpus", "8", "--global-batch", "16"]
    rc, out = _run_cli(capsys, *args, "--json", "--top", "3", "--show-infeasible")
    d = json.loads(out)
    assert rc == 0 and len(d["layouts"]) == 3 and "infeasible" in d
    assert d["layouts"][0]["step_time_s"] <= d["layouts"][-1]["step_time_s"]
    rc, out = _run_cli(capsys, *args, "--top", "2")
    assert rc == 0 and "feasible layouts" in out


def test_cli_requires_model(capsys):
    from mtds.cli.plan import main

    with pytest.raises(SystemExit):
        main(["--gpus", "8", "--global-batch", "8"])


def test_model_from_preset():
    from mtds.plan.model_spec import resolve_model

    spec = resolve_model("gpt2-small")
    assert (spec.layers, spec.hidden, spec.heads, spec.seq) == (12, 768, 12, 1024)
    assert spec.params == pytest.approx(124.4e6, rel=2e-3)   # GPT-2 small, tied embeddings


def test_fp32_grad_accumulation_memory_and_time():
    # 16-bit training without ZeRO-2/3 keeps fp32 gradients: 2 + 4 + 12 = 18 bytes/param
    calib = A100.calibration
    states = model_state_bytes(1e9, Candidate(1, 1, 1, 1), Workload(8), calib.main_grad_bytes)
    assert sum(states) == pytest.approx(18e9)
    assert sum(model_state_bytes(1e9, Candidate(1, 1, 1, 1), Workload(8))) == pytest.approx(16e9)  # ZeRO paper
    # the unfused accumulation pass is paid once per microbatch: b=1 costs 8x the b=8 pass
    model, work, cluster = ModelSpec(8, 1024, 16, 51200, 2048), Workload(8), Cluster(A100, 1)
    small = predict(model, Candidate(1, 1, 1, 1), work, cluster).time_breakdown_s["compute"]
    big = predict(model, Candidate(1, 1, 1, 8), work, cluster).time_breakdown_s["compute"]
    from mtds.plan.compute import grad_accumulation_time
    from mtds.plan.memory import stage_params
    t_acc = grad_accumulation_time(stage_params(model, Candidate(1, 1, 1, 1), "first"), 2, 4, cluster)
    assert t_acc > 0 and small - big >= 7 * t_acc * 0.99


def _family_config(name):
    """transformers' config of a dense family (tests/test_hf_cases.py) or an MoE one (tests/test_moe.py,
    tests/test_moe_families.py: Mixtral, Qwen3-MoE, Qwen2-MoE's shared expert, DeepSeek-V3's latent attention)."""
    import transformers as T

    from tests.test_hf_cases import hf_config
    from tests.test_moe import CASES as MOE
    from tests.test_moe_families import CASES as FAMILIES
    cases = {**MOE, **FAMILIES}
    return cases[name](T) if name in cases else hf_config(name)


@pytest.mark.parametrize("name", ["gpt2", "gpt2_gelu", "neox", "llama", "llama_tied", "llama_bias",
                                  "llama_rope_linear", "qwen2", "qwen3", "mistral", "mixtral", "qwen3_moe_step",
                                  "qwen2_moe", "deepseek_v3", "deepseek_v3_plain", "gpt_oss"])
def test_model_spec_matches_real_models_of_every_family(name):
    """ModelSpec of a GPT-2 / NeoX / Llama (GQA, SwiGLU, untied, RMSNorm, bias-free) / Qwen2 (q/k/v biases
    only) / Qwen3 (q/k norm, head_dim != h / a) / Mistral / MoE (Mixtral, Qwen3-MoE with dense blocks, Qwen2-MoE's
    gated shared expert, DeepSeek-V3's latent attention with and without a Q LoRA, GPT-OSS's sinks and expert biases) config: its parameter count
    equals the HF model's and mtds's, its per-GPU count at t = 1 equals mtds's model (padded vocabulary) tensor by
    tensor, what it replicates over TP is what mtds's model does not mark tensor-parallel, and its FLOPs are the
    step log's count for that config (one function for both)."""
    import torch
    from transformers import AutoModelForCausalLM

    from mtds.observe import metrics
    from mtds.hf.registry import model_config_from_hf
    from mtds.model import GPTModel
    from mtds.plan.memory import stage_params

    hf_cfg = _family_config(name)
    cfg = model_config_from_hf(hf_cfg)
    spec = ModelSpec.from_config(cfg, seq=32)
    hf = AutoModelForCausalLM.from_config(hf_cfg)
    assert spec.params == sum(p.numel() for p in hf.parameters())
    torch.manual_seed(0)
    model = GPTModel(cfg)
    tensors = sorted(p.numel() for p in model.parameters())
    ours = sum(tensors)
    assert stage_params(spec, Candidate(1, 1, 1, 1), "first") == ours
    from mtds.plan import host_costs
    assert sorted(host_costs.param_tensor_sizes(spec)) == tensors
    whole = sum(p.numel() for n, p in model.named_parameters()
                if not getattr(p, "tensor_model_parallel", False) and "position_embeddings" not in n)
    assert whole == spec.layers * (spec.replicated_params_per_layer() + spec.expert_whole_params_per_layer()) \
        + spec.norm_params
    assert spec.hardware_flops(8, "selective") == metrics.model_config_flops(cfg, 8, 32, "selective")
    if name == "gpt2":   # PTD-P's closed form, which leaves out the final layer norm (2h)
        assert spec.params == metrics.gpt_param_count(2, 64, 250, 32) + 2 * 64


def test_grouped_query_attention_and_swiglu_in_planner_flops_and_time():
    """GQA narrows K and V: per token and layer 2 x 2h(h - h_kv) fewer forward FLOPs (x3 for an
    iteration); SwiGLU adds a third h x f matrix (2hf per token per pass). Both reach the time model."""
    mha = ModelSpec(layers=4, hidden=1024, heads=16, vocab=32000, seq=2048, ffn_hidden=2816)
    gqa = ModelSpec(**{**mha.__dict__, "kv_heads": 4})
    glu = ModelSpec(**{**mha.__dict__, "gated_mlp": True})
    tokens, h, layers = 8 * 2048, 1024, 4
    assert mha.model_flops(8) - gqa.model_flops(8) == pytest.approx(3 * tokens * layers * 4 * h * (h - h / 4))
    assert glu.model_flops(8) - mha.model_flops(8) == pytest.approx(3 * tokens * layers * 2 * h * 2816)
    work, cluster, layout = Workload(8), Cluster(A100, 8), Candidate(8, 1, 1, 1, recompute="none")
    step = {m: predict(m, layout, work, cluster).time_breakdown_s["compute"] for m in (mha, gqa, glu)}
    assert step[gqa] < step[mha] < step[glu]
    # kv heads must split over t like the query heads
    assert any("key/value heads" in r for r in predict(ModelSpec(**{**mha.__dict__, "kv_heads": 4}), layout, work,
                                               cluster).reasons)


def test_flash_attention_keeps_no_scores_so_selective_recompute_saves_nothing():
    """SDPA's flash / memory-efficient kernels (what mtds runs on every CUDA GPU) store no s x s scores:
    the 5 a s/(h t) term is gone, selective recompute saves no memory and only costs the recomputed
    attention, so the planner never prefers it there; the paper formula is kept for the math kernel."""
    from mtds.plan.search import plan
    m = ModelSpec(layers=1, hidden=12288, heads=96, vocab=51200, seq=2048)
    w = Workload(1)
    lay = lambda **kw: Candidate(8, 1, 1, 1, **kw)
    flash = {r: activation_bytes_per_layer(m, lay(recompute=r, sequence_parallel=True), w, attention="flash")
             for r in ("none", "selective")}
    math_none = activation_bytes_per_layer(m, lay(recompute="none", sequence_parallel=True), w, attention="math")
    assert flash["none"] == flash["selective"] < math_none
    assert flash["none"] == pytest.approx(2048 * 12288 * (34 / 8 + 2 * 96 / (12288 * 8)))
    cluster, work = Cluster(A100, 64), Workload(256)
    assert cluster.calib.attention_kernel == "flash"
    none = Candidate(8, 1, 8, 1, zero_stage=1, recompute="none", sequence_parallel=True)
    sel = Candidate(8, 1, 8, 1, zero_stage=1, recompute="selective", sequence_parallel=True)
    p_none, p_sel = (predict(GPT3_LIKE_13B, x, work, cluster) for x in (none, sel))
    assert p_sel.memory.total >= p_none.memory.total and p_sel.step_time_s > p_none.step_time_s
    best = plan(GPT3_LIKE_13B, work, cluster).feasible
    assert best and best[0].layout.recompute != "selective", best[0].layout


GPT3_LIKE_13B = ModelSpec(layers=40, hidden=5120, heads=40, vocab=51200, seq=2048)


def test_zero2_on_a_pipeline_weighed_against_zero1():
    """ZeRO-2 at p > 1 (docs/training.md): step mode is ZeRO-1 in memory and time; micro-batch mode keeps 1/d of
    the gradients (the tied embedding whole) and pays m - 1 more reduce-scatters of the rest."""
    work, cluster = Workload(512, precision="fp32"), Cluster(get_gpu("A100-80GB", "fp32"), 64)
    model = ModelSpec(layers=24, hidden=2048, heads=16, vocab=51200, seq=2048)
    one, step, micro = (Candidate(2, 4, 8, 1, zero_stage=z, zero2_pipeline_reduce=mode)
                        for z, mode in ((1, "micro-batch"), (2, "step"), (2, "micro-batch")))
    pr1, prs, prm = (predict(model, c, work, cluster) for c in (one, step, micro))
    assert prs.step_time_s == pr1.step_time_s and prs.memory.total == pr1.memory.total
    assert prm.memory.grads < pr1.memory.grads / 2
    tied = 4 * model.padded_vocab(2) / 2 * model.hidden
    assert prm.memory.grads == pytest.approx(pr1.memory.grads / 8 + tied * (1 - 1 / 8))
    from mtds.plan.memory import stage_params
    m = 512 // 8
    extra = prm.time_breakdown_s["dp_comm"] - pr1.time_breakdown_s["dp_comm"]
    assert pr1.as_dict()["runnable"] and prm.as_dict()["runnable"]
    grad_bytes = 4 * max(stage_params(model, one, "first"), stage_params(model, one, "last")) - tied
    assert extra > 0 and extra == pytest.approx((m - 1) * comm.reduce_scatter(grad_bytes, 8, 2, cluster), rel=1e-6)


def test_zero3_on_a_pipeline_weighed_against_zero2():
    """ZeRO-3 at p > 1 (docs/training.md) gathers the stage's whole parameters for each pass: its peak is ZeRO-2's
    of the same reduction (step: once a step, ZeRO-1's bytes and time); the micro-batch mode adds 2m - 1
    all-gathers of the stage's parameters a step (1F1B: one forward and one backward pass per micro-batch)."""
    work, cluster = Workload(512, precision="fp32"), Cluster(get_gpu("A100-80GB", "fp32"), 64)
    model = ModelSpec(layers=24, hidden=2048, heads=16, vocab=51200, seq=2048)
    two_step, two_micro, three_step, three_micro = (
        Candidate(2, 4, 8, 1, zero_stage=z, zero2_pipeline_reduce=reduce, zero3_pipeline_gather=gather)
        for z, reduce, gather in ((2, "step", "step"), (2, "micro-batch", "step"), (3, "step", "step"),
                                  (3, "micro-batch", "micro-batch")))
    pr2s, pr2m, pr3s, pr3m = (predict(model, c, work, cluster) for c in (two_step, two_micro, three_step, three_micro))
    assert pr3s.step_time_s == pr2s.step_time_s and pr3s.memory.total == pr2s.memory.total
    assert pr3m.memory.total == pr2m.memory.total and pr3s.as_dict()["runnable"] and pr3m.as_dict()["runnable"]
    from mtds.plan.memory import stage_params
    m = 512 // 8
    grad_bytes = 4 * max(stage_params(model, two_step, "first"), stage_params(model, two_step, "last"))
    extra = pr3m.time_breakdown_s["dp_comm"] - pr2m.time_breakdown_s["dp_comm"]
    assert extra == pytest.approx((2 * m - 1) * comm.all_gather(grad_bytes, 8, 2, cluster), rel=1e-6)
