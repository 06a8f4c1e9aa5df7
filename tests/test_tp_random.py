"""RNG streams on real ranks at (t, p) = (2, 2): replicated-region dropout identical across the TP ranks
of a stage and different between stages, sharded-region dropout distinct on every rank, state
save/restore reproduces masks, and recomputation replays them. Keyed per layer (what training uses):
a layer's masks are the same on whichever stage it runs, differ per layer, micro-batch, step and TP
rank (sharded), and a recomputed block of layers replays its own micro-batch's masks."""
import torch
import torch.distributed as dist
import torch.nn.functional as F

from mtds.parallel.layout import ParallelLayout
from mtds.tp import MODEL_PARALLEL_RNG, checkpoint, seed_parallel_streams
from tests.dist import spawn


def _gather(x, group):
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return parts


def _rng_worker():
    groups = ParallelLayout.for_world(dist.get_world_size(), tp=2, pp=2).build_groups()
    tracker = seed_parallel_streams(1234, groups)
    ones = torch.ones(64, 64)
    replicated = F.dropout(ones, 0.5)
    with tracker.fork():
        sharded = F.dropout(ones, 0.5)
    after = F.dropout(ones, 0.5)  # fork must not disturb the default stream
    rep, sh, aft = (_gather(m, groups.tp_group) for m in (replicated, sharded, after))
    # across stages (same TP rank, other pipeline stage): both streams differ
    rep_pp, sh_pp = (_gather(m, groups.pp_group) for m in (replicated, sharded))
    every_sharded = _gather(sharded, None)

    # Save, draw, restore, draw again: same masks.
    saved_default, saved_tracker = torch.get_rng_state(), tracker.get_states()
    with tracker.fork():
        first = F.dropout(ones, 0.3)
    torch.set_rng_state(saved_default)
    tracker.set_states(saved_tracker)
    with tracker.fork():
        second = F.dropout(ones, 0.3)

    # Recomputation: a function that drops out in both regions gives the same gradients whether its
    # activations are stored or recomputed in backward.
    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))

    def fn(x):
        with tracker.fork(MODEL_PARALLEL_RNG):
            x = F.dropout(x @ w, 0.4)
        return F.dropout(torch.tanh(x), 0.4)

    grads = []
    for use_checkpoint in (False, True):
        torch.manual_seed(7)
        tracker.set_states(saved_tracker)
        x = torch.randn(8, 64).requires_grad_()
        y = checkpoint(fn, tracker, x) if use_checkpoint else fn(x)
        y.sum().backward()
        grads.append((y.detach(), x.grad))
    return dict(
        replicated_same=torch.equal(rep[0], rep[1]),
        sharded_differ=not torch.equal(sh[0], sh[1]),
        replicated_differ_across_stages=not torch.equal(rep_pp[0], rep_pp[1]),
        sharded_differ_across_stages=not torch.equal(sh_pp[0], sh_pp[1]),
        sharded_all_distinct=all(not torch.equal(every_sharded[i], every_sharded[j])
                                 for i in range(4) for j in range(i)),
        not_the_replicated_stream=not any(torch.equal(m, replicated) for m in every_sharded),
        default_stream_same_after_fork=torch.equal(aft[0], aft[1]),
        restore_reproduces=torch.equal(first, second),
        recompute_same_output=torch.equal(grads[0][0], grads[1][0]),
        recompute_same_grad=torch.equal(grads[0][1], grads[1][1]),
        **_keyed_checks(groups, tracker, ones, w),
    )


