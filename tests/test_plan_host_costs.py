"""The planner's host-cost terms (mtds.plan.host_costs): each behaves as its docstring's formula says.
Single process, no timing: profiles are written by hand."""
import json

import pytest

from mtds.plan import comm, compute, host_costs
from mtds.plan.calibrate import save_profile, solve_per_param_and_tensor
from mtds.plan.candidate import Candidate, Workload
from mtds.plan.hardware import Cluster, get_gpu
from mtds.plan.model_spec import ModelSpec
from mtds.plan.predict import predict

PROFILE = {"device": "cpu", "dtype": "fp32", "backend": "gloo", "matmul_tflops": 0.05, "gemm_half_dim": 8.0,
           "memory_gbps": 10.0, "elementwise_gbps": 4.0, "allreduce_busbw_gbps": 0.5, "allreduce_latency_s": 1e-3,
           "memory_gib": 4.0, "devices_per_node": 2, "concurrency": 2, "host_cores": 2,
           "optimizer_s_per_param": 5e-9, "optimizer_s_per_tensor": 1e-4,
           "engine_overhead": {"0": [1e-3, 1e-5], "1": [2e-3, 2e-5], "3": [1e-2, 1e-3]}}
MODEL = ModelSpec(layers=2, hidden=64, heads=4, vocab=256, seq=32)
# gpt2-tiny at its position-table length (256): DeepSpeed measured Psi_p = 826,112 (docs/cluster.md)
GPT2_TINY = ModelSpec(layers=4, hidden=128, heads=4, vocab=8192, seq=256)


@pytest.fixture
def gpu(tmp_path):
    return get_gpu("local", profile=save_profile(dict(PROFILE), tmp_path / "p.json"))


def test_profile_carries_the_host_fields(gpu):
    c = gpu.calibration
    assert (c.calibrated_concurrency, c.host_cores, c.collective_backend) == (2, 2, "gloo")
    assert (c.optimizer_s_per_param, c.optimizer_s_per_tensor, c.host_transport_gbps) == (5e-9, 1e-4, 0.5)


@pytest.mark.parametrize("k, factor", [(1, 1.0), (2, 1.0), (4, 2.0), (6, 3.0)])
def test_contention_is_processor_sharing(gpu, k, factor):
    """max(1, k/c) / max(1, k_cal/c): 4 ranks on 2 cores compute at half the 2-rank profile's rate."""
    cl = Cluster(gpu, 2, ranks_per_host=k)
    assert host_costs.contention_factor(cl) == pytest.approx(factor)
    alone = Cluster(gpu, 2)     # no ranks_per_host: the profile's rates as measured
    assert compute.gemm_time(512, 512, 512, cl) == pytest.approx(factor * compute.gemm_time(512, 512, 512, alone))
    assert compute.elementwise_time(1e6, cl) == pytest.approx(factor * compute.elementwise_time(1e6, alone))


def test_optimizer_step_is_the_calibrated_rate(gpu):
    """a N + b T, N local parameters and T tensors: every tensor without ZeRO, DeepSpeed's flat groups with."""
    cl = Cluster(gpu, 1, ranks_per_host=2)
    assert compute.optimizer_time(1e6, cl, n_tensors=10) == pytest.approx(1e6 * 5e-9 + 10 * 1e-4)
    assert host_costs.optimizer_tensors(MODEL, zero_stage=0) == 2 * 12 + 4       # 12 per block, wte, wpe, final norm
    assert host_costs.optimizer_tensors(MODEL, zero_stage=1) == 2
    # inside a prediction: the compute term holds it (ZeRO-0, one rank)
    work = Workload(4, "fp32")
    lay = Candidate(1, 1, 1, 2, recompute="none", zero_stage=0)
    with_opt = predict(MODEL, lay, work, cl).time_breakdown_s["compute"]
    import dataclasses
    gpu0 = dataclasses.replace(gpu, calibration=gpu.calibration.with_overrides(optimizer_s_per_tensor=0.0))
    without = predict(MODEL, lay, work, Cluster(gpu0, 1, ranks_per_host=2)).time_breakdown_s["compute"]
    assert with_opt - without == pytest.approx(28 * 1e-4)


@pytest.mark.parametrize("stage, c0, c1", [(0, 1e-3, 1e-5), (1, 2e-3, 2e-5), (2, 2e-3, 2e-5), (3, 1e-2, 1e-3)])
def test_engine_overhead_per_micro_batch_and_module(gpu, stage, c0, c1):
    """m (c0 + c1 M) x contention, M = 6 l + 3 modules holding parameters (ZeRO-2 takes ZeRO-1's)."""
    cl = Cluster(gpu, 4, gpus_per_node=4, ranks_per_host=4)
    modules = 6 * GPT2_TINY.layers + 3
    assert host_costs.modules_with_parameters(GPT2_TINY) == modules
    lay = Candidate(1, 1, 4, 4, recompute="none", zero_stage=stage)
    pr = predict(GPT2_TINY, lay, Workload(64, "fp32"), cl)
    assert pr.time_breakdown_s["engine"] == pytest.approx(4 * (c0 + c1 * modules) * 2.0)
    assert pr.step_time_s == pytest.approx(sum(pr.time_breakdown_s.values()))


