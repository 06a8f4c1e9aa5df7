"""`python -m compare run` end to end on a tiny model: table, JSON and plots appear; on emulated nodes HF's
ZeRO-3 and DeepSpeed's AutoTP report mtds's losses (same init, same samples) and the link's bytes."""
import json
import os

import pytest

from compare.cli import main
from compare.launch import entry_args
from compare.schemes import parse_scheme
from lab.testing import needs_ranks

TINY_GPT2 = {"model_type": "gpt2", "vocab_size": 8192, "n_embd": 64, "n_layer": 2, "n_head": 2, "n_positions": 64,
             "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


def test_scheme_specs():
    s = parse_scheme("ptdp:tp=2,pp=2")
    assert (s.kind, s.tp, s.pp, s.name) == ("ptdp", 2, 2, "ptdp-t2p2") and s.config.endswith("cpu_fp32.json")
    z = parse_scheme("zero3")
    assert (z.tp, z.pp) == (1, 1) and z.config.endswith("cpu_zero3_fp32.json") and os.path.isfile(z.config)
    sp = parse_scheme("ptdp:tp=2,sp=1")
    assert (sp.sp, sp.name) == (1, "ptdp-t2p1-sp")
    il = parse_scheme("ptdp:pp=2,schedule=interleaved,v=2")
    assert (il.schedule, il.v, il.name) == ("interleaved", 2, "ptdp-t1p2-interleaved-v2")
    args = entry_args(il, config=il.config, model="gpt2-tiny", steps=1, seq_length=8, out_dir="o")
    assert args[args.index("--pipeline-schedule") + 1] == "interleaved" and args[args.index("--virtual-stages") + 1] == "2"
    assert "--pipeline-schedule" not in entry_args(s, config=s.config, model="gpt2-tiny", steps=1, seq_length=8,
                                                   out_dir="o")
    cp = parse_scheme("ptdp:tp=2,cp=2,comm=a2a")
    assert (cp.cp, cp.comm, cp.name, cp.data_parallel(8)) == (2, "a2a", "ptdp-t2p1-c2a2a", 2)
    args = entry_args(cp, config=cp.config, model="gpt2-tiny", steps=1, seq_length=8, out_dir="o")
    assert args[args.index("--cp") + 1] == "2" and args[args.index("--cp-comm-type") + 1] == "a2a"
    assert "--cp" not in entry_args(s, config=s.config, model="gpt2-tiny", steps=1, seq_length=8, out_dir="o")
    for bad in ("zero3:tp=2", "fsdp", "ptdp:tq=2", "ptdp:tp=1,sp=1", "zero3:sp=1", "zero3:schedule=interleaved",
                "ptdp:pp=1,schedule=interleaved,v=2", "ptdp:pp=2,schedule=zb-h1,v=2", "ptdp:pp=2,v=2",
                "zero3:cp=2", "ptdp:cp=2,comm=ring", "ptdp:cp=0"):
        try:
            parse_scheme(bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad!r} was accepted")


def test_compare_run_tiny(tmp_path):
    """`compare run` on one host (torchrun) for one scheme: files, the row's numbers, the learning-rate line.
    ZeRO-3 through the same entry point (compare.entry's probe, the scheme's config) is tests/test_cluster.py's
    cross-node test: its losses equal mtds on one rank at every step (here: step 1 against PTD-P), and the
    all-gathers the probe traces (counted only because it installs its tracer before DeepSpeed starts) equal
    the formula's bytes; a second launch here added its start-up to no check of its own."""
    needs_ranks(2)      # a launcher starts 2 ranks: under MTDS_TEST_DEVICE=cuda, one GPU each
    model = tmp_path / "config.json"
    model.write_text(json.dumps(TINY_GPT2))
    out = tmp_path / "out"
    code = main(["run", "--schemes", "ptdp:tp=2", "--nproc", "2", "--model", str(model), "--steps", "3",
                 "--seq-length", "32", "--global-batch", "4", "--micro-batch", "2", "--out", str(out),
                 "--timeout", "300"])
    assert code == 0
    for name in ("compare.md", "compare.json", "loss.png", "throughput.png"):
        assert (out / name).stat().st_size > 0, name
    rows = json.loads((out / "compare.json").read_text())["rows"]
    assert [r["scheme"] for r in rows] == ["ptdp-t2p1"]
    for r in rows:
        assert len(r["losses"]) == 3 and r["tokens_per_s"] > 0 and r["peak_mem_gib"] > 0
        assert r["comm_bytes_per_step_max_rank"] > 0
        assert 0 < r["cpu_s_per_step"] < 60, r["cpu_s_per_step"]     # each rank's CPU per step, recorded
    assert any(k.startswith("all_reduce") for k in rows[0]["comm_by_kind_rank0"]), rows[0]["comm_by_kind_rank0"]
    assert "ptdp-t2p1" in (out / "compare.md").read_text()
    assert "Learning rate: constant 1.00e-03 at every step of every scheme" in (out / "compare.md").read_text()


def test_new_scheme_specs():
    assert [parse_scheme(s).name for s in ("zero1", "hf-zero3", "autotp", "autotp:tp=2")] == \
        ["zero1", "hf-zero3", "autotp-t2", "autotp-t2"]
    assert parse_scheme("hf-zero3").hf and parse_scheme("hf-zero3").zero_stage == 3 and not parse_scheme("zero1").hf
    assert parse_scheme("zero1:grad_reduce=all-reduce").name == "zero1-allreduce"
    from mtds.cluster.formulas import zero1_link_bytes      # 2 nodes: one ring edge leaves each node
    assert zero1_link_bytes(params=1000, world=4, nodes=2) == 2 * 0.75 * 4000
    assert zero1_link_bytes(params=1000, world=4, nodes=2, grad_reduce="all-reduce") == 3 * 0.75 * 4000
    for bad in ("zero1:tp=2", "hf-zero3:pp=2", "autotp:pp=2", "zero3:grad_reduce=all-reduce", "zero1:grad_reduce=x"):
        try:
            parse_scheme(bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad!r} was accepted")


def test_comm_families_are_never_summed_across_kinds():
    from compare.table import comm_by_family
    step = {"all_gather/dp": {"calls": 2, "bytes": 100}, "all_reduce/tp": {"calls": 1, "bytes": 400},
            "all_reduce/other": {"calls": 1, "bytes": 8}, "reduce_scatter/dp": {"calls": 1, "bytes": 400},
            "send/world": {"calls": 2, "bytes": 64}, "recv/world": {"calls": 2, "bytes": 64}, "barrier/world": {"calls": 1, "bytes": 0}}
    assert comm_by_family(step) == {"all_reduce": 408, "all_gather": 100, "reduce_scatter": 400, "p2p_send": 64,
                                    "broadcast": 0}


def test_step_time_is_the_slowest_ranks():
    """Every side times a step from a barrier; the step's time is the slowest rank's, not rank 0's (whose
    log the rates came from): tokens/s and TFLOP/s scale with it."""
    from compare.table import _slowest_rank_steps
    log = [{"step": 1, "step_time_s": 0.2, "tokens_per_s": 500.0, "tflops_model": 1.0, "tflops_hw": 2.0}]
    ranks = [{"step_times_s": [0.2]}, {"step_times_s": [0.25]}]
    (s,) = _slowest_rank_steps(log, ranks)
    assert s["step_time_s"] == 0.25 and s["tokens_per_s"] == 400.0 and s["tflops_model"] == 0.8 and s["tflops_hw"] == 1.6
    assert _slowest_rank_steps(log, [{"step_times_s": []}]) == log        # an older probe: the log as it is


def test_zero_formulas():
    """The ZeRO paper's model-state bytes per rank (mixed precision: 2 + 2 + 12 per parameter), and fp32 as
    DeepSpeed runs it (4 + 4 + 8 without ZeRO, + a 4-byte master partition with ZeRO >= 1)."""
    from compare.state import formula
    psi, d = 1000, 4
    assert formula("bf16", 0, psi, d)["total"] == 16 * psi and formula("bf16", 0, psi, d)["label"] == "ZeRO-0 bf16: 16Ψ"
    assert formula("fp16", 1, psi, d)["total"] == 4 * psi + 12 * psi / d
    assert formula("bf16", 2, psi, d)["total"] == 2 * psi + 14 * psi / d
    assert formula("bf16", 3, psi, d)["label"] == "ZeRO-3 bf16: 16Ψ/d" and formula("bf16", 3, psi, d)["total"] == 16 * psi / d
    assert formula("fp32", 0, psi, d)["total"] == 16 * psi and formula("fp32", 1, psi, d)["label"] == "ZeRO-1 fp32: 8Ψ + 12Ψ/d"
    z3 = formula("fp32", 3, psi, d, persistent=100)
    assert z3["params"] == 4 * psi / d + 400 and z3["label"] == "ZeRO-3 fp32: 20Ψ/d + 4Ψp"


def test_state_probe_stops_once_the_state_is_steady(monkeypatch):
    """The model-state walk runs inside the timed step: measured from the second optimizer step until two
    steps in a row hold the same bytes (Adam's moments appear at the first step), then not again."""
    import types

    import torch

    from compare import state
    module = torch.nn.Linear(8, 8)
    engine = types.SimpleNamespace(module=module, optimizer=torch.optim.AdamW(module.parameters()))
    walks = []
    measure = state.measure
    monkeypatch.setattr(state, "measure", lambda *a: walks.append(1) or measure(*a))
    probe = state.StateProbe().install(engine)
    for _ in range(5):
        module(torch.ones(2, 8)).sum().backward()
        engine.optimizer.step()
    assert len(walks) == 2 and probe.calls == 5, (walks, probe.calls)
    assert probe.peak == measure(module, engine.optimizer)      # the steady state is the peak


def test_planner_cell_follows_the_link(tmp_path):
    """The prediction beside a cell uses the shaped link as the inter-node bandwidth: a slower link slows
    ZeRO-3 (all of its traffic crosses nodes) far more than PTD-P (only stage boundaries cross)."""
    from compare.predict import predict_cell
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"matmul_tflops": 0.1, "memory_gbps": 6.0, "elementwise_gbps": 5.0,
                                   "allreduce_busbw_gbps": 1.3, "allreduce_latency_s": 1e-4, "memory_gib": 8.0}))
    kw = dict(model="gpt2-tiny", seq=128, global_batch=16, micro_batch=4, world=4, ranks_per_node=2,
              profile=str(profile))
    zero3 = [predict_cell(parse_scheme("zero3"), link_bytes_per_s=bw, **kw)["step_s"] for bw in (1.25e9, 1.25e7)]
    ptdp = [predict_cell(parse_scheme("ptdp:tp=2,pp=2"), link_bytes_per_s=bw, **kw)["step_s"] for bw in (1.25e9, 1.25e7)]
    assert zero3[1] > 2 * zero3[0] and zero3[1] - zero3[0] > 2 * (ptdp[1] - ptdp[0]) > 0, (zero3, ptdp)
    assert "error" in predict_cell(parse_scheme("autotp:tp=2"), link_bytes_per_s=1.25e9, **kw)
    # Megatron-core's cells as it runs on gloo: whole activations between stages (no scatter/gather) and its
    # reduce-scatter an all-reduce (+ the all-gather): more pipeline and more gradient traffic than mtds's
    slow = dict(kw, link_bytes_per_s=1.25e7)
    pp = {k: predict_cell(parse_scheme(f"{k}:tp=2,pp=2"), **slow)["breakdown_s"]["pp_comm"] for k in ("ptdp", "megatron")}
    dp = {k: predict_cell(parse_scheme(f"{k}:tp=2"), **slow)["breakdown_s"]["dp_comm"] for k in ("ptdp", "megatron")}
    assert pp["megatron"] > 1.25 * pp["ptdp"] and dp["megatron"] == pytest.approx(1.5 * dp["ptdp"], rel=0.02), (pp, dp)