def _keyed_checks(groups, tracker, ones, w):
    """Layer-keyed streams: every rank draws "layer 5" itself, as if the layer lived on its stage."""
    def draw(layer):
        with tracker.layer(layer):
            replicated = F.dropout(ones, 0.5)
            with tracker.fork():
                sharded = F.dropout(ones, 0.5)
        return replicated, sharded

    tracker.begin_step(3)
    outside_before = torch.get_rng_state()
    rep, sh = draw(5)
    outside_untouched = torch.equal(torch.get_rng_state(), outside_before)
    rep_mb1, sh_mb1 = draw(5)                    # the layer's second forward this step: micro-batch 1
    rep_other, _ = draw(6)
    tracker.begin_step(3)
    rep_again, sh_again = draw(5)                # the same step again (a resumed run) replays
    tracker.begin_step(4)
    rep_next, _ = draw(5)
    rep_tp, sh_tp = (_gather(m, groups.tp_group) for m in (rep, sh))
    rep_pp, sh_pp = (_gather(m, groups.pp_group) for m in (rep, sh))

    # Two micro-batches through a checkpointed block of two keyed layers, backward in reverse order
    # (as a pipeline does): recomputation must redraw each micro-batch's masks, not the current count's.
    def block(x):
        for layer in (7, 8):
            with tracker.layer(layer):
                with tracker.fork():
                    x = F.dropout(x @ w, 0.4)
                x = F.dropout(torch.tanh(x), 0.4)
        return x

    runs = []
    for use_checkpoint in (False, True):
        tracker.begin_step(9)
        xs = [torch.randn(8, 64, generator=torch.Generator().manual_seed(mb)).requires_grad_() for mb in (0, 1)]
        ys = [checkpoint(block, tracker, x) if use_checkpoint else block(x) for x in xs]
        for y in reversed(ys):
            y.sum().backward()
        runs.append([(y.detach(), x.grad) for x, y in zip(xs, ys)])
    same = all(torch.equal(a, b) for (ya, ga), (yb, gb) in zip(*runs) for a, b in ((ya, yb), (ga, gb)))
    return dict(
        keyed_replicated_same_across_tp=torch.equal(rep_tp[0], rep_tp[1]),
        keyed_sharded_differ_across_tp=not torch.equal(sh_tp[0], sh_tp[1]),
        keyed_same_on_every_stage=torch.equal(rep_pp[0], rep_pp[1]) and torch.equal(sh_pp[0], sh_pp[1]),
        keyed_micro_batches_differ=not torch.equal(rep, rep_mb1) and not torch.equal(sh, sh_mb1),
        keyed_layers_differ=not torch.equal(rep, rep_other),
        keyed_steps_differ=not torch.equal(rep, rep_next),
        keyed_step_replays=torch.equal(rep, rep_again) and torch.equal(sh, sh_again),
        keyed_default_generator_put_back=outside_untouched,
        keyed_recompute_replays_each_micro_batch=same,
    )


def test_dropout_streams_and_recomputation_replay():
    for rank, result in enumerate(spawn(_rng_worker, 4, timeout=120)):
        assert all(result.values()), (rank, [name for name, ok in result.items() if not ok])


def test_fork_requires_added_state():
    from mtds.tp import RNGTracker
    import pytest
    tracker = RNGTracker()
    with pytest.raises(KeyError, match="never added"):
        with tracker.fork():
            pass
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="already exists"):
        tracker.add("a", 2)


def test_streams_saved_on_another_device_type_restart_from_a_seed():
    # A rank manifest written on a GPU holds CUDA generator states (16 bytes); set as they are on a CPU
    # tracker (or a CPU checkpoint's 5,056 bytes on a GPU) the first fork fails. They are recognised and
    # the streams restart from a seed instead, the same on every resume.
    from mtds.checkpoint.lifecycle import restart_foreign_streams, set_rng_state, tracker_fits
    from mtds.tp.random import RNGTracker
    lines, masks = [], []
    gpu_saved = {"cpu": torch.get_rng_state(), "cuda": torch.zeros(16, dtype=torch.uint8),
                 "tracker": {MODEL_PARALLEL_RNG: torch.zeros(16, dtype=torch.uint8)}}
    for _ in range(2):
        tracker = RNGTracker("cpu")
        tracker.add(MODEL_PARALLEL_RNG, 7)
        assert not tracker_fits(gpu_saved, tracker) and tracker_fits({"tracker": tracker.get_states()}, tracker)
        restart_foreign_streams(gpu_saved, tracker, step=5, tp_rank=1, log=lines.append)
        with tracker.fork():
            masks.append(F.dropout(torch.ones(32), 0.5))
    assert torch.equal(masks[0], masks[1]) and "another device type" in lines[0], lines
    tracker = RNGTracker("cpu")
    tracker.add(MODEL_PARALLEL_RNG, 7)
    set_rng_state(gpu_saved, tracker)    # what load did before: the fork below fails
    try:
        with tracker.fork():
            pass
    except RuntimeError:
        pass
    else:
        raise AssertionError("a CUDA generator state was accepted by a CPU tracker")


def test_replicated_masks_are_the_masks_dropout_draws():
    # A keyed layer draws its two residual-dropout masks before its (compiled) forward: they must be the
    # ones nn.Dropout would have drawn there, in turn, so masks did not change with the move.
    from mtds.tp.random import RNGTracker
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 5, 8).to(dtype)
        torch.manual_seed(7)
        want = [F.dropout(x, 0.1, training=True) for _ in range(2)]
        torch.manual_seed(7)
        masks = RNGTracker.replicated_masks(x, 0.1, 2)
        assert all(torch.equal(x * m, w) for m, w in zip(masks, want)), dtype
