"""benchmarks/gpu_bench.py, the prepared run for a lent GPU, exercised here by its dry run (every stage at tiny
shapes, gpt2-tiny, s = 32, b = 1/2, 2 steps, one CPU rank): results.json rewritten after every stage with all
the stages so far, each stage with its numbers; a stage that fails is recorded and the run goes on; a stage
cut by its bound keeps the cases that finished."""
from __future__ import annotations

import json
import math

import pytest

from benchmarks import gpu_bench

# Per stage, the fields (dotted paths into its record) that must be finite numbers after a dry run.
NUMBERS = {
    "host": ["peak_tflops", "launch_enqueue_us", "launch_synced_us", "launch_sync_round_trip_us",
             "python_loop_iteration_us", "tiny_step_s", "tiny_kernels_per_step", "host_us_per_kernel"],
    "baseline": ["hf.tokens_per_s", "hf.model_tflops", "hf.mfu", "hf.peak_allocated_gib", "mtds.tokens_per_s",
                 "mtds.model_tflops", "mtds.mfu", "mtds.peak_allocated_gib", "mtds_over_hf", "first_loss_rel_diff"],
    "micro-batch": ["rows.0.tokens_per_s", "rows.0.mfu", "rows.1.tokens_per_s", "rows.1.mfu",
                    "rows.1.peak_allocated_gib", "best_micro_batch"],
    "profile": ["kernels", "profiled_wall_ms", "busy_ms", "idle_ms", "busy_fraction", "by_kind.0.ms",
                "unprofiled_step_s", "host_launch_floor_ms"],
    "compile": ["eager.tokens_per_s", "eager.mfu", "compile.tokens_per_s", "compile.mfu", "compile_speedup",
                "compile-dropout.tokens_per_s", "compile_speedup_dropout"],
    "changes": ["configs.all on.tokens_per_s", "configs.all on.mfu",
                *[f"configs.off: {name}.tokens_per_s" for name in gpu_bench.SWITCHES],
                *[f"effects.{name}.speedup_of_change" for name in gpu_bench.SWITCHES],
                *[f"effects.{name}.paired_median" for name in gpu_bench.SWITCHES]],
    "repeat": ["hf.tokens_per_s", "mtds.tokens_per_s", "mtds.mfu", "mtds_repeat_over_baseline",
               "hf_repeat_over_baseline"],
}


def _get(record, path: str):
    for key in path.split("."):
        record = record[int(key)] if isinstance(record, list) else record[key]
    return record


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= 0


def test_dry_run_writes_every_stage_with_numbers(tmp_path, monkeypatch):
    snapshots = []
    write = gpu_bench._write

    def watched(ctx, meta, stage):
        write(ctx, meta, stage)
        with open(tmp_path / "results.json") as f:        # what a timeout right now would leave behind
            snapshots.append((stage, json.load(f)))

    monkeypatch.setattr(gpu_bench, "_write", watched)
    code = gpu_bench.main(["--dry-run", "--device", "cpu", "--out", str(tmp_path)])
    summary = (tmp_path / "summary.md").read_text()
    results = json.loads((tmp_path / "results.json").read_text())
    assert code == 0, summary

    # written after every stage, each time with every stage so far (and none after it)
    after = [(stage, list(snap["stages"])) for stage, snap in snapshots if stage is not None]
    assert after == [(s, list(gpu_bench.STAGES[:i + 1])) for i, s in enumerate(gpu_bench.STAGES)], after
    assert list(results["stages"]) == list(gpu_bench.STAGES)
    assert results["meta"]["plan"]["dry_run"] and results["meta"]["plan"]["sizes"] == [1, 2]

    for stage, fields in NUMBERS.items():
        rec = results["stages"][stage]
        assert rec["status"] == "ok" and rec["error"] is None, (stage, rec.get("error"))
        assert _finite(rec["seconds"]) and rec["bound_s"] > 0, stage
        bad = {f: _get(rec, f) for f in fields if not _finite(_get(rec, f))}
        assert not bad, (stage, bad)
        assert f"## {stage}: ok (" in summary, stage

    host = results["stages"]["host"]
    assert host["versions"]["torch"].startswith("2.") and host["versions"]["deepspeed"].startswith("0.")
    micro = results["stages"]["micro-batch"]
    assert [r["micro_batch"] for r in micro["rows"]] == [1, 2] and micro["first_oom_micro_batch"] is None
    assert results["stages"]["profile"]["micro_batch"] == micro["best_micro_batch"]
    assert {k["kind"] for k in results["stages"]["profile"]["by_kind"]} >= {"gemm", "attention"}
    changes = results["stages"]["changes"]
    assert changes["switch_took_effect"] == {name: True for name in gpu_bench.SWITCHES}, changes["paths_in_warmup"]
    assert all(changes["configs"][c]["steps_timed"] >= 1 for c in changes["configs"])
    assert changes["measured_by_the_baseline_only"]
    # the switches are back on in this process and the step loop unwrapped (the rank's are checked by its pool)
    import mtds.tp.cross_entropy as ce
    assert ce.CHUNKED_16BIT is False       # its default (measured slower on an H200: mtds/tp/cross_entropy.py)
    assert ce.FUSED is False               # its default (unmeasured on a GPU); the A/B turned it on and back


