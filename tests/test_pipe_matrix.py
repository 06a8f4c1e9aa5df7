"""The rest of the pipeline-schedule check matrix (tests/test_pipe_parity.py holds the first cells), one
spawned launch per world size:

- HF parity (losses and pre-clip grad norms 1e-5 relative, 10 clipped fp32 steps): dualpipev at (1,4,1)
  ZeRO-0 and ZeRO-1 and (2,2,1) ZeRO-0 ((2,2,2) is in tests/test_pipe_parity.py's 8-rank launch);
  interleaved v=2 at (1,4,1) ZeRO-0 and v=3 (p=2, six blocks); zb-h1 at (1,2,1) ZeRO-0/1, (1,4,1)
  ZeRO-0/1 and (2,2,1) ZeRO-0.
- interleaved fp16 (DeepSpeed's loss scaler on mtds's engine) against 1f1b fp16 at the same layout.
- Checkpoints written under one schedule resumed under another (dualpipev <-> 1f1b, zb-h1 -> 1f1b,
  dualpipev -> dualpipev, interleaved v=2 -> v=3; zb-h1 bf16 -> 1f1b bf16, zb-h1 fp16 -> zb-h1 fp16) exactly,
  and interleaved v=2 at (2,2,1) resumed at another t and another p.
- DualPipeV's batched p2p counted by the collective tracer against the formula.

DualPipeV needs m >= 2p micro-batches: its (1,4,1) cells run micro-batch 1 (m = 8), the
same samples and the same mean loss as the reference's micro-batch 2 (every micro-batch has s tokens).
"""
import functools
import json
import os
import tempfile
from dataclasses import replace

from tests.bounds import same, within
from tests.training_helpers import (STEPS, TINY, assert_same_up_to_norm_order, ds_config, hf_reference, max_rel_diff,
                                    run_layouts, train_config)

REL_TOL = 1e-5
TINY6 = replace(TINY, num_layers=6)      # p·v = 6 virtual stages at (1,2,1) v=3
TINY8 = replace(TINY, num_layers=8)      # p·v = 8 virtual stages at (1,4,1) (interleaved v=2, dualpipev)
CKPT_AT = 8                              # checkpoint runs save at step 8 (and 10) and resume for steps 9-10
LAYOUT_CKPT_AT = 5                       # at another t/p: save at step 5, resume for steps 6-10
FP16_STEPS = 5
B, S, H = 2, 32, 64                      # micro batch, sequence, hidden of the p2p messages
FP16_TOL = 2e-5                          # interleaved fp16 vs 1f1b fp16 losses (measured: see the test)
ZB16_STEPS, ZB16_AT = 5, 3               # zb-h1 bf16/fp16 checkpoints: save at step 3 of 5, resume for 4-5


@functools.lru_cache(maxsize=None)
def reference(cfg=TINY):
    return hf_reference(cfg)


def run(schedule, tp, pp, zero=1, micro=2, precision="fp32", **kwargs):
    ds = ds_config(zero=zero, precision=precision, train_micro_batch_size_per_gpu=micro)
    return train_config(tp=tp, pp=pp, pipeline_schedule=schedule, deepspeed_config=ds, **kwargs)


def assert_hf_parity(result, what, cfg=TINY, ref=None):
    ref = reference(cfg) if ref is None else ref
    diff = max_rel_diff(result.losses, ref.losses)
    assert diff < REL_TOL, f"{what}: losses max rel diff {diff:.2e}\n{result.losses}\n{ref.losses}"
    assert None not in result.grad_norms, (what, result.grad_norms)
    diff = max_rel_diff(result.grad_norms, ref.grad_norms)
    assert diff < REL_TOL, f"{what}: grad norms max rel diff {diff:.2e}\n{result.grad_norms}\n{ref.grad_norms}"


def dualpipev_messages(rank, p, m):
    """Messages one rank sends per step under DualPipeV: virtual stages ``rank`` and ``2p-1-rank``, each
    sends m activations unless it is the last virtual stage and m gradients unless it is the first; the
    turn-around (stage p-1 -> p, both on rank p-1) stays on the rank."""
    count = 0
    for stage in (rank, 2 * p - 1 - rank):
        count += m * (stage != 2 * p - 1 and stage != p - 1)      # activation to stage + 1 on another rank
        count += m * (stage != 0 and stage != p)                  # gradient to stage - 1 on another rank
    return count