def _host_losses(flags):
    from mtds.training import run
    from mtds.training.cli import build_parser, config_from_args
    return run(config_from_args(build_parser().parse_args(flags))).losses


def test_compare_run_on_emulated_nodes(tmp_path):
    """`compare run --nodes 2`: HF GPT2LMHeadModel under accelerate + DeepSpeed ZeRO-3 (2 micro-batches per
    step: accumulation must not step the optimizer twice), and AutoTP (which DeepSpeed refuses for GPT-2: a row
    with its error) through the DeepSpeed launcher per node; results files appear, losses agree with mtds on one
    rank, link bytes are counted. (mtds's own PTD-P across the nodes -- its losses, link bytes against the
    formula the sweep uses, placement split -- is tests/test_cluster.py's at 2 x 2.)"""
    from mtds.cluster import unavailable_reason
    reason = unavailable_reason()
    if reason:
        import pytest
        pytest.skip(f"emulated cluster unavailable: {reason}")
    from compare.launch import effective_config
    from lab.testing import spawn
    model = tmp_path / "config.json"
    model.write_text(json.dumps(TINY_GPT2))
    # HF's losses against mtds at (1,1,1) with compare.entry's train.py flags and the sweep's batch, on a warm
    # pooled rank (a launch of its own would only add start-up; the same flags give the same losses either way)
    host, one = tmp_path / "host", parse_scheme("ptdp:tp=1")
    host.mkdir()
    flags = entry_args(one, config=effective_config(one, str(host), 8, 2), model=str(model), steps=2, seq_length=32,
                       out_dir=str(host))[2:]
    ref_losses = spawn(_host_losses, 1, flags, timeout=300)[0]
    assert len(ref_losses) == 2
    out = tmp_path / "sweep"
    code = main(["run", "--nodes", "2", "--ranks-per-node", "1", "--inter-node", "1gbit", "--schemes", "hf-zero3",
                 "autotp:tp=2", "autotp:tp=2,model=llama-tiny", "--model", str(model), "--steps", "2", "--seq-length", "32",
                 "--global-batch", "8", "--micro-batch", "2", "--no-predict", "--out", str(out), "--timeout", "300",
                 "--prefix", f"mtds-c{os.getpid()}-"])
    assert code == 0
    for name in ("results.md", "results.csv", "results.json", "tokens_vs_bandwidth.png", "link_bytes.png", "loss.png"):
        assert (out / name).stat().st_size > 0, name
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [(r["scheme"], r["status"]) for r in rows] == [("hf-zero3", "ok"), ("autotp-t2", "error"),
                                                          ("autotp-t2-llama-tiny", "ok")]
    assert "AutoTP not supported" in rows[1]["error"]
    # DeepSpeed's AutoTP trains a Llama: same losses as mtds on one rank on one host (same model and data)
    llama = rows[2]
    assert len(json.loads((out / "results.json").read_text())["meta"]["references"]["llama-tiny"]) == 2
    assert llama["loss_max_rel_diff"] <= 1e-5 and llama["model_state"]["psi"] < 2_901_120, llama   # TP-sharded
    for r in (rows[0], llama):    # one rank per node: every byte a rank sends crosses the link
        assert r["traced_intra_bytes_per_step_per_node"] == 0 and r["traced_inter_bytes_per_step_per_node"] > 0, r
    hf = rows[0]
    assert len(hf["losses"]) == 2
    print("hf-zero3 against mtds (1,1,1): max rel diff", max(abs(a - b) / abs(b) for a, b in zip(hf["losses"], ref_losses)))
    for a, b in zip(hf["losses"], ref_losses):
        assert abs(a - b) <= 1e-5 * abs(b), (hf["losses"], ref_losses)
    assert hf["comm_by_family_max_rank"]["all_gather"] > 0 and hf["comm_by_family_max_rank"]["reduce_scatter"] > 0
    # counters vs formula: within 3% (tests/test_cluster.py states the overhead)
    assert hf["link_formula_bytes"] * 0.99 <= hf["link_bytes_per_step_per_node"] <= hf["link_formula_bytes"] * 1.03, hf
    assert "failed" in (out / "results.md").read_text()


def test_shipped_models_compare_exactly_and_dropout_is_called_out(tmp_path):
    """The sweep's models have no dropout (HF's GPT-2 default is 0.1, whose masks differ per layout, so the
    loss-agreement line would measure dropout, not the schemes); a model with dropout gets the caveat."""
    from compare.results import _dropout_caveat
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    wide = os.path.join(here, "compare", "gpt2_wide.json")
    assert _dropout_caveat("gpt2-tiny") == "" and _dropout_caveat(wide) == ""
    cfg = json.load(open(wide))
    cfg.update(resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    (tmp_path / "drop.json").write_text(json.dumps(cfg))
    assert "dropout (p = 0.1)" in _dropout_caveat(str(tmp_path / "drop.json"))
