"""A ZeRO-1 checkpoint saved at (t,p,d) = (2,2,2) after 5 steps resumes at (4,1,1) and (1,1,1) (through
DeepSpeed universal checkpointing, converted automatically by train --load): the next 5 losses equal the
uninterrupted run within 1e-5 -- weights, Adam moments, step, LR schedule and data position all carried
over. t changes 2 -> 4 and 2 -> 1, so a wrongly merged or sliced row-parallel or fused q|k|v weight would
show; p 2 -> 1, d 2 -> 1 (the ZeRO-1 partitions of both d ranks merged), and ZeRO-1 -> ZeRO-0 (our loader).
(A resume at another d upward, 1 -> 2, and at p 2 -> 4 is in tests/test_pipe_matrix.py's 4-rank launch.)
"""
import dataclasses
import json
import os

from mtds.model.config import ModelConfig
from lab.testing import spawn
from tests.bounds import within
from tests.training_helpers import ds_config, run_layouts, train_config

TOL = 1e-5
# 3 blocks: at p = 2 the stages hold 2 and 1 (odd) blocks; 4 heads allow t = 4.
MODEL = ModelConfig(vocab_size=8192, hidden_size=32, num_layers=3, num_heads=4, max_position_embeddings=64)


def _runs_and_refusals(configs, refused):
    """Losses of each config, then the one-line error of each config that must be refused."""
    from mtds.training import run
    from mtds.checkpoint.lifecycle import CheckpointError
    losses = [run(cfg).losses for cfg in configs]
    messages = []
    for cfg in refused:
        try:
            run(cfg)
            messages.append(None)
        except CheckpointError as err:
            messages.append(str(err))
    return losses, messages


def _assert_continues(runs, expected):
    for name, losses in runs:
        assert len(losses) == 5, (name, losses)
        diff = max(abs(a - b) / abs(b) for a, b in zip(losses, expected))
        assert diff < TOL, f"{name}: {diff:.2e}\n{losses}\n{expected}"


def test_resume_at_other_layouts_continues_the_run(tmp_path):
    ck = str(tmp_path / "ck")
    full = run_layouts(8, [train_config(tp=2, pp=2, model=MODEL, steps=10, save=ck, save_interval=5)])[0][0]
    expected = full.losses[5:]

    resume = dict(model=MODEL, steps=10, load=os.path.join(ck, "global_step5"))   # not the newest: step 10
    # (1,2,2) (t 2 -> 1 at the same p and d) is left out: (1,1,1) below changes t the same way, and
    # tests/test_pipe_matrix.py resumes a (2,2,1) checkpoint at (1,2,2) against HF.
    r411 = run_layouts(4, [train_config(tp=4, pp=1, **resume)])[0][0]
    # (1,1,1) twice: with ZeRO-1 (DeepSpeed's loader) and without ZeRO (ours); a different model is refused.
    zero0 = train_config(**resume, deepspeed_config=ds_config(zero=0))
    [((r111, r111_zero0), [refused])] = spawn(
        _runs_and_refusals, 1, [train_config(**resume), zero0],
        [train_config(**{**resume, "model": dataclasses.replace(MODEL, hidden_size=64)})], timeout=300)
    _assert_continues([("(4,1,1)", r411.losses), ("(1,1,1)", r111),
                       ("(1,1,1) ZeRO-0", r111_zero0)], expected)
    assert os.path.isdir(os.path.join(ck, "global_step5_universal"))     # converted once, reused
    assert refused is not None and "different model" in refused and "hidden_size" in refused, refused
    assert "\n" not in refused