def assert_dualpipev_p2p(per_rank, index, p, m, micro, tp=1, dp=1, what=""):
    """The tracer counts each P2POp of DeepSpeed's batch_isend_irecv; DualPipeV sends whole activations
    (no scatter/gather) on the default group."""
    for rank, results in enumerate(per_rank):
        comm = results[index].comm
        stage = rank // (tp * dp)     # ranks: tensor innermost, then data, then pipe
        expected = dualpipev_messages(stage, p, m)
        for kind in ("send", "recv"):
            entry = comm.get(f"{kind}/world", {"calls": 0, "bytes": 0})
            assert entry["calls"] == expected, (what, rank, kind, comm)
            assert entry["bytes"] == expected * micro * S * H * 4, (what, rank, kind, comm)


def consumed_samples(path):
    return [r["consumed_samples"] for r in map(json.loads, open(path)) if r.get("kind") == "train"]


@functools.lru_cache(maxsize=1)
def two_rank_runs():
    out = tempfile.mkdtemp(prefix="mtds-matrix2-")
    ck = {name: os.path.join(out, name) for name in ("dualpipev", "1f1b", "zb-h1", "v2")}
    step = os.path.join("{}", f"global_step{CKPT_AT}")
    configs = [
        # parity cells (zb-h1 ZeRO-1 is the checkpoint run below)
        run("zb-h1", 1, 2, zero=0), run("interleaved", 1, 2, zero=1, virtual_stages=3, model=TINY6),
        # fp16: mtds's engine with DeepSpeed's loss scaler vs DeepSpeed's 1F1B
        run("interleaved", 1, 2, precision="fp16", virtual_stages=2, steps=FP16_STEPS),
        run("1f1b", 1, 2, precision="fp16", steps=FP16_STEPS),
        # checkpoints (ZeRO-1): each saving run is also the uninterrupted run of its schedule
        run("dualpipev", 1, 2, save=ck["dualpipev"], save_interval=CKPT_AT, log_jsonl=os.path.join(out, "dpv.jsonl")),
        run("1f1b", 1, 2, save=ck["1f1b"], save_interval=CKPT_AT),
        run("zb-h1", 1, 2, save=ck["zb-h1"], save_interval=CKPT_AT),
        run("1f1b", 1, 2, load=step.format(ck["dualpipev"])),
        run("dualpipev", 1, 2, load=step.format(ck["1f1b"])),
        run("dualpipev", 1, 2, load=step.format(ck["dualpipev"]), log_jsonl=os.path.join(out, "dpv-resumed.jsonl")),
        run("1f1b", 1, 2, load=step.format(ck["zb-h1"])),
        # another v: interleaved v=2 -> v=3 (six blocks); the v=3 parity run above is the uninterrupted one
        run("interleaved", 1, 2, virtual_stages=2, model=TINY6, save=ck["v2"], save_interval=CKPT_AT),
        run("interleaved", 1, 2, virtual_stages=3, model=TINY6, load=step.format(ck["v2"])),
    ]
    # zb-h1 16-bit checkpoints (ZeRO-1, 5 steps, saved at step 3): bf16 through the shipped path
    # (BF16_Optimizer, fp32 accumulation) resumed under 1f1b bf16; fp16 (ZeRO-1's loss scaler, its scale
    # doubling every 2 steps) resumed under zb-h1 fp16.
    for precision, extra in (("bf16", {"data_types": {"grad_accum_dtype": "fp32"}}),
                             ("fp16", {"fp16": {**ds_config(precision="fp16")["fp16"], "loss_scale_window": 2}})):
        ds = ds_config(zero=1, precision=precision, **extra)
        ck[precision] = os.path.join(out, f"zb-{precision}")
        sixteen = dict(deepspeed_config=ds, steps=ZB16_STEPS)
        configs += [train_config(tp=1, pp=2, pipeline_schedule="zb-h1", save=ck[precision], save_interval=ZB16_AT,
                                 log_jsonl=os.path.join(out, f"zb-{precision}.jsonl"), **sixteen),
                    train_config(tp=1, pp=2, pipeline_schedule="1f1b" if precision == "bf16" else "zb-h1",
                                 load=os.path.join(ck[precision], f"global_step{ZB16_AT}"),
                                 log_jsonl=os.path.join(out, f"zb-{precision}-resumed.jsonl"), **sixteen)]
    return run_layouts(2, configs, force_fp16=True), out


def loss_scales(path):
    return [r["loss_scale"] for r in map(json.loads, open(path)) if r.get("kind") == "train"]