def test_a_failing_stage_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
    def broken(ctx, bound):
        raise RuntimeError("stage bug")

    def fine(ctx, bound):
        return {"mtds": {"tokens_per_s": 1.0}, "error": None}

    monkeypatch.setattr(gpu_bench, "STAGE_FUNCS", {**gpu_bench.STAGE_FUNCS, "host": broken, "baseline": fine})
    code = gpu_bench.main(["--dry-run", "--device", "cpu", "--out", str(tmp_path), "--stages", "host,baseline"])
    results = json.loads((tmp_path / "results.json").read_text())
    assert code == 1
    assert results["stages"]["host"]["status"] == "error"
    assert results["stages"]["host"]["error"] == "RuntimeError: stage bug"
    assert results["stages"]["baseline"]["status"] == "ok"
    assert "## host: error (" in (tmp_path / "summary.md").read_text()


def test_a_stage_cut_by_its_bound_keeps_the_finished_cases(tmp_path, monkeypatch):
    import mtds.local_ranks.spawn as spawn_module

    def cut(fn, world, stage, cases, partial, stop, timeout, on):
        with open(partial, "a") as f:       # the rank wrote its first case, then ran past the bound
            f.write(json.dumps({"case": "b=1", "kind": "mtds", "micro_batch": 1, "ok": True, "step_s": 0.5,
                                "seconds": 1.0}) + "\n")
        raise spawn_module.RankFailure(f"ranks [0] did not finish within {timeout:.0f} s (hang or deadlock)")

    monkeypatch.setattr(spawn_module, "spawn", cut)
    code = gpu_bench.main(["--dry-run", "--device", "cpu", "--out", str(tmp_path), "--stages", "micro-batch"])
    rec = json.loads((tmp_path / "results.json").read_text())["stages"]["micro-batch"]
    assert code == 1 and rec["status"] == "error" and "did not finish within 180 s" in rec["error"], rec
    assert rec["rows"][0]["step_s"] == 0.5 and rec["rows"][0]["tokens_per_s"] == pytest.approx(1 * 32 / 0.5)
    assert rec["not_run"] == [2]


def test_changes_schedule_rotates_every_configuration_through_every_position():
    names = ["on", "a", "b"]
    schedule = gpu_bench.changes_schedule(names, 1, 3)
    rounds = [schedule[i:i + 3] for i in range(0, len(schedule), 3)]
    assert rounds == [["on", "a", "b"], ["a", "b", "on"], ["b", "on", "a"], ["on", "a", "b"]]
    timed = rounds[1:]
    assert all(sorted(r[i] for r in timed) == sorted(names) for i in range(3))


def test_bounds_fit_the_eight_minutes():
    assert sum(gpu_bench.BOUNDS.values()) <= gpu_bench.BUDGET_S <= 8 * 60
    assert set(gpu_bench.BOUNDS) == set(gpu_bench.STAGES) == set(gpu_bench.STAGE_FUNCS)