def test_checkpoint_without_zero_reshards_too(tmp_path):
    """DeepSpeed cannot convert ZeRO-0 checkpoints: mtds.checkpoint.reshard_zero0 does (t 2 -> 1, p 2 -> 1, d 1 -> 2), into
    ZeRO-0 engines (our loader) and, written in DeepSpeed's universal format, into ZeRO-1/2 engines (its loader;
    the Adam state is matched to parameters by name)."""
    ck = str(tmp_path / "ck")
    zero0 = dict(model=MODEL, steps=10, deepspeed_config=ds_config(zero=0))
    full = run_layouts(4, [train_config(tp=2, pp=2, save=ck, save_interval=5, **zero0)])[0][0]
    ck = os.path.join(ck, "global_step5")
    into = {z: dict(zero0, deepspeed_config=ds_config(zero=z)) for z in (1, 2)}
    [(losses, _)] = spawn(_runs_and_refusals, 2, [train_config(tp=1, pp=1, load=ck, **zero0),
                                                  train_config(tp=2, pp=1, load=ck, **zero0),
                                                  train_config(tp=1, pp=1, load=ck, **into[1]),
                                                  train_config(tp=1, pp=2, load=ck, **into[1]),
                                                  train_config(tp=2, pp=1, load=ck, **into[2])],
                          [], timeout=400)[:1]
    _assert_continues([("(1,1,2) ZeRO-0", losses[0]), ("(2,1,1) ZeRO-0", losses[1]), ("(1,1,2) ZeRO-1", losses[2]),
                       ("(1,2,1) ZeRO-1", losses[3]), ("(2,1,1) ZeRO-2", losses[4])], full.losses[5:])


def _scales(path):
    with open(path) as f:
        return [r["loss_scale"] for r in map(json.loads, f) if r["kind"] == "train"]


def test_bf16_and_fp16_checkpoints_reshard_into_zero1_and_zero2(tmp_path):
    """bf16 and fp16 ZeRO-1 checkpoints of (2,2,1) resume at (1,2,1) ZeRO-1 and (2,1,1) ZeRO-2 through DeepSpeed's
    universal checkpoint (fp32 master weights and Adam moments; fp16 also the dynamic loss scaler): measured
    from the uninterrupted run bf16 1.1e-5 (default kernels; native 6.9e-6), fp16 1.3e-6 (docs/testing.md, "16-bit
    bounds"); 1e-4 leaves room for 16-bit rounding at another layout, while
    a restart from scratch (9.01 vs 8.68 here) or a wrongly merged shard is off by percents. The fp16 scale
    doubles every 2 steps (256 -> 1024 by step 5), so a scaler that restarted would log other scales."""
    runs = {}
    for precision in ("bf16", "fp16"):
        config = ds_config(zero=1, precision=precision)
        if precision == "fp16":
            config["fp16"]["loss_scale_window"] = 2
        runs[precision] = dict(model=MODEL, steps=10, deepspeed_config=config)
    full = run_layouts(4, [train_config(tp=2, pp=2, save=str(tmp_path / p), save_interval=5,
                                        log_jsonl=str(tmp_path / f"{p}.jsonl"), **runs[p]) for p in runs],
                       force_fp16=True)[0]
    resumed = []
    for p, kw in runs.items():
        zero2 = dict(kw, deepspeed_config={**kw["deepspeed_config"], "zero_optimization": {"stage": 2}})
        ck = str(tmp_path / p / "global_step5")
        resumed += [(f"{p} (1,2,1) ZeRO-1", train_config(tp=1, pp=2, load=ck, **kw)),
                    (f"{p} (2,1,1) ZeRO-2", train_config(tp=2, pp=1, load=ck, **zero2))]
    resumed = [(name, dataclasses.replace(cfg, log_jsonl=str(tmp_path / f"{name}.jsonl"))) for name, cfg in resumed]
    results = run_layouts(2, [cfg for _, cfg in resumed], force_fp16=True)[0]
    for (name, cfg), got in zip(resumed, results):
        expected = full[0 if name.startswith("bf16") else 1].losses[5:]
        assert len(got.losses) == 5, (name, got.losses)
        diff = max(abs(a - b) / b for a, b in zip(got.losses, expected))
        assert within(f"reshard.{name.split()[0]}.loss", diff, 1e-4), f"{name}: {diff:.2e}\n{got.losses}\n{expected}"
    fp16_scales = _scales(tmp_path / "fp16.jsonl")
    assert fp16_scales[4] > fp16_scales[0], fp16_scales     # the scale moved before the save
    for name, cfg in resumed[2:]:
        assert _scales(cfg.log_jsonl) == fp16_scales[5:], (name, _scales(cfg.log_jsonl), fp16_scales)
    assert abs(full[0].losses[0] - full[0].losses[5]) / full[0].losses[5] > 1e-2    # the check above can tell
