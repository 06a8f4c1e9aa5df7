"""ZeRO-2 and ZeRO-3 with a pipeline. ZeRO-2 (mtds.deepspeed_compat.zero2_reduce): both modes of ``--zero2-pipeline-reduce``, at
(t,p,d) = (1,2,2) on 1F1B (DeepSpeed's engine) and ZB-H1 (mtds's), and the micro-batch mode on DualPipeV
(DeepSpeed's, both ends of the tied embedding on rank 0): losses and pre-clip gradient norms equal the
single-process HuggingFace reference within 1e-5 relative over 10 clipped fp32 steps (the suite's fp32 bound:
the micro-batch mode sums each micro-batch's reduced gradient, another order than ZeRO-1's); the model state a
rank holds at the end of its last backward of step 2 (parameters, gradients, master weights and Adam state,
read from the tensors) equal to docs/training.md's formula of each mode within 5 %; the bytes the traced
data-parallel collectives send per step, summed over each stage's d ranks, equal the formula within 1 %
(DeepSpeed pads its flat partitions; the loss and norm scalars ride the same group). ZeRO-3
(mtds.deepspeed_compat.zero3_params): the same checks on ZERO3_CASES, the held state also between steps and
after the last backward's reduction. A ZeRO-2 checkpoint resumes at ZeRO-1, a ZeRO-1 one at ZeRO-3 and a
ZeRO-3 one at ZeRO-2, exactly. ZeRO-2's (2,2,2) runs in tests/test_pipe_parity.py's 8-rank launch."""
from __future__ import annotations

import functools
import os
import tempfile

from tests.training_helpers import ds_config, hf_reference, max_rel_diff, train_config

REL_TOL = 1e-5
MEMORY_TOL = 0.05
BYTES_TOL = 0.01


def zero2(mode: str | None, schedule: str = "1f1b", stage: int = 2, precision: str = "fp32", **kwargs):
    """ZeRO-2 (``mode``: --zero2-pipeline-reduce) or ZeRO-3 (``mode``: --zero3-pipeline-gather) at p = 2 (``mode``
    None: the stage's default); bf16 with fp32 accumulation (DeepSpeed's BF16_Optimizer)."""
    # DualPipeV needs m >= 2p = 4: micro batch 1 (m = 4 at d = 2), the reference's samples and mean loss
    extra = {"train_micro_batch_size_per_gpu": 1} if schedule == "dualpipev" else {}
    if precision == "bf16":
        extra.update(precision="bf16", data_types={"grad_accum_dtype": "fp32"})
    ds = ds_config(zero=stage, **extra)
    option = {} if mode is None else {"zero3_pipeline_gather" if stage == 3 else "zero2_pipeline_reduce": mode}
    return train_config(pp=kwargs.pop("pp", 2), tp=kwargs.pop("tp", 1), pipeline_schedule=schedule,
                        deepspeed_config=ds, **option, **kwargs)


def _held(engine) -> dict:
    """Bytes of the model state this rank holds now, from its tensors (each storage once)."""
    from mtds.deepspeed_compat import pipeline as ds_pipeline
    opt, reducer = engine.optimizer, engine.__dict__["mtds_zero1_reduce"]

    def nbytes(tensors) -> int:
        storages = {}
        for t in tensors:
            if t is not None:
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(storages.values())

    params = list(engine.module.parameters())
    partitions = [partition.flat_partition for partition, _ in (getattr(reducer, "accumulated", None) or {}).values()]
    if hasattr(opt, "fp32_groups_gradients_flat"):     # BF16_Optimizer: its fp32 buffers, bf16_flat's, bf16_zero2's
        flat = engine.__dict__.get("mtds_flat_bf16")
        partitions += list(opt.fp32_groups_gradients_flat) + (flat.flats if flat is not None else [])
        partitions += list(getattr(reducer, "partitions", [])) + list(getattr(reducer, "late", {}).values())
    masters = getattr(opt, "single_partition_of_fp32_groups", None) or opt.fp32_groups_flat_partition
    state = [t for s in opt.optimizer.state.values() for t in s.values() if hasattr(t, "untyped_storage")]
    return dict(params=nbytes(params), grads=nbytes([p.grad for p in params] + partitions),
                optimizer=nbytes(list(masters) + state),
                late=sum(p.numel() for p in ds_pipeline.tied_parameters(engine.module)))