def test_per_param_and_tensor_solve():
    a, b = 3e-9, 2e-4
    times = {(n, e): a * n * e + b * n for n, e in ((4, 2 ** 18), (256, 256))}
    assert solve_per_param_and_tensor(times) == (pytest.approx(a), pytest.approx(b))


def test_shaped_link_and_host_stack_are_paid_in_series(gpu):
    """1/B = 1/B_link + 1/B_host: 1 GB/s shaped + 0.5 GB/s host -> 1/3 GB/s; intra-node stays the host's."""
    cl = Cluster(gpu, 4, gpus_per_node=2, inter_gbps=1.0, ranks_per_host=2)
    assert cl.link_gbps(4) == pytest.approx(1 / (1 / 1.0 + 1 / 0.5))
    assert cl.link_gbps(2) == pytest.approx(0.5)
    # more ranks on the host than calibrated: the host's share of each byte grows with the contention
    cl4 = Cluster(gpu, 4, gpus_per_node=2, inter_gbps=1.0, ranks_per_host=4)
    assert cl4.link_gbps(4) == pytest.approx(1 / (1 / 1.0 + 2 / 0.5))
    assert cl4.link_gbps(2) == pytest.approx(0.25)


def test_zero3_persistent_parameters_match_deepspeed():
    """stage3_param_persistence_threshold 1e5: gpt2-tiny keeps 826,112 parameters whole (measured) and
    partitions one tensor, the word embedding."""
    assert host_costs.persistent_params(GPT2_TINY) == (826_112, 1)
    assert sum(host_costs.param_tensor_sizes(GPT2_TINY)) == GPT2_TINY.params


def test_zero3_traffic_gloo(gpu):
    """Per micro-batch: 2 all-gathers of Psi - Psi_p, and the gradient reduce-scatter run as gloo's
    all-reduce (twice a ring reduce-scatter's bytes)."""
    cl = Cluster(gpu, 4, gpus_per_node=4, ranks_per_host=2)
    psi = GPT2_TINY.params
    psi_p, _ = host_costs.persistent_params(GPT2_TINY)
    got = host_costs.zero3_traffic(GPT2_TINY, 4, 1, 4, cl, "gloo")
    want = 2 * comm.all_gather((psi - psi_p) * 4, 4, 1, cl) + comm.all_reduce(psi * 4, 4, 1, cl)
    assert got == pytest.approx(want)
    nccl = host_costs.zero3_traffic(GPT2_TINY, 4, 1, 4, cl, "nccl")
    assert got - nccl == pytest.approx(comm.all_reduce(psi * 4, 4, 1, cl) - comm.reduce_scatter(psi * 4, 4, 1, cl))
    # the prediction uses it on a gloo profile
    lay = Candidate(1, 1, 4, 4, recompute="none", zero_stage=3)
    pr = predict(GPT2_TINY, lay, Workload(64, "fp32"), cl)
    assert pr.time_breakdown_s["dp_comm"] == pytest.approx(4 * got)


def test_zero1_gradient_reduction_variants(gpu):
    """mtds's ZeRO-1: reduce-scatter + all-gather, 2 Psi (d-1)/d; DeepSpeed's: all-reduce + all-gather."""
    cl = Cluster(gpu, 4, gpus_per_node=4, ranks_per_host=2)
    lay = Candidate(1, 1, 4, 4, recompute="none", zero_stage=1)
    work = Workload(64, "fp32")
    rs = predict(GPT2_TINY, lay, work, cl).time_breakdown_s["dp_comm"]
    ar = predict(GPT2_TINY, lay, work, cl, zero1_grad_reduce="all-reduce").time_breakdown_s["dp_comm"]
    nbytes = GPT2_TINY.params * 4
    assert rs == pytest.approx(comm.reduce_scatter(nbytes, 4, 1, cl) + comm.all_gather(nbytes, 4, 1, cl))
    assert ar - rs == pytest.approx(comm.all_gather(nbytes, 4, 1, cl))


