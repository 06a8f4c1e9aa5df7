"""The planner's mixture-of-experts model (issue 33): expert memory ∝ 1/(t·e), the EP all-to-all's bytes,
FLOPs from the step log's count, the one-line refusals and the CLI knob. Single process, no torch."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from mtds.model.config import ModelConfig
from mtds.observe import metrics
from mtds.plan import Candidate, Cluster, ModelSpec, Workload, comm, ep_comm, get_gpu, predict
from mtds.plan.memory import predict_memory, stage_expert_params
from mtds.plan.predict import structural_problems
from mtds.plan.runnable import rule_problems

# Mixtral-8x7B's shape: 8 experts of width 14336, top-2, every block MoE
MIXTRAL = ModelSpec(layers=32, hidden=4096, heads=32, vocab=32000, seq=4096, ffn_hidden=14336, kv_heads=8,
                    gated_mlp=True, untied_head=True, rotary=True, qkv_bias=False, linear_bias=False, rmsnorm=True,
                    num_experts=8, moe_top_k=2, name="mixtral")
WORK32 = Workload(global_batch=64, precision="fp32")
H100_16 = Cluster(get_gpu("H100"), 16)


def _lay(e, *, t=2, d=8, microbatch=1, **kw):
    kw = {"zero_stage": 0, "recompute": "none", **kw}
    return Candidate(t, 1, d, microbatch, ep=e, **kw)


def test_mixtral_parameter_count():
    assert MIXTRAL.params == pytest.approx(46.70e9, rel=1e-3)      # Mixtral-8x7B: 46.7B


@pytest.mark.parametrize("e", [2, 4, 8])
def test_expert_memory_falls_as_one_over_e(e):
    """Experts per rank: E·3hF/(t·e) per block; fp32 ZeRO-0 holds 4 + 4 + 8 bytes of each, so the model states
    shrink by exactly 16 bytes x the experts e no longer holds; the router stays."""
    per_rank = 32 * 8 * 3 * 4096 * 14336 / 2
    assert stage_expert_params(MIXTRAL, _lay(1)) == per_rank
    assert stage_expert_params(MIXTRAL, _lay(e)) == per_rank / e
    one, split = predict_memory(MIXTRAL, _lay(1), WORK32, H100_16), predict_memory(MIXTRAL, _lay(e), WORK32, H100_16)
    states = lambda mb: mb.params + mb.grads + mb.optimizer  # noqa: E731
    assert states(one) - states(split) == pytest.approx(16 * per_rank * (1 - 1 / e), rel=1e-12)


def test_expert_optimizer_state_partitions_over_the_expert_data_group():
    """ZeRO-1: dense states over d = 8, expert states over d/e = 4 (each expert shard is held by d/e ranks)."""
    lay = _lay(2, zero_stage=1)
    mem = predict_memory(MIXTRAL, lay, WORK32, H100_16)
    ne = stage_expert_params(MIXTRAL, lay)
    dense = predict_memory(replace(MIXTRAL, num_experts=0, ffn_hidden=1), _lay(1, zero_stage=1), WORK32, H100_16)
    router = 32 * 4096 * 8 / 8            # replicated router's optimizer states, partitioned over d = 8
    dense_mlp = 32 * 3 * 4096 * 1 / 2 / 8    # the stand-in dense model's 1-wide MLP
    assert mem.optimizer - dense.optimizer == pytest.approx(8 * (ne / 4 + router - dense_mlp), rel=1e-9)


@pytest.mark.parametrize("e", [2, 4, 8])
@pytest.mark.parametrize("recompute, exchanges", [("none", 4), ("full", 6)])
def test_all_to_all_bytes_and_time_hand_computed(e, recompute, exchanges):
    lay = _lay(e, recompute=recompute, microbatch=2)
    b, s, k, h, w = 2, 4096, 2, 4096, 4
    assert ep_comm.a2a_sent_bytes(MIXTRAL, lay, WORK32) == b * s * k * h * w * (e - 1) / e
    one = comm.all_to_all(b * s * k * h * w, e, 2, H100_16)
    assert ep_comm.layer_time(MIXTRAL, lay, WORK32, H100_16) == pytest.approx(exchanges * one, rel=1e-12)
    half = replace(MIXTRAL, moe_layers=16)      # half the blocks MoE: half the traffic per average layer
    assert ep_comm.layer_time(half, lay, WORK32, H100_16) == pytest.approx(exchanges * one / 2, rel=1e-12)
    pred = predict(MIXTRAL, lay, WORK32, H100_16)
    assert pred.time_breakdown_s["ep_comm"] == pytest.approx(32 * lay.microbatches(64) * exchanges * one, rel=1e-12)


def test_no_all_to_all_at_e1_or_on_a_dense_model():
    assert ep_comm.layer_time(MIXTRAL, _lay(1), WORK32, H100_16) == 0.0
    assert "ep_comm" not in predict(MIXTRAL, _lay(1), WORK32, H100_16).time_breakdown_s


def test_flops_equal_the_step_logs_count_for_an_moe_config():
    """Qwen3-MoE-like: every other block MoE (decoder_sparse_step 2, block 4 listed dense), k = 4 of 16 experts of
    width 96; ModelSpec.from_config must carry all of it into metrics' count."""
    cfg = ModelConfig(vocab_size=1000, hidden_size=256, num_layers=8, num_heads=8, num_kv_heads=4, kv_channels=64,
                      ffn_hidden_size=512, max_position_embeddings=512, position_embedding="rotary",
                      normalization="rmsnorm", activation="swiglu", qkv_bias=False, linear_bias=False,
                      tie_word_embeddings=False, architecture="qwen3_moe", num_experts=16, moe_top_k=4,
                      moe_ffn_hidden_size=96, decoder_sparse_step=2, mlp_only_layers=(3,))
    spec = ModelSpec.from_config(cfg, seq=512)
    assert (spec.num_experts, spec.moe_top_k, spec.moe_ffn, spec.moe_blocks) == (16, 4, 96, 3)
    for recompute in ("none", "full"):
        assert spec.hardware_flops(8, recompute) == metrics.model_config_flops(cfg, 8, 512, recompute)
    assert spec.model_flops(8) < replace(spec, num_experts=0).model_flops(8)   # 4·96 + 16/3 < 512