def _probe(engine, groups):
    """Measure :func:`_held` when the stage's last backward of step 2 has ended (its early reduction starts;
    ``reduced``: when it has ended), and between steps 1 and 2 (``between``: as step 2 starts)."""
    engine.mtds_test_where = (groups.coords.pp_rank, groups.tp_rank, groups.layout.dp)
    reducer = engine.__dict__.get("mtds_zero1_reduce")
    if reducer is None:
        return
    train_batch, steps = engine.train_batch, []

    def train_batch_measured(*args, **kwargs):
        steps.append(1)
        if len(steps) == 2:
            engine.mtds_test_between = _held(engine)
        return train_batch(*args, **kwargs)

    engine.train_batch = train_batch_measured
    early, calls = reducer.reduce_early, []

    def measured():
        calls.append(1)
        if len(calls) == 2:
            engine.mtds_test_held = _held(engine)
        out = early()
        if len(calls) == 2:
            engine.mtds_test_reduced = _held(engine)
        return out

    reducer.reduce_early = measured


def runs_with_probe(configs):
    """Run each config on this rank; each RunResult with ``held`` (:func:`_held` at step 2, where mtds's reducer
    runs), ``where`` (stage, TP rank, d) and ``micro_batches``."""
    from mtds.training import run
    engines, results = [], []
    for cfg in configs:
        result = run(cfg, on_engine_ready=[lambda engine, groups: (_probe(engine, groups), engines.append(engine))])
        engine = engines[-1]
        result.held = getattr(engine, "mtds_test_held", None)
        result.between = getattr(engine, "mtds_test_between", None)
        result.reduced = getattr(engine, "mtds_test_reduced", None)
        result.where = engine.mtds_test_where
        result.micro_batches = engine.micro_batches
        shards = engine.__dict__.get("mtds_zero3_params")
        result.prefetched = None if shards is None else shards.overlapped
        engines.clear()
        results.append(result)
    return results


MODES = ("micro-batch", "step")
SCHEDULES = ("1f1b", "zb-h1")
CASES = tuple((s, m) for s in SCHEDULES for m in MODES) + (("dualpipev", "micro-batch"),)
# --zero3-pipeline-gather: both modes on DeepSpeed's 1F1B, micro-batch on mtds's engine, step on DualPipeV
ZERO3_CASES = (("1f1b", "step"), ("1f1b", "micro-batch"), ("zb-h1", "micro-batch"), ("dualpipev", "step"))
# bf16 (BF16_Optimizer, fp32 accumulation; mtds.deepspeed_compat.bf16_zero2), 5 steps: ZeRO-1 on 1F1B (the
# baseline, saving at step 3), ZeRO-2 both modes on 1F1B, ZeRO-3 micro-batch on ZB-H1 (mtds's engine; saving at
# step 3); then, resuming step 3 (steps 4-5: two runs fewer than separate resume runs), ZeRO-2 micro-batch on
# ZB-H1 from ZeRO-3's checkpoint and ZeRO-3 step on 1F1B from ZeRO-1's
BF16_CASES = ((1, "1f1b", None), (2, "1f1b", "step"), (2, "1f1b", "micro-batch"), (3, "zb-h1", "micro-batch"),
              (2, "zb-h1", "micro-batch"), (3, "1f1b", "step"))
BF16_STEPS = 5


@functools.lru_cache(maxsize=1)
def four_rank_runs():
    """One 4-rank launch: each mode on each schedule for 10 steps (the first saving at step 5), then the resume
    chain: ZeRO-1 loads the ZeRO-2 (micro-batch) checkpoint of step 5 and saves at step 6, ZeRO-3 (step) loads
    that, runs steps 7-8 and saves at step 7, ZeRO-2 (step) loads that and runs step 8."""
    from lab.testing import spawn
    a, b, c = (tempfile.mkdtemp(prefix=f"mtds-z2{x}-") for x in "abc")
    parity = [zero2(mode, schedule, **(dict(save=a, save_interval=5) if k == 0 else {}))
              for k, (schedule, mode) in enumerate(CASES)]
    parity += [zero2(mode, schedule, stage=3) for schedule, mode in ZERO3_CASES]
    e, f = (tempfile.mkdtemp(prefix=f"mtds-z2{x}-") for x in "ef")
    extra = {0: dict(save=e, save_interval=3), 3: dict(save=f, save_interval=3),
             4: dict(load=os.path.join(f, "global_step3")), 5: dict(load=os.path.join(e, "global_step3"))}
    parity += [zero2(mode, schedule, stage=stage, precision="bf16", steps=BF16_STEPS, **extra.get(j, {}))
               for j, (stage, schedule, mode) in enumerate(BF16_CASES)]
    chain = [train_config(pp=2, steps=7, load=os.path.join(a, "global_step5"), save=b, save_interval=6),
             zero2("step", stage=3, steps=8, load=os.path.join(b, "global_step6"), save=c, save_interval=7),
             zero2("step", steps=8, load=os.path.join(c, "global_step7"))]
    return spawn(runs_with_probe, 4, parity + chain, timeout=600)


