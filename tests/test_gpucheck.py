"""``python -m mtds.gpucheck`` in its CPU mode (gloo, tiny shapes), run in-process through the suite's rank
pools so that it cannot rot: every check writes its PASS rows with numbers (one real run of every check);
the parity verdict fails a run whose loss or grad norm is off by more than its precision allows or that
skipped a step; bad flags are one ``error:`` line with exit 2; ``auto`` picks CUDA wherever torch sees one.
Without a GPU: the CUDA parity plan (TP 2, sequence parallelism), the micro-batch sweep's sizes and stop at
the OOM, and a rank's failure named when its peers are blocked in the case's collectives."""
import functools
import os
import re
import tempfile

import pytest
import torch

from mtds.gpucheck import cli
from mtds.gpucheck.machine import resolve
from mtds.gpucheck.workloads import workloads


def rows(text: str) -> dict[str, tuple[str, str, str]]:
    """{case: (status, numbers, note)} of every table row with a PASS/FAIL/SKIP status."""
    out = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[1] in ("PASS", "FAIL", "SKIP"):
            out[cells[0]] = (cells[1], cells[2], cells[3])
    return out


@functools.lru_cache(maxsize=1)
def cpu_report() -> tuple[int, str]:
    out = os.path.join(tempfile.mkdtemp(prefix="mtds-gpucheck-test-"), "report.md")
    code = cli.main(["--device", "cpu", "--quick", "--out", out])
    with open(out) as f:
        return code, f.read()


def test_cpu_mode_report():
    code, text = cpu_report()
    got = rows(text)
    assert code == 0, text
    assert "- device: CPU (2 CPU ranks, gloo)" in text and "DeepSpeed 0." in text and "torch 2." in text, text
    for schedule in ("1f1b", "interleaved", "zb-h1", "dualpipev"):
        for precision in ("fp32", "bf16"):
            status, numbers, _ = got[f"{schedule} (t,p,d)=(1,2,1) {precision}"]
            assert status == "PASS", (schedule, precision, numbers)
            assert re.match(r"loss [0-9.e+-]+, grad norm [0-9.e+-]+ at step 1, [0-9.e+-]+ max", numbers), numbers
    status, numbers, _ = got["tp (t,p,d)=(2,1,1) sp fp32"]       # t = 2 with sequence parallelism, gloo
    assert status == "PASS" and numbers.startswith("loss "), numbers
    p2p = next(v for k, v in got.items() if k.startswith("interleaved p=2 v=2"))
    assert p2p[0] == "PASS" and "2 steps" in p2p[1], p2p
    assert got["save/resume: bit-exact continuation"][0] == "PASS"
    assert "losses max rel diff 0.0e+00, grad norms 0.0e+00" in got["save/resume: bit-exact continuation"][1]
    assert got["eval: mtds.eval vs HF on the checkpoint"][0] == "PASS"
    for run in ("HF GPT2LMHeadModel + AdamW", "mtds (1,1,1)"):
        assert got[run][0] == "PASS" and "tokens/s" in got[run][1], (run, got.get(run))
    # the speed table: a row per run with every column filled
    table = re.findall(r"^\| (HF GPT2LMHeadModel \+ AdamW|mtds \(1,1,1\)) \| ([0-9,]+) \|", text, re.M)
    assert len(table) == 2 and all(int(t.replace(",", "")) > 0 for _, t in table), table
    # mtds's last warm-up step by kind of work (--profile-step), GEMMs among them
    assert "Where step 1 of mtds (1,1,1) went (torch.profiler; cpu operators' own time" in text, text
    assert re.search(r"^\| gemm \| [0-9.]+ \| [0-9]+% \| [0-9,]+ \|$", text, re.M), text
    status, _, why = got["largest micro-batch that fits (doubling to the first OOM)"]
    assert status == "SKIP" and why.startswith("GPUs only"), (status, why)
    assert "result: **PASS** (" in text


