"""MoE models with expert parallelism on the pipeline schedules beyond 1F1B: the router statistics travel
beside the activation (mtds.model.router_carry) on mtds's own engine (interleaved v = 2, zb-h1: mtds.pipe.p2p
sends them as their own transfers) and on DeepSpeed's DualPipeV engine (which sends tuples), so transformers'
pooled load-balancing loss is the same sums as under 1F1B. Checked against 1F1B at the same layout, in one
pooled 4-rank body: Mixtral (every block MoE) and Qwen3-MoE (blocks 3-4 dense: some virtual stages carry the
statistics through without adding any), (1,2,2) E = 2, fp32 ZeRO-1, 10 clipped AdamW steps.

Tolerance 1e-6 relative on losses and pre-clip grad norms: the same sums in the same order per parameter, but
the global norm's squares are added in another order when a rank holds other layers (interleaved, DualPipeV),
and DualPipeV's tied embedding accumulates its two uses in one buffer (tests/test_pipe_parity.py measures
these at ulps); a wrong aux term moves the loss by ~1e-3 (coefficient 0.02).

Mixtral trains on packed documents (--reset-position-ids, --reset-attention-mask; documents of 2..12 tokens):
the segment ids travel last in the tuple, after the statistics, on every schedule. Its 1F1B run is held to
(1,1,4) e = 2, whose ranks run whole micro-batches on one stage (tests/test_documents.py holds that model to HF
document by document), same tolerance; Qwen3-MoE keeps the plain sequences (the tuple without the ids).

Qwen3-MoE carries a gated shared expert here (Qwen2-MoE's, width 80): one more DualPipeV run with
--overlap-moe-expert-parallel-comm and --timeline computes it while each block's dispatch all-to-all is in flight,
and (on DualPipeV) runs each steady-state pair of one phase's forward and the other's backward at once
(mtds.pipe.dualpipev_overlap). Its losses and norms equal the plain DualPipeV run's within 1e-6 (measured: losses
1.1e-7, norms bit-equal: the forward's values are the same, the backward runs the two branches in another order),
and the trace shows, on both ranks, each MoE block's shared-expert span inside its all-to-all's span (issued to
waited for), one per MoE-block forward.

Mixtral's DualPipeV run is the cross-chunk overlapped one (held to 1F1B like the others; measured bit-equal to the
plain DualPipeV run, which it replaces to keep the suite's cost): its trace shows, on both ranks, a forward
all-to-all of one phase issued while a backward of the other phase runs."""
import dataclasses

from tests.training_helpers import ds_config, max_rel_diff, run_layouts, train_config

TOL = 1e-6
SCHEDULES = ("1f1b", "interleaved", "zb-h1", "dualpipev")
# m = 8 / (1 x d 2) = 4 micro-batches per step: DualPipeV's minimum at p = 2
BATCH = dict(train_batch_size=8, train_micro_batch_size_per_gpu=1)


def _models():
    from tests.test_moe import _qwen3_moe_four_blocks, _training_model
    mixtral = dataclasses.replace(_training_model("mixtral"), num_layers=4)
    qwen = dataclasses.replace(_qwen3_moe_four_blocks(), moe_shared_expert_intermediate_size=80,
                               moe_shared_expert_gate=True)
    return {"mixtral": mixtral, "qwen3_moe": qwen}


def _config(model, schedule, **documents):
    from tests.test_moe import TRAIN_LR
    pipe = dict(pp=2, pipeline_schedule=schedule, virtual_stages=2 if schedule == "interleaved" else 1,
                pipeline_balance="uniform") if schedule else {}
    return train_config(model=model, expert_model_parallel_size=2, seq_length=16, lr=TRAIN_LR,
                        min_lr=TRAIN_LR / 10, deepspeed_config=ds_config(zero=1, **BATCH), **pipe, **documents)


def _documents(tmp_path) -> dict:
    from tests.test_parity import _short_documents
    prefix = str(tmp_path / "docs")
    _short_documents(prefix)
    return dict(data_path=(prefix,), reset_position_ids=True, reset_attention_mask=True)