def test_zero2_pipeline_matches_hf_memory_and_bytes_formulas():
    per_rank = four_rank_runs()
    ref = hf_reference()
    for k, (schedule, mode) in enumerate(CASES):
        what = f"ZeRO-2 {mode} {schedule} (1,2,2)"
        result = per_rank[-1][k]       # the last stage reports
        diff = max_rel_diff(result.losses, ref.losses)
        assert diff < REL_TOL, f"{what}: losses max rel diff {diff:.2e}\n{result.losses}\n{ref.losses}"
        diff = max_rel_diff(result.grad_norms, ref.grad_norms)
        assert diff < REL_TOL, f"{what}: grad norms max rel diff {diff:.2e}\n{result.grad_norms}\n{ref.grad_norms}"
        for rank, results in enumerate(per_rank):
            r = results[k]
            psi, d = r.params, r.where[2]
            grads = 4 * (psi / d + r.held["late"]) if mode == "micro-batch" else 4 * psi
            want = dict(params=4 * psi, grads=grads, optimizer=12 * psi / d)
            for part, value in want.items():
                got = r.held[part]
                assert abs(got / value - 1) <= MEMORY_TOL, \
                    f"{what} rank {rank}: {part} {got} bytes held = {got / value:.3f} x the formula's {value:.0f}"
        assert_zero2_dp_bytes(per_rank, k, mode, what)


def assert_parity(result, what: str) -> None:
    ref = hf_reference()
    diff = max_rel_diff(result.losses, ref.losses)
    assert diff < REL_TOL, f"{what}: losses max rel diff {diff:.2e}\n{result.losses}\n{ref.losses}"
    diff = max_rel_diff(result.grad_norms, ref.grad_norms)
    assert diff < REL_TOL, f"{what}: grad norms max rel diff {diff:.2e}\n{result.grad_norms}\n{ref.grad_norms}"


def assert_held(held: dict, want: dict, what: str) -> None:
    for part, value in want.items():
        got = held[part]
        ok = got == 0 if value == 0 else abs(got / value - 1) <= MEMORY_TOL
        assert ok, f"{what}: {part} {got} bytes held, the formula's {value:.0f}"


def test_zero3_pipeline_matches_hf_memory_and_bytes_formulas():
    """ZeRO-3 at p > 1 (mtds.deepspeed_compat.zero3_params), ZERO3_CASES at (1,2,2): parity as ZeRO-2's; between steps a rank holds no working parameters and no gradients, only the
    fp32 master partition and Adam state (12Ψ/d); at the end of its last backward the step mode holds the
    whole parameters and gradients (4Ψ each), the micro-batch mode none of the parameters and ZeRO-2's
    micro-batch gradients; the data-parallel bytes add one all-gather per step (step) or 2m (micro-batch). The
    micro-batch mode's gathers are prefetched (issued before the pass's receive, in flight while it waits) and
    change no value: its losses and norms are ZeRO-2's micro-batch mode's on the same schedule bit for bit."""
    per_rank = four_rank_runs()
    for j, (schedule, mode) in enumerate(ZERO3_CASES):
        k, what = len(CASES) + j, f"ZeRO-3 {mode} {schedule} (1,2,2)"
        assert_parity(per_rank[-1][k], what)
        for rank, results in enumerate(per_rank):
            r = results[k]
            psi, d = r.params, r.where[2]
            assert_held(r.between, dict(params=0, grads=0, optimizer=12 * psi / d), f"{what} rank {rank} between steps")
            last = dict(params=4 * psi, grads=4 * psi) if mode == "step" else \
                dict(params=0, grads=4 * (psi / d + r.held["late"]))
            assert_held(r.held, last, f"{what} rank {rank} at its last backward")
            assert_held(r.reduced, dict(params=0), f"{what} rank {rank} after its last backward's reduction")
        assert_zero2_dp_bytes(per_rank, k, "step" if mode == "step" else "micro-batch", what,
                              gathers=1 if mode == "step" else None)
        if mode == "micro-batch":
            # prefetched: on each stage the passes after a receive (stage 0's backwards, stage 1's forwards, m
            # a step) had their gather in flight while the receive waited; the bytes are the same, so the
            # losses and norms are ZeRO-2's of the same mode and schedule bit for bit
            for rank, results in enumerate(per_rank):
                r = results[k]
                want = r.micro_batches * len(per_rank[-1][k].losses)
                assert r.prefetched == want, f"{what} rank {rank}: {r.prefetched} gathers prefetched, want {want}"
            zero2 = per_rank[-1][CASES.index((schedule, mode))]
            assert per_rank[-1][k].losses == zero2.losses, (what, per_rank[-1][k].losses, zero2.losses)
            assert per_rank[-1][k].grad_norms == zero2.grad_norms, (what, per_rank[-1][k].grad_norms, zero2.grad_norms)


