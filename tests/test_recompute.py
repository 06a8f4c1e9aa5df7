"""Selective activation recomputation (Korthikanti et al. 2022): the bytes a transformer layer keeps
for backward against the paper's formulas, exactness with dropout on, HF parity, and the flags."""
import pytest
import torch

from lab.testing import spawn
from tests.training_helpers import TINY, hf_reference, max_rel_diff, run_layouts, train_config

S, B, H, A, T = 32, 2, 64, 4, 2      # sequence, micro-batch, hidden, heads, tensor-parallel size


MODES = [("none", True), ("selective", True), ("none", False), ("selective", False), ("full", True)]


def _layer_bytes_worker():
    from lab.activation_memory import saved_bytes
    from mtds.model.config import ModelConfig
    from mtds.parallel.layout import ParallelLayout
    from mtds.model import TransformerLayer
    from mtds.tp import checkpoint, model_parallel_seed

    groups = ParallelLayout.for_world(T, tp=T).build_groups()
    cfg = ModelConfig(vocab_size=256, hidden_size=H, num_layers=1, num_heads=A, max_position_embeddings=S,
                      hidden_dropout=0.1, attention_dropout=0.1)
    out = {}
    for mode, sp in MODES:
        tracker = model_parallel_seed(7, groups.tp_rank)
        layer = TransformerLayer(cfg, 1, tp_group=groups.tp_group, rng_tracker=tracker, sequence_parallel=sp,
                                 recompute_attention=mode == "selective").train()
        # the layer input: this rank's sequence slice with SP, the whole (replicated) sequence without
        seed = groups.tp_rank if sp else 0
        x = torch.randn(B, S // T if sp else S, H, generator=torch.Generator().manual_seed(seed), requires_grad=True)
        run = (lambda inp: checkpoint(layer, tracker, inp)) if mode == "full" else layer
        # fp32 on the CPU; every floating element counted at 2 bytes, as in the paper's 16-bit accounting
        y, nbytes = saved_bytes(run, x, exclude=list(layer.parameters()), float_bytes=2)
        (y * torch.arange(y.numel(), dtype=y.dtype).reshape(y.shape).sin()).sum().backward()
        out[mode, sp] = dict(bytes=nbytes, y=y.detach(), dx=x.grad, grads=[p.grad for p in layer.parameters()])
    return out


def test_saved_activation_bytes_per_layer_match_korthikanti():
    sbh, as2b = S * B * H, A * S * S * B
    # Korthikanti et al. 2022, Table 2 (16-bit activations, 1-byte dropout masks), per layer per rank
    paper = {("none", True): sbh * (34 / T + 5 * A * S / (H * T)),          # TP + sequence parallel
             ("selective", True): 34 * sbh / T,                            # + selective recomputation
             ("none", False): sbh * (10 + 24 / T + 5 * A * S / (H * T)),   # TP only
             ("selective", False): sbh * (10 + 24 / T),
             ("full", True): 2 * sbh / T}                                  # the block input only
    # What the paper leaves out, on this CPU: torch's CPU dropout keeps its mask in the activation dtype
    # (2 bytes; the paper counts 1 byte, CUDA's bool mask) for the two residual dropouts (s b h / t each
    # with SP, s b h without) and, without recomputation, the attention-probability dropout (a s^2 b / t);
    # and the layer norms' mean and 1/std (2 norms x 2 values per token of the local sequence).
    residual_masks = {True: 2 * sbh / T, False: 2 * sbh}
    norm_stats = {True: 2 * 2 * B * S / T * 2, False: 2 * 2 * B * S * 2}
    for rank, r in enumerate(spawn(_layer_bytes_worker, T, timeout=120)):
        for mode, sp in MODES:
            measured, formula = r[mode, sp]["bytes"], paper[mode, sp]
            if sp:   # (without SP the CPU's 2-byte residual masks alone put "none" 11.6% above the paper)
                assert abs(measured / formula - 1) < 0.10, (rank, mode, sp, measured, formula)
            extra = 0 if mode == "full" else residual_masks[sp] + norm_stats[sp] + (as2b / T if mode == "none" else 0)
            assert measured == formula + extra, (rank, mode, sp, measured, formula, extra)
        # recomputation replays the same dropout masks: identical outputs and gradients
        for sp in (True, False):
            none, selective = r["none", sp], r["selective", sp]
            assert torch.equal(none["y"], selective["y"]) and torch.equal(none["dx"], selective["dx"])
            assert all(torch.equal(a, b) for a, b in zip(none["grads"], selective["grads"]))


DROPOUT = dict(model=TINY.__class__(**{**TINY.__dict__, "hidden_dropout": 0.1, "attention_dropout": 0.1}))
STEPS = 5


def test_selective_recompute_is_exact_with_dropout_and_matches_hf_without():
    common = dict(tp=2, sequence_parallel=True, steps=STEPS, check_replicas_interval=STEPS)
    configs = [train_config(pp=p, recompute=mode, **common, **DROPOUT)
               for p in (2, 1) for mode in ("none", "selective")]
    configs.append(train_config(pp=2, recompute="selective", **common))      # dropout off: HF parity
    pipe_none, pipe_selective, plain_none, plain_selective, no_dropout = run_layouts(4, configs)[0]
    assert pipe_selective.losses == pipe_none.losses, "(2,2,1) sp: selective recompute changed the losses"
    assert plain_selective.losses == plain_none.losses, "(2,1,2) sp: selective recompute changed the losses"
    ref = hf_reference(steps=STEPS)
    reference = ref.losses
    assert max_rel_diff(no_dropout.losses, reference) < 1e-5, (no_dropout.losses, reference)
    assert max_rel_diff(no_dropout.grad_norms, ref.grad_norms) < 1e-5, (no_dropout.grad_norms, ref.grad_norms)
    # dropout was really on
    assert max_rel_diff(pipe_none.losses, reference) > 1e-4


def _parse(*flags):
    from mtds.training.cli import build_parser, config_from_args
    return config_from_args(build_parser().parse_args(["--deepspeed_config", "c.json", *flags]))


def test_one_recompute_knob_megatron_aliases_and_the_deprecated_flag(capsys):
    for flags, want in (([], ("none", 1)), (["--recompute", "full"], ("full", 1)),
                        (["--recompute", "full", "--recompute-interval", "2"], ("full", 2)),
                        (["--recompute", "selective"], ("selective", 1)),
                        # Megatron-LM's names for the same settings
                        (["--recompute-granularity", "full", "--recompute-method", "uniform",
                          "--recompute-num-layers", "2"], ("full", 2)),
                        (["--recompute-granularity", "selective"], ("selective", 1))):
        cfg = _parse(*flags)
        assert (cfg.recompute, cfg.recompute_interval) == want, flags
        assert capsys.readouterr().err == "", flags
    # --activation-checkpointing [K]: still works, with one deprecation line
    for flags, want in ((["--activation-checkpointing"], ("full", 1)), (["--activation-checkpointing", "3"], ("full", 3)),
                        (["--activation-checkpointing", "0"], ("none", 1)),
                        (["--recompute", "full", "--activation-checkpointing", "2"], ("full", 2))):
        cfg = _parse(*flags)
        assert (cfg.recompute, cfg.recompute_interval) == want, flags
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("warning: --activation-checkpointing is deprecated: use "
                                                       "--recompute full --recompute-interval"), lines
    for flags, message in ((["--recompute", "selective", "--activation-checkpointing", "2"], "conflicts with --recompute"),
                           (["--recompute", "none", "--activation-checkpointing", "1"], "conflicts with --recompute"),
                           (["--recompute-interval", "3", "--activation-checkpointing", "2"],
                            "conflicts with --recompute-interval 3"),
                           (["--recompute-interval", "2"], "applies to --recompute full only"),
                           (["--recompute", "full", "--recompute-interval", "0"], "--recompute-interval must be >= 1")):
        with pytest.raises(ValueError, match=message):
            _parse(*flags)
    from mtds.training import TrainConfig
    with pytest.raises(ValueError, match="none, selective or full"):
        TrainConfig("c.json", recompute="attention")