def test_two_ranks_parity():
    results = two_rank_runs()[0][-1]
    assert_hf_parity(results[0], "zb-h1 (1,2,1) ZeRO-0")
    assert_hf_parity(results[6], "zb-h1 (1,2,1) ZeRO-1")
    assert_hf_parity(results[1], "interleaved v=3 (1,2,1) 6 blocks ZeRO-1", TINY6)


def test_interleaved_fp16_against_1f1b_fp16():
    """fp16 on mtds's engine: DeepSpeed's loss scaler (2^8, no overflow here) around the interleaved
    order, against DeepSpeed's 1F1B fp16 at the same layout. Both run the same fp16 operations; they
    differ in where partial sums meet (the tied embedding's two gradient halves, the chunked stage
    boundaries), so they are not bit-equal: measured max rel diff over 5 steps 6.6e-7 in the losses and
    5.4e-5 in the pre-clip grad norms under avx2 kernels (native 3.3e-7 / 1.7e-5, default 0 / 0; fp16's unit
    roundoff is 4.9e-4); held to 2e-5 / 5e-4 (30x / 9x). A loss scale
    left in the gradients (or applied twice) moves the norms by 2^8."""
    results = two_rank_runs()[0][-1]
    ilv, base = results[2], results[3]
    assert not any(ilv.skipped) and not any(base.skipped), (ilv.skipped, base.skipped)
    diff = max_rel_diff(ilv.losses, base.losses)
    assert within("pipe_matrix.fp16_interleaved_vs_1f1b.loss", diff, FP16_TOL), \
        f"fp16 interleaved vs 1f1b: losses {diff:.2e}\n{ilv.losses}\n{base.losses}"
    diff = max_rel_diff(ilv.grad_norms, base.grad_norms)
    assert within("pipe_matrix.fp16_interleaved_vs_1f1b.norm", diff, 5e-4), \
        f"fp16 interleaved vs 1f1b: grad norms {diff:.2e}\n{ilv.grad_norms}\n{base.grad_norms}"


def test_checkpoints_across_schedules_two_ranks():
    per_rank, out = two_rank_runs()
    dpv, f1b, zb, dpv_to_1f1b, f1b_to_dpv, dpv_to_dpv, zb_to_1f1b, v2, v2_to_v3 = per_rank[-1][4:13]
    v3 = per_rank[-1][1]
    k = CKPT_AT
    for what, saved, resumed, straight in (("dualpipev -> 1f1b", dpv, dpv_to_1f1b, f1b),
                                           ("1f1b -> dualpipev", f1b, f1b_to_dpv, dpv),
                                           ("dualpipev -> dualpipev", dpv, dpv_to_dpv, dpv),
                                           ("zb-h1 -> 1f1b", zb, zb_to_1f1b, f1b),
                                           ("interleaved v=2 -> v=3", v2, v2_to_v3, v3)):
        # The resumed steps equal the uninterrupted run of the loading schedule. Where the saving and
        # loading schedules place layers differently their global norms sum in another order (an ulp,
        # and after a clipped step the weights too), and the universal load's norm is not bit-stable
        # (1f1b -> dualpipev: first resumed norm 1 ulp off, 9.1e-8); losses stay bit-equal until the
        # norms differ, everything within 1e-6.
        history_equal = (saved.losses[:k], saved.grad_norms[:k]) == (straight.losses[:k], straight.grad_norms[:k])
        assert_same_up_to_norm_order(resumed, replace(straight, losses=straight.losses[k:],
                                                                 grad_norms=straight.grad_norms[k:]),
                                     what, history_equal=history_equal)
    assert (dpv_to_dpv.losses, dpv_to_dpv.grad_norms) == (dpv.losses[k:], dpv.grad_norms[k:])  # DeepSpeed's own load
    # DualPipeV's last rank (the reporting one) reads no data; its stream position still moves with the
    # step, so what it logs and saves is where the data is.
    assert consumed_samples(os.path.join(out, "dpv.jsonl")) == [8 * s for s in range(1, STEPS + 1)]
    assert consumed_samples(os.path.join(out, "dpv-resumed.jsonl")) == [8 * s for s in range(k + 1, STEPS + 1)]
    # p2p of the DualPipeV run's last step, on both ranks
    assert_dualpipev_p2p(per_rank, 4, p=2, m=4, micro=2, what="(1,2,1)")