def assert_zero2_dp_bytes(per_rank: list, index: int, mode: str, what: str, gathers: int | None = 1,
                          element: int = 4) -> None:
    """The bytes the data-parallel collectives sent in the last step, summed over the d ranks of each (stage, TP
    rank), against e(d-1)(R + gathers x Ψ), e = ``element`` bytes (fp32 4, bf16 2): R = Ψ reduce-scattered once
    (step mode, ZeRO-1's) or m(Ψ - Ψ_late) + Ψ_late (micro-batch mode), then the parameter all-gathers (ZeRO-2:
    one; ZeRO-3 micro-batch, ``gathers`` None: 2m). Results from :func:`runs_with_probe`."""
    sent = {}
    for results in per_rank:
        r = results[index]
        stage, tp_rank, d = r.where
        bus = sum(v["bus_bytes"] for key, v in r.comm.items() if key.endswith("/dp") and not key.startswith("recv/"))
        total = sent.setdefault((stage, tp_rank), [0, r.params, r.held["late"], r.micro_batches, d])
        total[0] += bus
    for (stage, tp_rank), (bus, psi, late, m, d) in sent.items():
        reduced = m * (psi - late) + late if mode == "micro-batch" else psi
        want = element * (d - 1) * (reduced + (2 * m if gathers is None else gathers) * psi)
        assert abs(bus / want - 1) <= BYTES_TOL, \
            f"{what} stage {stage} TP rank {tp_rank}: data-parallel bytes sent {bus} = {bus / want:.4f} x {want}"


BF16_LOSS_BOUND, BF16_NORM_BOUND = 1e-4, 2e-3   # the suite's bounds for bf16 reductions in another order