def test_structural_refusals_one_line_each():
    def problems(model, lay):
        return structural_problems(model, lay, WORK32, H100_16)
    dense = replace(MIXTRAL, num_experts=0)
    cases = [(dense, _lay(2), "needs a mixture-of-experts model"),
             (replace(MIXTRAL, num_experts=6), _lay(4), "does not divide the model's 6 experts"),
             (replace(MIXTRAL, num_experts=6), _lay(3), "does not divide the data-parallel size 8"),
             (replace(MIXTRAL, moe_ffn_hidden=1001), _lay(1), "does not divide the expert FFN size 1001")]
    for model, lay, text in cases:
        found = problems(model, lay)
        assert len(found) == 1 and text in found[0] and "\n" not in found[0], found
    assert problems(MIXTRAL, _lay(8)) == []


def not_runnable(lay, precision):
    return [p.message for p in rule_problems(MIXTRAL, lay, Workload(64, precision=precision), 80 * 2 ** 30)]


def test_train_py_runs_ep_as_moe_layout_allows_and_moe_pipelines_on_every_schedule():
    """The rulebook's verdict (mtds.rules.experts): not ZeRO-3, not 16-bit ZeRO-0; pipelines on any schedule."""
    assert not_runnable(_lay(2), "fp32") == []
    assert len(not_runnable(_lay(2), "bf16")) == 1
    assert not_runnable(_lay(2, zero_stage=1), "fp32") == []
    assert not_runnable(_lay(2, zero_stage=2), "bf16") == []
    assert len(not_runnable(_lay(2, zero_stage=3), "fp32")) == 1
    assert not_runnable(_lay(1, zero_stage=1), "bf16") == []
    assert not_runnable(Candidate(1, 2, 8, 1), "fp32") == []      # 1f1b carries the router statistics
    assert not_runnable(Candidate(1, 2, 8, 1, virtual_stages=2), "fp32") == []      # and interleaved
    assert predict(MIXTRAL, _lay(2), Workload(64), H100_16).not_runnable      # bf16: reported, not hidden
    # the cross-chunk overlap's knob reaches the rule train.py asks (built at t 1, fp32)
    over = dict(pipeline_schedule="dualpipev", ep=2, zero_stage=1, overlap_moe_expert_parallel_comm=True)
    assert not_runnable(Candidate(1, 2, 8, 1, **over), "fp32") == []
    assert any("dualpipev" in m for m in not_runnable(Candidate(2, 2, 4, 1, **over), "fp32"))


@pytest.mark.parametrize("e", [1, 2, 8])     # not all the search's own choice: the flag must hold it
def test_cli_fixes_ep(capsys, e):
    from mtds.cli.plan import main
    argv = ["--layers", "8", "--hidden", "1024", "--heads", "16", "--vocab", "32000", "--seq", "4096",
            "--ffn-hidden", "2816", "--num-experts", "8", "--moe-top-k", "2", "--gpu", "H100", "--gpus", "16",
            "--global-batch", "64", "--precision", "fp32", "--tp", "2", "--pp", "1", "--zero-stage", "0",
            "--expert-model-parallel-size", str(e), "--json"]
    main(argv)
    out = json.loads(capsys.readouterr().out)
    assert (out["tp"], out["dp"], out["ep"], out["not_runnable"]) == (2, 8, e, [])
    assert ("ep_comm" in out["time_breakdown_s"]) == (e > 1)


