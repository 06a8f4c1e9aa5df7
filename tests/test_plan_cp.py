"""The planner's context-parallel model (issue 34): memory ∝ s/c, the ring's and Ulysses's bytes, compute
per rank, the search's rule for c > 1 and the CLI knobs. Single process, no torch."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from mtds.plan import Candidate, Cluster, ModelSpec, Workload, get_gpu, plan, predict
from mtds.plan import compute, cp_comm
from mtds.plan.memory import GIB, activation_bytes_per_layer, cp_transient_bytes, predict_memory
from mtds.plan.predict import structural_problems

# Llama-3-8B's shape: 32 query heads, 8 KV heads, head_dim 128, SwiGLU 14336, untied head, RoPE, RMSNorm
LLAMA3_8B = ModelSpec(layers=32, hidden=4096, heads=32, vocab=128256, seq=131072, ffn_hidden=14336, kv_heads=8,
                      gated_mlp=True, untied_head=True, rotary=True, qkv_bias=False, linear_bias=False,
                      rmsnorm=True, name="llama3-8b")
WORK = Workload(global_batch=8)                      # 8 sequences of 128K tokens: 1M tokens per step
H100_64 = Cluster(get_gpu("H100"), 64)


def _lay(c, *, t=8, d=None, comm="p2p", **kw):
    kw = {"zero_stage": 1, "recompute": "none", "sequence_parallel": True, **kw}
    return Candidate(t, 1, d or 64 // (t * c), 1, cp=c, cp_comm_type=comm, **kw)


def test_candidate_counts_c_in_world_and_grid_but_not_in_the_batch():
    lay = _lay(4)                                   # t8 c4 d2
    assert (lay.gpus, lay.dp_cp, lay.grid.cp, lay.grid.world_size) == (64, 8, 4, 64)
    assert lay.microbatches(8) == 4                 # B = b m d: c ranks run the same micro-batches
    assert Candidate.of_layout(lay.grid, microbatch=1).cp == 4


@pytest.mark.parametrize("comm", ["p2p", "a2a"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_activation_memory_per_rank_falls_as_one_over_c(comm, recompute):
    """Per layer (stored and working set) and for the whole stage: 1/c of c = 1, plus the ring's blocks in
    flight (p2p) or Ulysses's head-layout output (a2a, 2 q/(h t) against 34/t + ...: under 6%)."""
    model = replace(LLAMA3_8B, seq=32768)
    base = _lay(1, t=2, d=4, recompute=recompute)     # the same d (micro-batches) at every c
    for c in (2, 4):
        lay = replace(base, cp=c, cp_comm_type=comm)
        for stored in (True, False):
            one, mine = (activation_bytes_per_layer(model, x, WORK, stored=stored, attention="flash")
                         for x in (base, lay))
            assert one / c <= mine <= one / c * (1.06 if comm == "a2a" else 1.0 + 1e-12)
        whole, part = (predict_memory(model, x, WORK, H100_64).activations for x in (base, lay))
        extra = cp_transient_bytes(model, lay, WORK)
        if comm == "p2p":
            assert part - extra == pytest.approx(whole / c, rel=1e-12)
        else:
            assert extra == 0 and whole / c <= part <= whole / c * 1.06


def test_ring_blocks_in_flight_hand_computed():
    """Backward holds a received K/V block and the dK/dV travelling with it: 2 x 2 b (s/c) (h_kv/t) e values."""
    lay = _lay(4)                                   # t = 8: one KV head per TP rank
    assert cp_transient_bytes(LLAMA3_8B, lay, WORK) == 2 * 2 * 1 * 32768 * 1 * 128 * 2 == 33_554_432


def test_no_attention_scores_with_cp_even_on_a_math_kernel_cluster():
    """The CP kernels keep no s x s: a calibration with the math kernel (5 a s/(h t)) still gets flash terms."""
    math = Cluster(get_gpu("H100"), 64)
    math = replace(math, gpu=replace(math.gpu, calibration=replace(math.calib, attention_kernel="math")))
    model = replace(LLAMA3_8B, seq=32768)
    mem = {c: predict_memory(model, _lay(c, t=2, d=4), WORK, math).activations for c in (1, 2)}
    assert mem[2] < mem[1] / 20                      # the c = 1 math kernel's s^2 term dominates