def test_compare_prediction_models_the_run(tmp_path, monkeypatch):
    """compare's cell: the partition train.py builds, the host's ranks, the scheme's ZeRO-1 reduction."""
    from compare.predict import predict_cell
    from compare.schemes import parse_scheme
    path = save_profile(dict(PROFILE), tmp_path / "p.json")
    kw = dict(model="gpt2-tiny", seq=128, global_batch=64, micro_batch=4, world=4, ranks_per_node=2,
              link_bytes_per_s=1.25e8, profile=str(path))
    uniform = predict_cell(parse_scheme("ptdp:tp=2,pp=2"), balance="uniform", ranks_per_host=2, **kw)
    cost = predict_cell(parse_scheme("ptdp:tp=2,pp=2"), balance="cost", ranks_per_host=2, **kw)
    assert uniform["stages"] == [2, 2] and cost["stages"] != [2, 2]
    assert cost["step_s"] < 0.9 * uniform["step_s"]     # a core per rank: balance pays
    # 4 ranks on 2 cores: the idle stage's core goes to the busy one, balance gains little (busy_share)
    uniform4 = predict_cell(parse_scheme("ptdp:tp=2,pp=2"), balance="uniform", **kw)
    cost4 = predict_cell(parse_scheme("ptdp:tp=2,pp=2"), balance="cost", **kw)
    assert abs(cost4["step_s"] / uniform4["step_s"] - 1) < 0.05
    one_rank = predict_cell(parse_scheme("zero1"), ranks_per_host=2, **kw)
    four = predict_cell(parse_scheme("zero1"), **kw)        # default: all 4 ranks on this host, 2x contention
    assert four["breakdown_s"]["compute"] == pytest.approx(2 * one_rank["breakdown_s"]["compute"])
    ds = predict_cell(parse_scheme("zero1"), grad_reduce="all-reduce", **kw)
    assert ds["breakdown_s"]["dp_comm"] > four["breakdown_s"]["dp_comm"]


def test_rescore_reads_a_saved_sweep(tmp_path, capsys):
    from compare.rescore import main
    profile = save_profile(dict(PROFILE), tmp_path / "p.json")
    row = {"scheme": "zero1", "kind": "zero1", "tp": 1, "pp": 1, "model": "gpt2-tiny", "status": "ok",
           "link": "1gbit", "link_bits_per_s": 1e9, "nodes": 2, "ranks_per_node": 2, "tokens_per_s": 1000.0,
           "predicted": {"tokens_per_s": 2000.0}}
    meta = {"seq_length": 128, "global_batch": 64, "micro_batch": 4, "nodes": 2, "ranks_per_node": 2, "model": "gpt2-tiny",
            "profile": str(profile)}
    res = tmp_path / "results.json"
    res.write_text(json.dumps({"meta": meta, "rows": [row, {**row, "link": "30mbit", "link_bits_per_s": 3e7}]}))
    assert main([str(res), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["held_out"] for r in rows] == [False, True]
    assert rows[0]["old_ratio"] == 2.0 and rows[1]["ratio"] < rows[0]["ratio"]   # slower link, slower step
    assert main([str(tmp_path / "missing.json")]) == 2
    assert capsys.readouterr().err.startswith("error: cannot read")


def test_pipeline_idle_ranks_leave_their_cores_to_the_busy(gpu):
    """busy_share: max(1, u k / c) / max(1, k / c), u = mean rank time / critical rank time."""
    cl = Cluster(gpu, 4, gpus_per_node=2, ranks_per_host=4)
    assert host_costs.busy_share(cl, 1.0) == 1.0
    assert host_costs.busy_share(cl, 0.75) == pytest.approx(0.75)
    assert host_costs.busy_share(cl, 0.4) == pytest.approx(0.5)      # 1.6 busy ranks on 2 cores: no contention
    assert host_costs.busy_share(Cluster(gpu, 2, ranks_per_host=2), 0.5) == 1.0
    # inside a prediction: an unbalanced pipeline's compute is scaled by it
    from mtds.parallel.pipeline_layout import StageLayout
    from mtds.plan import balance
    lay = Candidate(1, 2, 2, 2, recompute="none", zero_stage=1)
    work = Workload(16, "fp32")
    stages = StageLayout((1, 1))
    report = balance.stage_report(GPT2_TINY, lay, work, cl, stages)
    u = sum(report.rank_s) / 2 / report.critical_s
    assert u < 1
    shared = predict(GPT2_TINY, lay, work, cl, stages=stages).time_breakdown_s
    alone = predict(GPT2_TINY, lay, work, Cluster(gpu, 4, gpus_per_node=2, ranks_per_host=2), stages=stages)
    # 4 ranks vs 2: contention doubles every compute time, busy_share gives back the idle ranks' share
    ratio = shared["compute"] / alone.time_breakdown_s["compute"]
    assert ratio == pytest.approx(2 * host_costs.busy_share(cl, u), rel=1e-6)


def test_calibrate_needs_a_ring(capsys):
    from mtds.cli.plan import main
    with pytest.raises(SystemExit) as exc:
        main(["--calibrate", "--calibrate-ranks", "1"])
    assert exc.value.code == 2
    assert "error: --calibrate-ranks must be >= 2" in capsys.readouterr().err