# DeepSeek-V3's shape (arXiv 2412.19437): 61 blocks, the first 3 dense (18432 wide), then 256 routed experts of width
# 2048, top-8, one shared expert; latent attention with r_q 1536, r_kv 512, qk 128 + RoPE 64, v 128; untied head
DEEPSEEK_V3 = ModelSpec(layers=61, hidden=7168, heads=128, vocab=129280, seq=4096, ffn_hidden=18432, gated_mlp=True,
                        untied_head=True, rotary=True, qkv_bias=False, linear_bias=False, rmsnorm=True,
                        num_experts=256, moe_top_k=8, moe_ffn_hidden=2048, moe_layers=58,
                        moe_positions=tuple(range(3, 61)), moe_shared_ffn=2048, q_lora_rank=1536, kv_lora_rank=512,
                        qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128, name="deepseek-v3")


def test_deepseek_v3_parameters_flops_and_context_parallel_bytes():
    """671B parameters as the paper counts them (its multi-token prediction module aside); a token's forward
    through the latent attention is the step log's count; under CP the ring carries K and V padded to the
    larger head dim, a · max(128 + 64, v) wide (tests/test_plan.py checks the small configs tensor by tensor)."""
    from mtds.plan import cp_comm
    assert DEEPSEEK_V3.params == pytest.approx(671.0e9, rel=1e-3)
    proj, core = DEEPSEEK_V3.latent_attention_flops()
    h, a = 7168, 128
    assert proj == 2 * (1536 * (h + a * 192) + h * (512 + 64) + 512 * a * (128 + 128) + a * 128 * h)
    assert core == 2 * 4096 * a * (192 + 128)
    lay = Candidate(8, 1, 2, 1, cp=4, cp_comm_type="p2p", zero_stage=1, recompute="none")
    assert cp_comm.p2p_hop_bytes(DEEPSEEK_V3, lay, WORK32) == 2 * 1 * 1024 * a * 192 / 8 * 4
    wide_v = replace(DEEPSEEK_V3, v_head_dim=256)       # the query/key heads padded to the value's 256
    assert cp_comm.p2p_hop_bytes(wide_v, lay, WORK32) == 2 * 1 * 1024 * a * 256 / 8 * 4


def test_expert_parallelism_folds_over_context_parallelism():
    """With c > 1 the expert-parallel group is e consecutive ranks of the d·c axis, t apart (mtds.parallel.layout):
    e may exceed d, the search tries the divisors of d·c, and the all-to-all's stride is t, not t·c."""
    from mtds.plan.search import candidate_layouts
    lay = Candidate(4, 1, 1, 1, cp=2, ep=2, zero_stage=0, recompute="none")
    assert not_runnable(lay, "fp32") == []
    assert not_runnable(Candidate(2, 2, 1, 1, cp=2, ep=2), "fp32") == []     # MoE + CP on a pipeline too
    found = {c.ep for c in candidate_layouts(MIXTRAL, WORK32, Cluster(get_gpu("H100"), 8), {"tp": 4, "cp": 2})}
    assert found == {1, 2}, found
    # ranks 0 and 4 of a node of 8 (t = 4): inside the node; t·c apart they would span two nodes
    nbytes = ep_comm.a2a_tensor_bytes(MIXTRAL, lay, WORK32)
    one = comm.all_to_all(nbytes, 2, 4, H100_16)
    assert one < comm.all_to_all(nbytes, 2, 8, H100_16)
    assert ep_comm.layer_time(MIXTRAL, lay, WORK32, H100_16) == pytest.approx(4 * one, rel=1e-12)