def test_zero2_zero3_pipeline_bf16_match_zero1_memory_and_bytes_formulas():
    """bf16 ZeRO-2/3 at p > 1 (mtds.deepspeed_compat.bf16_zero2, zero3_params), BF16_CASES at (1,2,2), 5 clipped
    steps, against ZeRO-1 bf16 on the same layout: ZeRO-2's step mode is ZeRO-1's arithmetic operation for
    operation (bit-identical losses and norms), and so is ZeRO-3's (its gathered weights the bf16 casts DeepSpeed's
    step makes: resuming ZeRO-1's step 3, its steps 4-5 are ZeRO-1's bit for bit); the micro-batch mode rounds
    each micro-batch's gradient to bf16 for its reduction and sums the micro-batches in fp32 after it (ZeRO-1: in
    fp32 before one rounding), so it stays within the suite's bf16 bounds for reductions in another order
    (worst of docs/testing.md's three kernel sets, 2026-11-29: loss 1.7e-5, norm 6.7e-4; the bounds of
    tests/test_context_parallel.py's bf16 runs: 1e-4 and 2e-3); ZeRO-3's micro-batch mode is ZeRO-2's arithmetic (resuming ZeRO-3's step 3, ZeRO-2
    runs its steps 4-5 bit for bit). ZeRO-1 itself within the
    suite's bf16 bound (2e-2) of the HF fp32 reference. Memory at the end of step 2's last backward: the bf16
    working weights 2Ψ (ZeRO-3 micro-batch: 0), master and Adam 12Ψ/d, gradients 6Ψ (fp32 + bf16 buffers, step
    mode) or 4(Ψ/d + Ψ_late) (micro-batch mode: no full-size buffer); between steps no gradients (ZeRO-3: no
    weights either). Bytes: fp32's formulas in 2-byte elements."""
    from tests.bounds import same, within
    per_rank, ref = four_rank_runs(), hf_reference()
    first = len(CASES) + len(ZERO3_CASES)
    base = per_rank[-1][first]
    assert max_rel_diff(base.losses, ref.losses[:BF16_STEPS]) < 2e-2, (base.losses, ref.losses)
    for j, (stage, schedule, mode) in enumerate(BF16_CASES[1:], start=1):
        k, what = first + j, f"bf16 ZeRO-{stage} {mode} {schedule} (1,2,2)"
        r = per_rank[-1][k]
        if j == 4:      # ZeRO-2 resuming ZeRO-3's step 3, the same arithmetic: ZeRO-3's steps 4-5 bit for bit
            saved = per_rank[-1][first + 3]
            assert same("zero2_pipeline.bf16_zero2_resumes_zero3.losses", r.losses, saved.losses[3:]), \
                (what, r.losses, saved.losses)
            assert same("zero2_pipeline.bf16_zero2_resumes_zero3.norms", r.grad_norms, saved.grad_norms[3:]), \
                (what, r.grad_norms, saved.grad_norms)
        elif j == 5:    # ZeRO-3 step resuming ZeRO-1's step 3, the same arithmetic: ZeRO-1's steps 4-5 bit for bit
            assert same("zero2_pipeline.bf16_zero3_step_resumes_zero1.losses", r.losses, base.losses[3:]), \
                (what, r.losses, base.losses)
            assert same("zero2_pipeline.bf16_zero3_step_resumes_zero1.norms", r.grad_norms, base.grad_norms[3:]), \
                (what, r.grad_norms, base.grad_norms)
        elif mode == "step":
            assert same("zero2_pipeline.bf16_step_vs_zero1.losses", r.losses, base.losses), (what, r.losses, base.losses)
            assert same("zero2_pipeline.bf16_step_vs_zero1.norms", r.grad_norms, base.grad_norms), \
                (what, r.grad_norms, base.grad_norms)
        else:
            loss, norm = max_rel_diff(r.losses, base.losses), max_rel_diff(r.grad_norms, base.grad_norms)
            assert within("zero2_pipeline.bf16_micro_batch_vs_zero1.loss", loss, BF16_LOSS_BOUND), (what, loss)
            assert within("zero2_pipeline.bf16_micro_batch_vs_zero1.norm", norm, BF16_NORM_BOUND), (what, norm)
        for rank, results in enumerate(per_rank):
            r = results[k]
            psi, d, late = r.params, r.where[2], r.held["late"]
            grads = 6 * psi if mode == "step" else 4 * (psi / d + late)
            params = 0 if (stage, mode) == (3, "micro-batch") else 2 * psi
            assert_held(r.held, dict(params=params, grads=grads, optimizer=12 * psi / d), f"{what} rank {rank}")
            assert_held(r.between, dict(params=0 if stage == 3 else 2 * psi, grads=0, optimizer=12 * psi / d),
                        f"{what} rank {rank} between steps")
            if stage == 3:
                assert_held(r.reduced, dict(params=0), f"{what} rank {rank} after its last backward's reduction")
            if (stage, mode) == (3, "micro-batch"):     # prefetched (m a step on each stage) as in fp32, but the
                # step-3 save gathers and leaves them whole for stage 1's first forward of step 4
                want = r.micro_batches * BF16_STEPS - (1 if r.where[0] == 1 else 0)
                assert r.prefetched == want, f"{what} rank {rank}: {r.prefetched} gathers prefetched, want {want}"
        gathers = 1 if stage == 2 or mode == "step" else None
        assert_zero2_dp_bytes(per_rank, k, mode, what, gathers=gathers, element=2)


def test_resume_between_zero1_and_zero2_is_exact():
    """The step after a load runs on the loaded weights: its loss is the saving run's bit for bit; the one after
    on the loaded Adam state too (ZeRO-1 and ZeRO-2 micro-batch sum the gradients in another order: 1e-6).
    Both ways: ZeRO-2 micro-batch -> ZeRO-1 -> ZeRO-3 step -> ZeRO-2 step (ZeRO-2/3 at p > 1 write ZeRO-1's
    files; ZeRO-3 gathers its parameters for the save)."""
    runs = four_rank_runs()[-1]
    saved2, (loaded1, loaded3, loaded2) = runs[0], runs[-3:]
    assert loaded1.losses[0] == saved2.losses[5], (saved2.losses, loaded1.losses)
    assert max_rel_diff(loaded1.losses[1:2], saved2.losses[6:7]) < 1e-6, (saved2.losses, loaded1.losses)
    assert loaded3.losses[0] == loaded1.losses[1], (loaded1.losses, loaded3.losses)
    assert loaded2.losses[0] == loaded3.losses[1], (loaded3.losses, loaded2.losses)