def test_four_ranks_parity_and_checkpoints_at_other_layouts():
    out = tempfile.mkdtemp(prefix="mtds-matrix4-")
    ck = os.path.join(out, "ilv")
    ilv = dict(pipeline_schedule="interleaved", virtual_stages=2)
    load = os.path.join(ck, f"global_step{LAYOUT_CKPT_AT}")
    configs = [
        run("interleaved", 1, 4, zero=0, virtual_stages=2, model=TINY8),
        run("dualpipev", 1, 4, zero=0, micro=1, model=TINY8), run("dualpipev", 1, 4, zero=1, micro=1, model=TINY8),
        run("dualpipev", 2, 2, zero=0),
        run("zb-h1", 1, 4, zero=0), run("zb-h1", 1, 4, zero=1), run("zb-h1", 2, 2, zero=0),
        # interleaved v=2 at (2,2,1) resumed at another t and d (1,2,2), and at another p and schedule:
        # (1,4,1) 1f1b (ZeRO-1: Adam state resharded through DeepSpeed's universal checkpoint)
        train_config(tp=2, pp=2, save=ck, save_interval=LAYOUT_CKPT_AT, **ilv),
        train_config(tp=1, pp=2, load=load, **ilv), train_config(tp=1, pp=4, load=load),
    ]
    per_rank = run_layouts(4, configs)
    last = per_rank[-1]
    assert_hf_parity(last[0], "interleaved v=2 (1,4,1) 8 blocks ZeRO-0", TINY8)
    assert_hf_parity(last[1], "dualpipev (1,4,1) 8 blocks ZeRO-0", TINY8)
    assert_hf_parity(last[2], "dualpipev (1,4,1) 8 blocks ZeRO-1", TINY8)
    assert_hf_parity(last[3], "dualpipev (2,2,1) ZeRO-0", TINY)
    assert_hf_parity(last[4], "zb-h1 (1,4,1) ZeRO-0")
    assert_hf_parity(last[5], "zb-h1 (1,4,1) ZeRO-1")
    assert_hf_parity(last[6], "zb-h1 (2,2,1) ZeRO-0")
    assert_dualpipev_p2p(per_rank, 1, p=4, m=8, micro=1, what="(1,4,1)")
    assert_dualpipev_p2p(per_rank, 3, p=2, m=4, micro=2, tp=2, what="(2,2,1)")
    # Another t or p changes the summation order, not the state: the resumed steps 6-10 match HF.
    ref = reference()
    assert_hf_parity(last[7], "interleaved v=2 (2,2,1) ZeRO-1, saving")
    for what, resumed in (("(2,2,1) v=2 -> (1,2,2) v=2", last[8]), ("(2,2,1) v=2 -> (1,4,1) 1f1b", last[9])):
        assert len(resumed.losses) == STEPS - LAYOUT_CKPT_AT, (what, resumed.losses)
        k = LAYOUT_CKPT_AT
        assert_hf_parity(resumed, what, ref=replace(ref, losses=ref.losses[k:], grad_norms=ref.grad_norms[k:]))



def test_zb_h1_16_bit_checkpoints():
    """zb-h1 bf16 (BF16_Optimizer: fp32 master weights, Adam moments and gradient accumulation) saved at
    step 3 and resumed under 1f1b bf16, and fp16 ZeRO-1 saved and resumed under zb-h1: the resumed steps
    4-5 equal the uninterrupted zb-h1 run bit for bit (zb-h1 and 1f1b are bit-identical in bf16), and the
    fp16 loss scaler (scale and growth counter) carries over: the same scales step for step."""
    per_rank, out = two_rank_runs()
    bf16, bf16_resumed, fp16, fp16_resumed = per_rank[-1][13:17]
    for what, straight, resumed in (("zb-h1 bf16 -> 1f1b bf16", bf16, bf16_resumed),
                                    ("zb-h1 fp16 -> zb-h1 fp16", fp16, fp16_resumed)):
        assert len(resumed.losses) == ZB16_STEPS - ZB16_AT, (what, resumed.losses)
        diffs = (max_rel_diff(resumed.losses, straight.losses[ZB16_AT:]),
                 max_rel_diff(resumed.grad_norms, straight.grad_norms[ZB16_AT:]))
        assert same(f"pipe_matrix.zb_h1_16_bit_resume.{what.split()[1]}", (resumed.losses, resumed.grad_norms),
                    (straight.losses[ZB16_AT:], straight.grad_norms[ZB16_AT:])), \
            f"{what}: losses / grad norms max rel diff {diffs[0]:.2e} / {diffs[1]:.2e}"
    scales = loss_scales(os.path.join(out, "zb-fp16.jsonl"))
    assert scales[ZB16_AT - 1] > scales[0], scales       # the scale moved before the save
    assert loss_scales(os.path.join(out, "zb-fp16-resumed.jsonl")) == scales[ZB16_AT:], scales