def test_parity_verdict():
    from mtds.gpucheck.parity import judge
    from mtds.gpucheck.reference import Reference
    ref = Reference([9.0, 8.5, 8.0], [2.0, 1.5, 1.2])

    def run(loss=1.0, norm=1.0, skipped=(False,) * 3, norms=None):
        return {"losses": [x * loss for x in ref.losses], "grad_norms": norms or [x * norm for x in ref.grad_norms],
                "skipped": list(skipped)}

    assert judge("fp32", run(), ref)[0] and judge("bf16", run(1.004, 1.009), ref)[0]
    assert not judge("fp32", run(loss=1.0001), ref)[0]          # 1e-4 is no fp32 summation-order effect
    assert "loss 1.00e-04 > 1e-05" in judge("fp32", run(loss=1.0001), ref)[2]
    assert not judge("bf16", run(loss=1.006), ref)[0] and not judge("fp16", run(norm=1.02), ref)[0]
    drift = [ref.grad_norms[0], ref.grad_norms[1] * 1.1, ref.grad_norms[2]]    # later steps: drift allowed
    assert judge("bf16", run(norms=drift), ref)[0] and not judge("fp32", run(norms=drift), ref)[0]
    assert not judge("bf16", run(norms=[2.0, 1.5 * 1.2, 1.2]), ref)[0]
    assert "1 step(s) skipped" in judge("fp16", run(skipped=(False, True, False)), ref)[2]
    assert not judge("bf16", run(norms=[2.0, None, 1.2]), ref)[0]     # a norm the engine did not report
    # A spike step: HF's own fp16 autocast run drifts 35 % there (seen on an H100), so mtds's 18 % is rounding;
    # the same 18 % where the independent 16-bit run stays within 2 % is not.
    spike = [2.0, 1.5 * 1.18, 1.2]
    assert not judge("fp16", run(norms=spike), ref)[0]
    assert judge("fp16", run(norms=spike), ref, Reference(ref.losses, [2.0, 1.5 * 1.35, 1.2]))[0]
    assert not judge("fp16", run(norms=spike), ref, Reference(ref.losses, [2.0, 1.5 * 1.02, 1.2]))[0]
    assert not judge("fp16", run(norm=1.02), ref, Reference(ref.losses, [2.0 * 1.3, 1.5, 1.2]))[0]  # step 1 stays


def _fail_on_rank_one_while_rank_zero_waits(case):
    import torch.distributed as dist
    if dist.get_rank() == 1:
        raise ValueError(f"{case} failed on rank 1\nsecond line")
    dist.recv(torch.zeros(1), src=1)    # never sent: rank 0 waits as NCCL peers do in the case's collective


def _fail_on_rank_zero(case):
    import torch.distributed as dist
    if dist.get_rank() == 0:
        raise ValueError(f"{case} failed on rank 0")
    return "done"


def test_failing_rank_named_when_its_peers_block():
    """Rank 1 raises inside a case while rank 0 waits for it there: rank 1 then waits for rank 0 at the ok-flag
    all-reduce, both are killed at the bound, and the outcome still names rank 1 and its error."""
    if os.environ.get("MTDS_TEST_POOL") == "0":
        pytest.skip("pools are off: a fresh rank's gloo timeout equals the bound, a pooled one's is 1800 s")
    from mtds.gpucheck.machine import Machine
    from mtds.gpucheck.ranks import run_cases
    # no hang: the reporting (last) rank finished, and learns who failed from rank 0's note
    outcome, _ = run_cases(Machine("cpu", 2, "CPU"), 2, _fail_on_rank_zero, ["the case"], timeout=60)
    assert outcome.error is None and outcome.cases == [(False, "rank 0: ValueError: the case failed on rank 0")]
    outcome, _ = run_cases(Machine("cpu", 2, "CPU"), 2, _fail_on_rank_one_while_rank_zero_waits, ["the case"],
                           timeout=2)
    assert outcome.cases == [] and outcome.error.startswith(
        "rank 1: ValueError: the case failed on rank 1 (in case 1); the other ranks were blocked"), outcome.error
    assert "did not finish within 2 s (hang or deadlock)" in outcome.error, outcome.error


@pytest.mark.parametrize("argv, message", [
    (["--device", "gpu"], "invalid choice: 'gpu'"),
    (["--device", "cpu", "--speed-models", "gpt2-xl"], "--speed-models applies to GPUs"),
    (["--speed-models", "gpt2-huge"], "--speed-models: unknown model 'gpt2-huge'; choose from gpt2-medium"),
    (["--device", "cuda"], "--device cuda: torch sees no GPU"),
    (["--device", "cpu", "--gpus", "2"], "--gpus applies to --device cuda"),
    (["--gpus", "0"], "--gpus must be between 1 and 8"),
    (["--gpus", "two"], "invalid int value: 'two'"),
    (["--only", "parity,speeed"], "--only: unknown check speeed"),
    (["--device", "cpu", "--out", "/no/such/dir/report.md"], "No such file or directory"),
])
def test_bad_input_is_one_error_line(argv, message, capsys):
    if "torch sees no GPU" in message and torch.cuda.is_available():     # the suite's CUDA mode
        pytest.skip("a GPU is visible here: --device cuda is valid input")
    try:
        code = cli.main(argv)
    except SystemExit as stop:       # argparse's own errors leave through _Parser.error
        code = stop.code
    err = capsys.readouterr().err
    assert code == 2, (argv, err)
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err