def test_the_gpu_plan_cases_and_numbers(tmp_path, monkeypatch):
    """The GPU run's cases (nothing spawned): gpt2-medium at s = 1024, b = 8 for HF and mtds, the micro-batch
    stage reusing the baseline's b = 8 run and running 16 and 32, --compile with Inductor, the changes run of
    2 warm-up and 8 timed rounds; and its arithmetic against the H100 run of 2026-11-24 (111,186 tokens/s at
    b = 8 was an MFU of 27.2 %)."""
    from mtds.observe.metrics import peak_tflops
    plan = gpu_bench.plan_for(gpu_bench.parse_args([]))
    ctx = gpu_bench.Context(plan, "cuda", str(tmp_path))
    ctx.peak = peak_tflops("NVIDIA H100 80GB HBM3", "bf16")
    seen = {}

    def fake(ctx_, stage, cases, bound, stop_on_failure=False):
        seen[stage] = (cases, stop_on_failure)
        step = {"hf": 0.125, "mtds": 8 * 1024 / 111186}
        out = [{"case": c["name"], "kind": c["kind"], "micro_batch": c["micro_batch"], "ok": True,
                "step_s": step.get(c["kind"], 0.2), "profile": {"launches": 3163, "wall_ms": 113.0, "busy_ms": 65.5,
                                                              "device": "cuda", "rows": [["gemm", 22.3, 300]]}}
               for c in cases]
        for c, r in zip(cases, out):
            if c["kind"] == "alternating":       # "all on" 0.090 s a step, each change off 0.100 s
                r["steps"] = [{"step": i + 1, "config": name, "step_s": 0.09 if name == "all on" else 0.1}
                              for i, name in enumerate(c["schedule"])]
                r["paths_in_warmup"] = {name: {key: int(switch in name) for switch, key in gpu_bench.EVIDENCE.items()}
                                        for name in c["configs"]}
        return out, None

    monkeypatch.setattr(gpu_bench, "_spawn_stage", fake)
    base = gpu_bench.stage_baseline(ctx, 75)
    cases, _ = seen["baseline"]
    assert [(c["kind"], c["micro_batch"], c["workload"].seq, c["workload"].steps) for c in cases] == \
        [("hf", 8, 1024, 12), ("mtds", 8, 1024, 12)]
    model = cases[0]["workload"].model
    assert (model.hidden_size, model.num_layers, model.num_heads, model.vocab_size) == (1024, 24, 16, 50304)
    assert base["mtds"]["tokens_per_s"] == pytest.approx(111186)
    assert base["mtds"]["mfu"] == pytest.approx(0.272, abs=0.001)
    ctx.stages["baseline"] = base

    micro = gpu_bench.stage_micro_batch(ctx, 90)
    cases, stop = seen["micro-batch"]
    assert [c["micro_batch"] for c in cases] == [16, 32] and stop
    assert [r["micro_batch"] for r in micro["rows"]] == [8, 16, 32]
    assert micro["rows"][0]["source"] == "the baseline stage's run"
    ctx.stages["micro-batch"] = micro
    prof = gpu_bench.stage_profile(ctx, 35)
    assert "profile" not in seen and prof["kernels"] == 3163 and prof["idle_ms"] == pytest.approx(47.5)

    gpu_bench.stage_compile(ctx, 130)
    assert [(c.get("compile", False), c.get("backend"), c["workload"].model.hidden_dropout)
            for c in seen["compile"][0]] == [(False, None, 0.0), (True, "inductor", 0.0), (False, None, 0.1),
                                             (True, "inductor", 0.1)]
    changes = gpu_bench.stage_changes(ctx, 55)
    (case,), _ = seen["changes"]
    configs = 1 + len(gpu_bench.SWITCHES)         # all on, then each change off
    assert case["warmup"] == 2 * configs and len(case["schedule"]) == (2 + 8) * configs == case["workload"].steps
    assert changes["error"] is None and all(changes["switch_took_effect"].values())
    for effect in changes["effects"].values():
        assert effect["speedup_of_change"] == pytest.approx(0.1 / 0.09)
        assert effect["paired_off_over_on"] == pytest.approx([0.1 / 0.09] * 8)