def test_p2p_and_a2a_bytes_hand_computed():
    """Llama-3-8B, s = 131072, b = 1, t = 8, c = 4, bf16, per layer forward per rank:
    hop = 2 (K, V) x 32768 tokens x 1 KV head x 128 x 2 B = 16 MiB; 3 hops = 48 MiB;
    a2a = 3/4 x 32768 x 128 x 2 B x (4 + 1 + 1 + 4 heads) = 60 MiB."""
    lay = _lay(4)
    assert cp_comm.p2p_hop_bytes(LLAMA3_8B, lay, WORK) == 16 * 2 ** 20
    assert cp_comm.p2p_forward_bytes(LLAMA3_8B, lay, WORK) == 48 * 2 ** 20
    assert cp_comm.a2a_tensor_bytes(LLAMA3_8B, lay, WORK) == (32 * 2 ** 20, 8 * 2 ** 20, 8 * 2 ** 20, 32 * 2 ** 20)
    assert cp_comm.a2a_forward_bytes(LLAMA3_8B, lay, WORK) == 60 * 2 ** 20
    assert cp_comm.forward_bytes(LLAMA3_8B, _lay(1), WORK) == 0


@pytest.mark.parametrize("t,c,kv", [(8, 4, 8), (2, 4, 8), (1, 8, 32), (4, 2, 8)])
def test_p2p_over_a2a_is_c_hkv_over_hq_plus_hkv(t, c, kv):
    model = replace(LLAMA3_8B, kv_heads=kv)
    lay = _lay(c, t=t)
    ratio = cp_comm.p2p_forward_bytes(model, lay, WORK) / cp_comm.a2a_forward_bytes(model, lay, WORK)
    assert ratio == pytest.approx(c * kv / (model.heads + kv), rel=1e-12)


def test_ring_hidden_behind_block_compute_unless_the_link_is_slow():
    """Exposed per hop = max(0, hop − block); a 128K block's attention hides 16 MiB on NVLink and on IB."""
    lay = _lay(4)                                   # t·c = 32 GPUs: the ring crosses nodes
    assert cp_comm.layer_time(LLAMA3_8B, lay, WORK, H100_64) == 0.0
    slow = Cluster(get_gpu("H100"), 64, inter_gbps=0.05)
    block = compute.layer_forward(LLAMA3_8B, lay, WORK, slow).attention_core / 4
    hop = cp_comm.hop_time(16 * 2 ** 20, lay, slow)
    assert hop > block
    assert cp_comm.exposed_forward_time(LLAMA3_8B, lay, WORK, slow) == pytest.approx(3 * (hop - block))
    # backward: K/V + dK/dV per hop against twice the block
    back = 3 * (cp_comm.hop_time(32 * 2 ** 20, lay, slow) - 2 * block)
    assert cp_comm.exposed_backward_time(LLAMA3_8B, lay, WORK, slow) == pytest.approx(back)


def test_a2a_exposed_four_all_to_alls_each_way():
    lay = _lay(4, t=2, comm="a2a")                  # 16 query and 4 KV heads per TP rank: c = 4 divides both
    one = sum(cp_comm.all_to_all_time(x, lay, H100_64) for x in cp_comm.a2a_tensor_bytes(LLAMA3_8B, lay, WORK))
    assert cp_comm.layer_time(LLAMA3_8B, lay, WORK, H100_64) == pytest.approx(2 * one)   # recompute none
    pr = predict(LLAMA3_8B, lay, WORK, H100_64)
    assert pr.time_breakdown_s["cp_comm"] == pytest.approx(1 * 32 * 2 * one)   # m = 8/(1 x d8) = 1, 32 layers
    assert pr.step_time_s == pytest.approx(sum(pr.time_breakdown_s.values()))