def test_auto_never_hard_codes_cpu(monkeypatch):
    """auto picks CUDA whenever torch sees a GPU (the device-choice logic, without a GPU)."""
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H100 80GB HBM3")
    machine = resolve("auto", None)
    assert (machine.device, machine.ranks, machine.name) == ("cuda", 4, "NVIDIA H100 80GB HBM3")
    assert resolve("auto", 2).ranks == 2
    from mtds.gpucheck import parity, speed
    w = workloads("cuda", False)
    cases = parity.cases_for(machine, w["parity"], ("bf16", "fp16"))
    assert sorted(cases) == [2, 4] and len(cases[2]) == 8 + 4 and len(cases[4]) == 8 + 2
    assert {c.tp for c in cases[4]} == {2} and {c.device for c in cases[4]} == {"cuda"}
    assert speed.spread_layout(4) == (2, 2, 1) and speed.spread_layout(8) == (2, 2, 2)
    assert speed.workload_for(w["speed"], (2, 2, 2)).global_batch == w["speed"].micro_batch * 8    # m = 4p
    # 64 MiB per message at p = 2 on GPUs (bf16)
    from mtds.gpucheck.p2p_stress import message_bytes
    assert message_bytes(w["p2p"], "bf16") == 64 * 2 ** 20


def test_parity_plan_has_tp_and_sequence_parallel():
    """From two GPUs the matrix holds (t,p,d) = (2,1,1) with and without sequence parallelism in each
    precision (with four, SP under 1f1b at (2,2,1) too); CPU keeps its p = 2 schedules plus one fp32 SP case."""
    from mtds.gpucheck.machine import Machine
    from mtds.gpucheck.parity import cases_for

    def plan(device, ranks, precisions):
        w = workloads(device, False)["parity"]
        return {world: [(c.schedule, c.tp, c.pp, c.sequence_parallel, c.precision) for c in cases]
                for world, cases in cases_for(Machine(device, ranks, "NVIDIA H100 80GB HBM3"), w, precisions).items()}

    schedules = ("1f1b", "interleaved", "zb-h1", "dualpipev")
    two = plan("cuda", 2, ("bf16", "fp16"))
    assert sorted(two) == [2]
    assert two[2][:8] == [(s, 1, 2, False, p) for s in schedules for p in ("bf16", "fp16")]
    assert two[2][8:] == [("1f1b", 2, 1, sp, p) for sp in (False, True) for p in ("bf16", "fp16")]
    four = plan("cuda", 4, ("bf16", "fp16"))
    assert four[2] == two[2] and four[4][8:] == [("1f1b", 2, 2, True, p) for p in ("bf16", "fp16")]
    cpu = plan("cpu", 2, ("fp32", "bf16"))
    assert sorted(cpu) == [2] and cpu[2][8:] == [("1f1b", 2, 1, True, "fp32")]
    assert cpu[2][:8] == [(s, 1, 2, False, p) for s in schedules for p in ("fp32", "bf16")]


def test_micro_batch_sweep_doubles_to_the_first_oom():
    """The speed check's sweep (GPUs): b, 2b, ... until torch's OOM; tokens/s and MFU per size that fit."""
    from mtds.gpucheck import microbatch
    from mtds.gpucheck.machine import Machine
    from mtds.gpucheck.report import Section, render
    tried = []

    def run(b, oom_from=64, crash_at=None):
        tried.append(b)
        if b == crash_at:
            raise ValueError("shape mismatch")
        if b >= oom_from:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore text")
        return {"step_s": 0.05 + 0.01 * b, "allocated_gib": b / 2, "reserved_gib": b / 2 + 1}

    oom = "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    rows = microbatch.sweep(run, 8)
    assert tried == [8, 16, 32, 64] and [r["ok"] for r in rows] == [True, True, True, False]
    assert rows[-1]["oom"] and rows[-1]["error"] == oom
    assert microbatch.largest(rows) == 32
    section = Section("speed")
    h100 = Machine("cuda", 1, "NVIDIA H100 80GB HBM3")
    microbatch.add_rows(section, rows, workloads("cuda", False)["speed"], "bf16", h100)
    assert [t["run"] for t in section.table] == [f"mtds (1,1,1) b = {b}" for b in (8, 16, 32, 64)]
    assert [t["tokens/s"] for t in section.table] == ["63,015", "78,019", "88,562", "OOM"]   # b*1024/step_s
    mfu = [float(t["MFU"].rstrip("%")) for t in section.table[:3]]
    assert 0 < mfu[0] < mfu[1] < mfu[2], section.table          # per size, as tokens/s
    row = section.rows[-1]
    assert row.status == "PASS", row
    assert row.numbers.startswith("b = 32 fits, b = 64 ran out of memory; b = 8: 63,015 tokens/s, MFU "), row.numbers
    assert "| mtds (1,1,1) b = 64 | OOM |" in render([], [section])
    # the other ends: an OOM at the first size and another error fail; the limit without an OOM passes
    first = microbatch.sweep(lambda b: run(b, oom_from=8), 8)
    assert microbatch.verdict(first) == (False, f"b = 8, the first size, ran out of memory: {oom}")
    crashed = microbatch.sweep(lambda b: run(b, crash_at=16), 8)
    assert len(crashed) == 2
    assert microbatch.verdict(crashed) == (False, "b = 16 failed (not an OOM): ValueError: shape mismatch")
    tried.clear()
    assert microbatch.verdict(microbatch.sweep(lambda b: run(b, oom_from=10 ** 9), 4, limit=32))[0]
    assert tried == [4, 8, 16, 32]