def test_dualpipev_overlap_hides_the_all_to_all_under_the_other_chunks_compute():
    """--overlap-moe-expert-parallel-comm under DualPipeV (ep_comm.exposed_layer_time): in the overlapped pairs
    each direction's all-to-alls are exposed only beyond the other chunk's compute. On slow links (1 GB/s across
    nodes: the all-to-all longer than the compute) the predicted step falls by the hidden compute's worth; where
    nothing overlaps -- the flag off, another schedule, or e = 1 (no all-to-all) -- the step is unchanged.
    The pair count is DeepSpeed's own schedule's (tests/test_plan_pipeline.py), rank 0 the fewest."""
    from mtds.plan import compute
    work = Workload(global_batch=64, precision="bf16")
    slow = Cluster(get_gpu("H100"), 16, gpus_per_node=4, inter_gbps=1.0)     # e = 8 spans two nodes

    def step(cluster, overlap, **kw):
        lay = Candidate(**{**dict(tp=1, pp=2, dp=8, microbatch=1, ep=8, zero_stage=1, recompute="none",
                                  pipeline_schedule="dualpipev"), **kw}, overlap_moe_expert_parallel_comm=overlap)
        return predict(MIXTRAL, lay, work, cluster, found=[]), lay

    (off, lay), (on, _) = step(slow, False), step(slow, True)
    m = lay.microbatches(work.global_batch)
    a2a = ep_comm.layer_time(MIXTRAL, lay, work, slow)
    layer = compute.layer_compute_time(MIXTRAL, lay, work, slow)
    assert a2a > layer       # the all-to-alls exceed the compute: all the compute hides some
    share = (2 * m - 3 * 2 + 1) / (2 * m)
    hidden = share * layer * m * MIXTRAL.layers / 2     # the whole compute, of the overlapped passes
    assert off.step_time_s - on.step_time_s == pytest.approx(hidden, rel=1e-9)
    assert on.time_breakdown_s["ep_comm"] < off.time_breakdown_s["ep_comm"]
    # nothing overlaps: the flag on 1F1B, no all-to-all at e = 1, no links to cross at 8 GPUs (e = 8 in one node:
    # NVLink, the all-to-all far below the compute, so each pair hides it whole)
    for kw in (dict(pipeline_schedule="1f1b"), dict(ep=1)):
        assert step(slow, True, **kw)[0].step_time_s == step(slow, False, **kw)[0].step_time_s, kw
    fast = Cluster(get_gpu("H100"), 16, gpus_per_node=8)
    (f_off, f_lay), (f_on, _) = step(fast, False, tp=2, dp=4, ep=4), step(fast, True, tp=2, dp=4, ep=4)
    f_a2a = ep_comm.layer_time(MIXTRAL, f_lay, work, fast)
    assert f_a2a < compute.layer_forward(MIXTRAL, f_lay, work, fast).forward
    f_m = f_lay.microbatches(work.global_batch)
    assert f_off.step_time_s - f_on.step_time_s == pytest.approx(
        (2 * f_m - 5) / (2 * f_m) * f_a2a * f_m * MIXTRAL.layers / 2, rel=1e-9)
    # which compute each direction hides under: under full recomputation the backward's exchanges are twice the
    # forward's (4 against 2) and run under the other chunk's forward (F), the forward's under its backward (3F);
    # across link speeds one direction can be exposed alone (4o > F > 2o)
    one_side = 0
    for gbps in (5.0, 20.0, 50.0, 200.0):
        cluster = Cluster(get_gpu("H100"), 16, gpus_per_node=4, inter_gbps=gbps)
        lay = Candidate(1, 2, 8, 1, ep=8, zero_stage=1, recompute="full", pipeline_schedule="dualpipev",
                        overlap_moe_expert_parallel_comm=True)
        o = comm.all_to_all(ep_comm.a2a_tensor_bytes(MIXTRAL, lay, work), 8, 1, cluster)
        f = compute.layer_forward(MIXTRAL, lay, work, cluster).forward
        share = ep_comm.overlapped_share(lay, m)
        want = (1 - share) * 6 * o + share * (max(0.0, 2 * o - 3 * f) + max(0.0, 4 * o - f))
        assert ep_comm.exposed_layer_time(MIXTRAL, lay, work, cluster, m) == pytest.approx(want, rel=1e-12), gbps
        one_side += 4 * o > f > 2 * o
    assert one_side, "no link speed exposes one direction alone"


def test_explicit_partition_keeps_the_all_to_all():
    """With an explicit stage partition the critical rank's blocks carry the all-to-alls (the block costs the
    balancer shares with train.py leave them out): an even partition predicts the uniform split's ep_comm, and a
    rank with more blocks more."""
    from mtds.parallel.pipeline_layout import StageLayout
    lay = Candidate(1, 2, 8, 1, ep=8, zero_stage=1, recompute="none")
    uniform = predict(MIXTRAL, lay, Workload(64), H100_16).time_breakdown_s["ep_comm"]
    even = predict(MIXTRAL, lay, Workload(64), H100_16, stages=StageLayout((16, 16))).time_breakdown_s["ep_comm"]
    skew = predict(MIXTRAL, lay, Workload(64), H100_16, stages=StageLayout((20, 12))).time_breakdown_s["ep_comm"]
    assert uniform > 0 and even == pytest.approx(uniform, rel=1e-12) and skew == pytest.approx(uniform * 20 / 16)