def test_compute_per_rank_is_one_over_c():
    """GEMMs of s/c tokens; scores and context 1/c of the whole sequence's (roofline: the FLOP bound rules)."""
    one = compute.layer_forward(LLAMA3_8B, _lay(1), WORK, H100_64)
    for c in (2, 4):
        mine = compute.layer_forward(LLAMA3_8B, _lay(c), WORK, H100_64)
        assert mine.attention_core == pytest.approx(one.attention_core / c, rel=0.02)
        assert mine.linear == pytest.approx(one.linear / c, rel=0.02)


def test_gradient_reduction_and_zero_over_d_times_c():
    model = replace(LLAMA3_8B, seq=32768)
    c4d2, c1d8, c1d2 = _lay(4, d=2), _lay(1, d=8), _lay(1, d=2)
    prs = [predict(model, x, WORK, H100_64) for x in (c4d2, c1d8, c1d2)]
    assert prs[0].time_breakdown_s["dp_comm"] == pytest.approx(prs[1].time_breakdown_s["dp_comm"])
    assert prs[0].time_breakdown_s["dp_comm"] > prs[2].time_breakdown_s["dp_comm"]
    assert prs[0].memory.optimizer == prs[1].memory.optimizer < prs[2].memory.optimizer


def test_structural_refusals():
    ok = _lay(4, t=2, comm="a2a")
    assert structural_problems(LLAMA3_8B, ok, WORK, H100_64) == []
    assert any("a2a" in x for x in structural_problems(LLAMA3_8B, _lay(4, comm="a2a"), WORK, H100_64))
    odd = replace(LLAMA3_8B, seq=131072 + 4)
    assert any("divisible by 2*C = 8" in x for x in structural_problems(odd, _lay(4, sequence_parallel=False), WORK,
                                                                       H100_64))


def test_128k_llama3_8b_on_64_h100s_needs_cp():
    """Without pipeline stages or recomputation no c = 1 layout fits a 128K sequence (t = 8: 32 layers x
    2.1 GB of activations + 16.8 GB of logits); c > 1 does, and unconstrained the fastest layout has c > 1."""
    knobs = {"recompute": "none", "pp": 1}
    assert plan(LLAMA3_8B, WORK, H100_64, cp=1, **knobs).feasible == []
    best = plan(LLAMA3_8B, WORK, H100_64, **knobs).best
    assert best.layout.cp > 1 and best.fits and best.memory.total <= 80 * GIB
    assert LLAMA3_8B.seq % (2 * best.layout.cp) == 0 and best.layout.gpus == 64
    assert plan(LLAMA3_8B, WORK, H100_64).best.layout.cp > 1


def test_short_sequences_search_c1_unless_nothing_fits():
    """At s < LONG_SEQUENCE the search stays c = 1 (the validated tables); when no c = 1 layout fits, c > 1."""
    model = replace(LLAMA3_8B, seq=16384)
    eight = Cluster(get_gpu("H100"), 8)
    fits = plan(model, Workload(8), eight, recompute="full", zero_stage=1, tp=2, pp=1)   # c = 2, 4 would run
    assert fits.feasible and {pr.layout.cp for pr in fits.feasible} == {1}
    tight = plan(model, Workload(8), eight, recompute="none", zero_stage=1, tp=2, pp=1)
    assert tight.feasible and {pr.layout.cp for pr in tight.feasible} != {1}
    assert plan(model, Workload(8), eight, recompute="none", zero_stage=1, tp=2, pp=1, cp=1).feasible == []


def test_cli_fixes_cp(capsys):
    from mtds.cli.plan import main
    argv = ["--layers", "32", "--hidden", "4096", "--heads", "32", "--vocab", "128256", "--seq", "131072",
            "--ffn-hidden", "14336", "--gpu", "H100", "--gpus", "64", "--global-batch", "8", "--tp", "4",
            "--context-parallel-size", "4", "--cp-comm-type", "a2a", "--recompute", "full", "--json"]
    main(argv)
    out = json.loads(capsys.readouterr().out)
    assert (out["tp"], out["cp"], out["cp_comm_type"], out["dp"]) == (4, 4, "a2a", 4)
    assert "cp_comm" in out["time_breakdown_s"]