def test_micro_batch_sweep_runs_mtds_per_size(tmp_path):
    """The sweep's rank side on CPU, capped at 2b (no OOM to stop at): a real mtds run per size, timed."""
    from mtds.gpucheck import microbatch
    from mtds.gpucheck.machine import Machine
    from mtds.gpucheck.ranks import run_cases
    from mtds.gpucheck.report import Section
    w, cpu = workloads("cpu", True)["speed"], Machine("cpu", 1, "CPU")
    outcome, _ = run_cases(cpu, 1, microbatch._rank_sweep, [(w, "fp32", 0, str(tmp_path), 2 * w.micro_batch)],
                           timeout=120)
    assert outcome.error is None and outcome.cases[0][0], outcome
    rows = outcome.cases[0][1]
    assert [(r["micro_batch"], r["ok"]) for r in rows] == [(w.micro_batch, True), (2 * w.micro_batch, True)]
    section = Section("speed")
    microbatch.add_rows(section, rows, w, "fp32", cpu)
    row = section.rows[-1]
    assert row.status == "PASS" and row.numbers.startswith(f"b = {2 * w.micro_batch} fit, the sweep's limit"), row
    assert all(int(t["tokens/s"].replace(",", "")) > 0 for t in section.table), section.table


def test_gpu_shapes_are_runnable(monkeypatch):
    """What the GPU mode will run passes train.py's start-up judgement (the rulebook and the DeepSpeed config:
    mtds.training.admit, up to where it would build the model) for 1-8 GPUs, so a GPU run cannot stop on a shape
    we chose."""
    import torch
    from deepspeed.accelerator import get_accelerator

    from mtds.gpucheck import ds_configs, parity, speed
    from mtds.gpucheck.machine import Machine
    from mtds.training.admit import admit
    monkeypatch.setattr(get_accelerator(), "is_fp16_supported", lambda: True)     # as a GPU says
    for quick in (False, True):
        w = workloads("cuda", quick)
        for gpus in range(1, 9):
            machine = Machine("cuda", gpus, "NVIDIA H100 80GB HBM3")
            checks = [(c.workload, (c.tp, c.pp, 1), c.schedule, c.precision, c.sequence_parallel) for cases in
                      parity.cases_for(machine, w["parity"], ("bf16", "fp16")).values() for c in cases]
            checks += [(w["p2p"], (1, 2, 1), "interleaved", "bf16", False),
                       (w["resume"], (1, min(gpus, 2), 1), "1f1b", "bf16", False)]
            for layout in ((1, 1, 1), speed.spread_layout(gpus)):
                if layout:
                    checks.append((speed.workload_for(w["speed"], layout), layout, "1f1b", "bf16", False))
            for workload, (tp, pp, dp), schedule, precision, sp in checks:
                assert tp * pp * dp <= gpus or pp == 2 and gpus == 1 and schedule == "interleaved"   # p2p: skipped
                v = 2 if schedule == "interleaved" else 1
                cfg = ds_configs.train_config(workload, precision, "cuda", tp=tp, pp=pp, dp=dp,
                                              pipeline_schedule=schedule, virtual_stages=v, sequence_parallel=sp)
                assert cfg.deepspeed_config["optimizer"]["params"]["fused"] is True
                admit(cfg, tp * pp * dp, workload.model, torch.device("cpu"))     # the partition priced on the host
                assert workload.seq <= workload.model.max_position_embeddings


def test_speed_models_are_the_shapes_that_ran_on_an_h100():
    from mtds.gpucheck.workloads import speed_workload
    xl = speed_workload("gpt2-xl")
    assert (xl.model.hidden_size, xl.model.num_layers, xl.model.num_heads, xl.model.vocab_size) == (1600, 48, 25, 50304)
    assert (xl.seq, xl.micro_batch, xl.global_batch, xl.steps) == (1024, 4, 4, 12)
    assert speed_workload("gpt2-medium", quick=True).steps == 6