def test_moe_on_every_schedule_equals_1f1b(tmp_path):
    models = _models()
    documents = {"mixtral": _documents(tmp_path), "qwen3_moe": {}}
    # Mixtral's DualPipeV run with the cross-chunk overlap and its timeline (every block MoE: each pass of a pair
    # has its exchanges); Qwen3-MoE's plain, and once more overlapped below
    cross = str(tmp_path / "cross_chunk.json")
    overlap = {("mixtral", "dualpipev"): dict(overlap_moe_expert_parallel_comm=True, timeline=cross)}
    configs = [_config(model, schedule, **documents[name], **overlap.get((name, schedule), {}))
               for name, model in models.items() for schedule in SCHEDULES]
    configs.append(_config(models["mixtral"], None, **documents["mixtral"]))     # (1,1,4)
    trace = str(tmp_path / "timeline.json")
    configs.append(_config(models["qwen3_moe"], "dualpipev", overlap_moe_expert_parallel_comm=True, timeline=trace))
    per_rank = run_layouts(4, configs)
    results = per_rank[0]       # rank 0: the loss stage of DualPipeV; every rank reports the same numbers
    for rank in per_rank:
        for got, want in zip(rank, results):
            assert got.grad_norms == want.grad_norms, "the clipping norm differs across ranks"
    for k, name in enumerate(models):
        runs = dict(zip(SCHEDULES, results[k * len(SCHEDULES):(k + 1) * len(SCHEDULES)]))
        base = runs["1f1b"]
        assert base.layout == "(tp=1, pp=2, dp=2, ep=2)" and len(base.losses) == 10, base
        for schedule in SCHEDULES[1:]:
            got = runs[schedule]
            loss, norm = max_rel_diff(got.losses, base.losses), max_rel_diff(got.grad_norms, base.grad_norms)
            assert loss < TOL and norm < TOL, \
                f"{name} {schedule} vs 1f1b: max rel diff loss {loss:.1e} norm {norm:.1e}\n{got.losses}\n" \
                f"{base.losses}\n{got.grad_norms}\n{base.grad_norms}"
            print(f"{name} {schedule} vs 1f1b: loss {loss:.1e} norm {norm:.1e}")
    single, base = results[-2], results[0]
    assert single.layout == "(tp=1, pp=1, dp=4, ep=2)" and len(single.losses) == 10, single
    loss, norm = max_rel_diff(base.losses, single.losses), max_rel_diff(base.grad_norms, single.grad_norms)
    assert loss < TOL and norm < TOL, \
        f"mixtral packed documents 1f1b vs (1,1,4): max rel diff loss {loss:.1e} norm {norm:.1e}\n{base.losses}\n" \
        f"{single.losses}\n{base.grad_norms}\n{single.grad_norms}"
    print(f"mixtral packed documents 1f1b vs (1,1,4): loss {loss:.1e} norm {norm:.1e}")
    _assert_overlap(results[-1], results[2 * len(SCHEDULES) - 1], trace)
    _assert_cross_chunk(cross)


def _assert_overlap(got, plain, trace):
    """The overlapped run equals the plain one; in its last step's trace every shared-expert span lies inside an
    all-to-all span of its rank, one each per MoE-block forward: blocks 1 and 2 (rank 0 and rank 1), 4 micro-batches."""
    import json
    loss, norm = max_rel_diff(got.losses, plain.losses), max_rel_diff(got.grad_norms, plain.grad_norms)
    assert loss < TOL and norm < TOL, f"overlapped dualpipev: max rel diff loss {loss:.1e} norm {norm:.1e}"
    events = [e for e in json.load(open(trace))["traceEvents"] if e.get("ph") == "X"]
    for rank in (0, 1):
        spans = {kind: [(e["ts"], e["ts"] + e["dur"]) for e in events if e["pid"] == rank and e["cat"] == kind]
                 for kind in ("a2a", "shared")}
        assert len(spans["a2a"]) == len(spans["shared"]) == 4, (rank, spans)
        for start, end in spans["shared"]:
            assert any(a <= start and end <= b for a, b in spans["a2a"]), \
                f"rank {rank}: the shared expert ({start:.0f}-{end:.0f} us) ran outside the all-to-all {spans['a2a']}"
    print(f"qwen3_moe+shared dualpipev overlapped vs plain: loss {loss:.1e} norm {norm:.1e}; "
          f"shared inside a2a on both ranks")


def _assert_cross_chunk(trace):
    """DualPipeV's cross-chunk overlap (mtds.pipe.dualpipev_overlap) on Mixtral (every block MoE; its losses and
    norms are held to 1F1B's above): on each rank some forward all-to-all of one phase starts while a backward
    of the other phase runs -- the pair's two passes ran at once. Run in order, no exchange starts inside
    another pass. (Ending inside it too is the common case -- 4 of rank 0's 6 in one run -- but not
    guaranteed: an exchange also waits for its peer rank, ms on a shared 2-core machine.)"""
    import json
    events = [e for e in json.load(open(trace))["traceEvents"] if e.get("ph") == "X"]
    for rank in (0, 1):
        mine = [e for e in events if e["pid"] == rank]
        a2a = [e for e in mine if e["cat"] == "a2a"]
        backwards = [e for e in mine if e["cat"] == "B"]
        issued = [(a, b) for a in a2a for b in backwards if a["args"]["chunk"] != b["args"]["chunk"]
                  and b["ts"] < a["ts"] < b["ts"] + b["dur"]]
        assert issued, f"rank {rank}: no all-to-all issued during the other phase's backward: " \
                       f"a2a {[(e['args'], e['ts'], e['dur']) for e in a2a]} B {[(e['args'], e['ts'], e['dur']) for e in backwards]}"
        inside = [(a, b) for a, b in issued if a["ts"] + a["dur"] < b["ts"] + b["dur"]]
        a, b = (inside or issued)[0]
        print(f"rank {rank}: a2a of phase {a['args']['chunk']} ({a['ts']:.0f}+{a['dur']:.0f} us) in the B of "
              f"phase {b['args']['chunk']} ({b['ts']:.0f}+{b['dur']:.0f} us); {len(issued)} issued in one, "
              f"{len(inside)} of them ending in it too")
