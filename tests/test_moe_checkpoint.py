"""Checkpoints of expert-parallel runs (docs/moe.md, "Checkpoints at E > 1"): Mixtral (1,1,2) at E = 2, fp32,
saved mid-run and resumed at the same layout equal the uninterrupted run bit for bit (losses and grad norms of
the three steps after loading, so the Adam moments of every expert came back), at ZeRO-0 (optimizer state in
DeepSpeed's per-EP-shard files) and ZeRO-1 (each data rank's partitions); which rank wrote which expert's
file; a missing expert file makes it incomplete; a weights-only checkpoint (full tensors) loads at E = 2.
Resharded (docs/moe.md, "Resharding at E > 1"; fp32 ZeRO-1): the E = 2 checkpoint resumed at E = 1 on the two
ranks and on one, and at (2,1,1), those runs' checkpoints at E = 2 again, continue the run within 1e-5; the
universal folder holds the live experts in global order; a bf16 ZeRO-1 checkpoint (DeepSpeed's BF16 optimizer) at
E = 1 within bf16's layout noise; fp32 ZeRO-0 (p = 1): the E = 2 checkpoint at E = 1, that one's into ZeRO-1 at E = 2
and the ZeRO-1 one into ZeRO-0 at E = 2 continue the run bit for bit; a ZeRO-0 pipeline or an fp32 one into bf16
refused in one line
(pipelines: tests/test_moe.py's four-rank test). Read back as a whole model: `mtds-convert mtds-to-hf` of the E = 2 checkpoint
equals the export of the live weights bit for bit, transformers loads it, and `mtds-eval --ckpt` (run in the body
at E = 1) gives transformers' loss; TP-sharded expert files merge. One spawned 2-rank body (and a 1-rank one);
the file checks run in the test process on what it saved."""
import json
import os
import shutil

import pytest

from tests.test_moe import TRAIN_LR, _training_model
from tests.training_helpers import ds_config, max_rel_diff, train_config

STEPS, SAVED_AT = 5, 2
EVAL_ROWS = [[3, 17, 5, 9, 60, 2, 41], [7, 7, 1, 30, 12], list(range(20, 52))]


def _body(root):
    from mtds.eval import build_parser, run as evaluate
    from mtds.training import run
    lr = _schedule()
    runs, live = {}, []
    for zero in (0, 1):
        common = dict(expert_model_parallel_size=2, deepspeed_config=ds_config(zero=zero), **lr)
        probe = (lambda engine, groups: live.append(engine.module),) if zero == 1 else ()
        full = run(train_config(**common, save=f"{root}/zero{zero}", save_interval=SAVED_AT), on_engine_ready=probe)
        resumed = run(train_config(**common, load=f"{root}/zero{zero}/global_step{SAVED_AT}"))
        runs[zero] = [(r.losses, r.grad_norms) for r in (full, resumed)]
    # fp32 ZeRO-0 reshards too (p = 1): its E = 2 checkpoint of step 2 at E = 1 (saving step 3), that one into ZeRO-1
    # at E = 2, and the ZeRO-1 E = 2 checkpoint of step 2 into ZeRO-0 at E = 2 (each rank slicing its own experts)
    zero0 = dict(deepspeed_config=ds_config(zero=0), **lr)
    z0 = [run(train_config(**zero0, load=f"{root}/zero0/global_step{SAVED_AT}", save=f"{root}/z0e1", save_interval=3)),
          run(train_config(**lr, expert_model_parallel_size=2, deepspeed_config=ds_config(zero=1),
                           load=f"{root}/z0e1/global_step3")),
          run(train_config(**zero0, expert_model_parallel_size=2, load=f"{root}/zero1/global_step{SAVED_AT}"))]
    z0 = [(r.losses, r.grad_norms) for r in z0]
    # resharding (fp32 ZeRO-1): the E = 2 checkpoint of step 2 at E = 1 (saving step 3), that one at E = 2 again
    one = dict(deepspeed_config=ds_config(zero=1), **lr)
    to_e1 = run(train_config(**one, load=f"{root}/zero1/global_step{SAVED_AT}", save=f"{root}/e1", save_interval=3))
    back = run(train_config(**one, expert_model_parallel_size=2, load=f"{root}/e1/global_step3"))
    # and across t: the E = 2 checkpoint of step 2 at (2,1,1) (saving step 3), that one at (1,1,2) E = 2
    to_t2 = run(train_config(**one, tp=2, load=f"{root}/zero1/global_step{SAVED_AT}", save=f"{root}/t2",
                             save_interval=3))
    from_t2 = run(train_config(**one, expert_model_parallel_size=2, load=f"{root}/t2/global_step3"))
    # a weights-only checkpoint (full tensors, as mtds-convert hf-to-mtds writes) at E = 2 and at E = 1
    first = [run(train_config(expert_model_parallel_size=e, deepspeed_config=ds_config(zero=1),
                              load=f"{root}/weights", **{**lr, "steps": 1})).losses[0] for e in (1, 2)]
    # the ZeRO-1 run's weights as saved last (step 5): this rank's experts, the dense weights
    weights = {n: p.detach().clone() for n, p in live[0].named_parameters()}
    # mtds-eval --ckpt of that E = 2 checkpoint, as a data-parallel pair (evaluation has no expert parallelism)
    evaluated = evaluate(build_parser().parse_args(["--ckpt", f"{root}/zero1", "--data", f"{root}/rows.jsonl"]))
    # bf16 ZeRO-1 with fp32 gradient accumulation: DeepSpeed's BF16 optimizer; saved at step 2, resumed at E = 1
    b16 = dict(deepspeed_config=ds_config(zero=1, precision="bf16", data_types={"grad_accum_dtype": "fp32"}), **lr)
    bf16 = [run(train_config(**b16, expert_model_parallel_size=2, save=f"{root}/bf16", save_interval=SAVED_AT)),
            run(train_config(**b16, load=f"{root}/bf16/global_step{SAVED_AT}"))]
    return runs, z0, first, weights, evaluated, [r.losses for r in (to_e1, back, to_t2, from_t2)], \
        [(r.losses, r.grad_norms) for r in bf16]


def _schedule() -> dict:
    return dict(lr=TRAIN_LR, min_lr=TRAIN_LR / 10, steps=STEPS, model=_training_model("mixtral"))  # 4 experts


def _resume_alone(root):
    from mtds.training import run
    return run(train_config(deepspeed_config=ds_config(zero=1), load=f"{root}/zero1/global_step{SAVED_AT}",
                            **_schedule())).losses


def _weights_only(root):
    """A weights-only checkpoint of a Mixtral with other weights than the runs' init (written as mtds-convert's)."""
    import torch
    from mtds.checkpoint.writer import write_weights_checkpoint
    from mtds.model import GPTModel
    cfg = _training_model("mixtral")
    model = GPTModel(cfg, seed=7)       # the runs' init is seed 1234
    with torch.no_grad():               # and experts far apart, so a wrong one shows in the loss
        for n, p in model.named_parameters():
            if ".experts." in n:
                p.mul_(torch.arange(1, cfg.num_experts + 1, dtype=p.dtype).view(-1, 1, 1))
    layers = {i: {n: p.detach() for n, p in m.named_parameters()} for i, m in model.global_layers().items()}
    write_weights_checkpoint(f"{root}/weights", cfg, lambda: iter(layers.items()), tp=1, pp=1)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from tests.dist import spawn
    root = str(tmp_path_factory.mktemp("epck"))
    _weights_only(root)
    with open(f"{root}/rows.jsonl", "w") as f:
        f.writelines(json.dumps({"input_ids": r}) + "\n" for r in EVAL_ROWS)
    return root, spawn(_body, 2, root, timeout=300)


def test_resume_at_the_same_layout_is_bit_exact(saved):
    _, per_rank = saved
    for rank, (runs, *_) in enumerate(per_rank):
        for zero, ((losses, norms), (resumed_losses, resumed_norms)) in runs.items():
            assert len(set(losses)) == STEPS, (rank, zero, losses)
            assert resumed_losses == losses[SAVED_AT:], (rank, zero, resumed_losses, losses)
            assert resumed_norms == norms[SAVED_AT:], (rank, zero, resumed_norms, norms)
    assert per_rank[0][0] == per_rank[1][0]


def test_each_expert_is_saved_once_by_the_rank_holding_it(saved):
    """DeepSpeed's MoE files: global expert G in layer_0_expert_G (all MoE blocks' slices), written by the rank
    holding it; the model file without mtds's stacked experts; ZeRO-0's optimizer per EP shard."""
    from mtds.checkpoint.complete import rank_manifest
    from mtds.checkpoint.meta import CheckpointMeta
    from mtds.checkpoint.safe_load import safe_load
    root, _ = saved
    tag = f"{root}/zero0/global_step{SAVED_AT}"
    written = [sorted(safe_load(rank_manifest(tag, r))["files"]) for r in (0, 1)]
    expert = "layer_0_expert_{}_mp_rank_00_model_states.pt".format
    assert written == [sorted([expert(0), expert(1), "expp_rank_0_mp_rank_00_optim_states.pt",
                               "mp_rank_00_model_states.pt"]),
                       sorted([expert(2), expert(3), "expp_rank_1_mp_rank_00_optim_states.pt"])], written
    assert CheckpointMeta.load(tag).ep == 2
    module = safe_load(os.path.join(tag, "mp_rank_00_model_states.pt"))["module"]
    assert not [k for k in module if ".experts." in k] and "layers.0.mlp.router.weight" in module
    one = safe_load(os.path.join(tag, expert(3)))
    assert sorted(one) == sorted(f"deepspeed_expert_groups.deepspeed_moe.experts.deepspeed_experts.3.layers.{i}."
                                 f"mlp.experts.{w}" for i in (0, 1) for w in ("gate_up", "down")), sorted(one)


def test_a_zero0_checkpoint_reshards_and_zero1_resumes_at_zero0(saved):
    """fp32 ZeRO-0 (p = 1; mtds.checkpoint.reshard_experts reads each EP shard's whole optimizer, the experts'
    moments stacked in EP order): the E = 2 checkpoint of step 2 resumed at E = 1 (d = 2) gives the uninterrupted
    ZeRO-0 run's losses and grad norms of steps 3-5, that run's E = 1 checkpoint of step 3 resumed at E = 2 ZeRO-1
    those of steps 4-5, and the ZeRO-1 E = 2 checkpoint of step 2 resumed at ZeRO-0 E = 2 (each rank slicing its
    EP shard's experts from the universal tensors) the ZeRO-1 run's. Held to 1e-5 (ZeRO-0 and ZeRO-1 reduce
    the gradients in another order); measured in docs/moe.md. What fails it: the experts' moments stacked in
    reverse, every rank at ZeRO-0 given EP shard 0's experts, the moments written as zeros (docs/moe.md)."""
    _, per_rank = saved
    for rank, (runs, z0, *_) in enumerate(per_rank):
        (losses0, norms0), _ = runs[0]
        (losses1, norms1), _ = runs[1]
        for (got, got_norms), (losses, norms), start in zip(z0, ((losses0, norms0), (losses0, norms0),
                                                                 (losses1, norms1)), (SAVED_AT, 3, SAVED_AT)):
            want, want_norms = losses[start:], norms[start:]
            assert len(got) == len(want), (rank, got, want)
            loss = max_rel_diff(got, want)
            norm = max_rel_diff(got_norms, want_norms)
            print(f"rank {rank} from step {start}: loss {loss:.2e} norm {norm:.2e}")
            assert loss < 1e-5 and norm < 1e-5, (rank, start, loss, norm, got, want, got_norms, want_norms)


def test_resharding_to_another_expert_parallel_size_continues_the_run(saved):
    """fp32 ZeRO-1, d = 2: the E = 2 checkpoint of step 2 resumed at E = 1 (the experts' partitions of the two EP
    shards stacked into one tensor, partitioned over d) gives the uninterrupted E = 2 run's losses of steps 3-5;
    its E = 1 checkpoint of step 3 resumed at E = 2 (each rank's experts sliced by DeepSpeed's universal load)
    those of steps 4-5. Held to 1e-5; measured equal. What fails it: the Adam moments reset (9.7e-4; step 3's loss
    comes before the first update), the experts stacked in reverse (3.7e-4), every rank slicing EP shard 0's experts
    (2.5e-4, with mtds's EP-rank check off), the expert group's hyperparameters left out of the universal folder
    (7.8e-4: its LR restarts)."""
    _assert_resumes_continue(saved, lambda to_e1, back, to_t2, from_t2: (to_e1, back))


def test_resharding_to_another_tensor_parallel_size_continues_the_run(saved):
    """fp32 ZeRO-1: the E = 2 (1,1,2) checkpoint of step 2 resumed at (2,1,1) E = 1 (the TP pieces of every tensor
    cut by DeepSpeed's loader from the keys mtds wrote: the experts' gate|up per segment on dim 1, down on dim 2),
    and that run's t = 2 checkpoint of step 3 at (1,1,2) E = 2 (the TP pieces merged by the converter): the
    uninterrupted run's losses within 1e-5 (measured equal). What fails it: the experts written without TP keys
    (cut on dim 0: 5.2e-4), gate|up cut as one block (4.0e-4), down's TP pieces merged in reverse (6.2e-4)."""
    _assert_resumes_continue(saved, lambda to_e1, back, to_t2, from_t2: (to_t2, from_t2))


def _assert_resumes_continue(saved, pick) -> None:
    """On every rank, the two resharded resumes ``pick`` chooses (one from the E = 2 checkpoint of step 2, one from
    that resumed run's checkpoint of step 3) give the uninterrupted E = 2 run's losses from there, within 1e-5."""
    _, per_rank = saved
    for rank, (runs, *_, resumes, _) in enumerate(per_rank):
        (losses, _), _ = runs[1]
        first, second = pick(*resumes)
        for got, want in ((first, losses[SAVED_AT:]), (second, losses[SAVED_AT + 1:])):
            assert len(got) == len(want) and max_rel_diff(got, want) < 1e-5, (rank, got, want)


def test_a_bf16_checkpoint_reshards(saved):
    """bf16 ZeRO-1 with fp32 gradient accumulation (DeepSpeed's BF16 optimizer: fp32 master partitions and Adam
    moments in bf16_zero_pp_rank files with ZeRO's keys, converted as fp32 ZeRO-1's): the E = 2 checkpoint of step 2
    resumed at E = 1. Step 3's loss equals the uninterrupted E = 2 run's bit for bit (the bf16 weights are the
    rounded fp32 masters, and this forward rounds the same sums); steps 4-5 and the grad norms only within bf16's
    layout noise: a bf16 run at E = 1 rounds its expert sums in another order than at E = 2 (two uninterrupted runs
    from the same weights: 1.5e-6 apart in loss after one step, 3.8e-6 / 3.3e-4 over five), so they are held as
    tests/test_moe.py holds bf16 E = 2 against E = 1, 5e-5 / 2e-3. Measured 5.7e-6 / 8.8e-5 (the largest under native,
    avx2 and default kernels; docs/testing.md). What fails it: the Adam
    moments written as zeros (steps 4-5 9.6e-4 off, norms 3.4e-3), the experts' EP shards stacked in reverse (step
    3's loss 9.037929 vs 9.035230)."""
    from tests.bounds import same, within
    _, per_rank = saved
    for rank, (*_, ((losses, norms), (got, got_norms))) in enumerate(per_rank):
        assert len(got) == STEPS - SAVED_AT and same("moe_checkpoint.bf16_reshard.first_loss", got[0],
                                                     losses[SAVED_AT]), (rank, got, losses)
        loss = max_rel_diff(got, losses[SAVED_AT:])
        norm = max_rel_diff(got_norms, norms[SAVED_AT:])
        assert all([within("moe_checkpoint.bf16_reshard.loss", loss, 5e-5),
                    within("moe_checkpoint.bf16_reshard.norm", norm, 2e-3)]), \
            (rank, loss, norm, got, losses, got_norms, norms)


def test_resharding_to_one_rank_continues_the_run(saved):
    """The E = 2 checkpoint of step 2 on one rank (d 2 -> 1, E 2 -> 1; the global batch as accumulated
    micro-batches): the uninterrupted run's losses of steps 3-5 within 1e-5 (measured 1.1e-7)."""
    from tests.dist import spawn
    root, per_rank = saved
    [got] = spawn(_resume_alone, 1, root, timeout=300)
    (want, _), _ = per_rank[0][0][1]
    assert len(got) == STEPS - SAVED_AT and max_rel_diff(got, want[SAVED_AT:]) < 1e-5, \
        (got, want)


def test_the_universal_experts_are_stacked_in_global_order(saved):
    """mtds's converter (mtds.checkpoint.reshard_experts) of the E = 2 ZeRO-1 checkpoint of step 5: every tensor
    of the universal folder equals the live model's at step 5 bit for bit (the experts: rank 0's then rank 1's),
    and only the experts carry DeepSpeed's EP mark with E = 4, which makes its load slice each rank's own."""
    import torch
    from mtds.checkpoint.names import ds_name
    from mtds.checkpoint.safe_load import safe_load
    from mtds.checkpoint.universal import ensure_universal
    from mtds.deepspeed_compat.expert_universal import marked_experts
    from mtds.checkpoint.expert_files import STACKED
    root, per_rank = saved
    cfg = _training_model("mixtral")
    zero = os.path.join(ensure_universal(f"{root}/zero1", f"global_step{STEPS}"), "zero")
    wrong = []
    for layer, tensors in _live_layers(per_rank).items():
        for inner, want in tensors.items():
            entry = safe_load(os.path.join(zero, ds_name(cfg, layer, inner, pipeline=False), "fp32.pt"))
            if not torch.equal(entry["param"], want) or marked_experts(entry) != (4 if inner in STACKED else None):
                wrong.append((layer, inner, marked_experts(entry)))
    assert wrong == [], wrong


def test_a_missing_expert_file_makes_the_checkpoint_incomplete(saved, tmp_path):
    """Rank 1 listed its expert files in its manifest: without one the newest checkpoint is skipped, saying why."""
    from mtds.checkpoint.complete import find_complete
    root, _ = saved
    shutil.copytree(f"{root}/zero1", tmp_path / "ck")
    os.remove(tmp_path / "ck" / f"global_step{STEPS}" / "layer_0_expert_2_mp_rank_00_model_states.pt")
    tag_dir, skipped = find_complete(str(tmp_path / "ck"))
    assert os.path.basename(tag_dir) == "global_step4", tag_dir
    assert skipped == [f"skipped global_step{STEPS}: missing file layer_0_expert_2_mp_rank_00_model_states.pt "
                       f"(written by rank 1)"], skipped


def test_a_weights_only_checkpoint_loads_at_e2(saved):
    """Each rank slices its own experts from the full tensors (DeepSpeed's MoE load would look for per-expert
    files): the first loss at E = 2 is E = 1's (the same weights; expert outputs summed in another order)."""
    _, per_rank = saved
    for _, _, (e1, e2), *_ in per_rank:
        assert abs(e2 - e1) / e1 < 1e-6, (e1, e2)


def test_expert_layout_rule():
    """Which checkpoints a run may reshard (mtds.checkpoint.expert_layout), without a run: ZeRO-1/2 in the same
    precision, fp32 or bf16, at any t, p, d and E on either side (pipelines too); fp32 ZeRO-0 from or into
    ZeRO-0/1/2 at p = 1; a ZeRO-0 pipeline, bf16 ZeRO-0, fp16, another precision or a weights-only checkpoint
    not."""
    import dataclasses
    from mtds.checkpoint.expert_layout import reshard_problem
    from mtds.checkpoint.meta import CheckpointMeta
    from mtds.parallel.layout import ParallelLayout
    cfg = _training_model("mixtral").to_dict()
    layouts = (ParallelLayout(dp=4, ep=4), ParallelLayout(dp=4), ParallelLayout(pp=2, dp=2, ep=2),
               ParallelLayout(tp=2, pp=2), ParallelLayout(tp=2, dp=2, ep=2))
    for saved in (dict(tp=1, pp=2, dp=2, ep=2), dict(tp=1, pp=1, dp=4, ep=2), dict(tp=2, pp=2, dp=1)):
        meta = CheckpointMeta(model=cfg, zero_stage=1, **saved)
        assert [reshard_problem(meta, lay, z, "fp32", "ck") for lay in layouts for z in (1, 2)] == [None] * 10
        bf16 = dataclasses.replace(meta, precision="bf16")      # DeepSpeed's BF16 optimizer: fp32 masters too
        assert [reshard_problem(bf16, lay, z, "bf16", "ck") for lay in layouts for z in (1, 2)] == [None] * 10
        # fp32 ZeRO-0 on either side at p = 1 (a ZeRO-0 pipeline not)
        zero0 = dataclasses.replace(meta, zero_stage=0)
        assert [reshard_problem(meta, lay, 0, "fp32", "ck") is None for lay in layouts] == \
            [lay.pp == 1 for lay in layouts]
        assert [reshard_problem(zero0, lay, z, "fp32", "ck") is None for lay in layouts for z in (0, 1, 2)] == \
            [meta.pp == 1 and (z > 0 or lay.pp == 1) for lay in layouts for z in (0, 1, 2)]
        for other, zero, precision in ((meta, 1, "bf16"), (bf16, 1, "fp32"), (bf16, 0, "bf16"), (meta, 0, "bf16"),
                                       (dataclasses.replace(meta, precision="fp16"), 1, "fp16"),
                                       (dataclasses.replace(zero0, precision="bf16"), 0, "bf16"),
                                       (dataclasses.replace(zero0, pp=2), 1, "fp32"),
                                       (dataclasses.replace(meta, weights_only=True), 1, "fp32")):
            problem = reshard_problem(other, layouts[0], zero, precision, "ck")
            assert problem.startswith(f"checkpoint ck was saved at --expert-model-parallel-size {meta.ep} (") and \
                "reshard only between ZeRO-1/2 runs of the same precision" in problem, problem


def test_another_zero_stage_is_refused():
    """The load holds the ZeRO stage and precision (an engine's) for any MoE model (E = 1 too): fp32 or bf16
    ZeRO-1/2 reshards at any p, fp32 ZeRO-0 from or into ZeRO-0/1/2 at p = 1."""
    import dataclasses
    from types import SimpleNamespace

    from torch import nn

    from mtds.checkpoint.lifecycle import CheckpointError, _check_expert_layout
    from mtds.checkpoint.meta import CheckpointMeta
    from mtds.parallel.layout import ParallelLayout
    from mtds.training.cli import user_errors
    meta = CheckpointMeta(model=_training_model("mixtral").to_dict(), tp=1, pp=1, dp=2, ep=2, zero_stage=0)
    groups = SimpleNamespace(layout=ParallelLayout(dp=2, ep=2))
    def engine(stage, bf16=False):
        return SimpleNamespace(zero_optimization=lambda: stage > 0, zero_optimization_stage=lambda: stage,
                               bfloat16_enabled=lambda: bf16, fp16_enabled=lambda: False, module=nn.Module())

    _check_expert_layout(meta, engine(0), groups, "ck")
    _check_expert_layout(meta, engine(1), groups, "ck")       # fp32 ZeRO-0 -> ZeRO-1 reshards (p = 1)
    with pytest.raises(CheckpointError) as err:                 # a ZeRO-0 pipeline does not
        _check_expert_layout(dataclasses.replace(meta, pp=2, dp=1), engine(1), groups, "ck")
    assert "saved at --expert-model-parallel-size 2 (tp 1, pp 2, dp 1) with ZeRO-0 fp32; this run is at " \
           "--expert-model-parallel-size 2 (tp 1, pp 1, dp 2) with ZeRO-1 fp32" in str(err.value)
    assert isinstance(err.value, user_errors())        # train.py: one error: line, exit 2
    # ZeRO-1 -> ZeRO-2 at another E reshards; into bf16 it is not built
    zero1 = dataclasses.replace(meta, zero_stage=1)
    _check_expert_layout(zero1, engine(2), SimpleNamespace(layout=ParallelLayout(dp=2)), "ck")
    with pytest.raises(CheckpointError, match="with ZeRO-1 bf16: mixture-of-experts checkpoints reshard only"):
        _check_expert_layout(zero1, engine(1, bf16=True), SimpleNamespace(layout=ParallelLayout(dp=2)), "ck")
    # a pipeline checkpoint reshards too (E = 1 or 2), into ZeRO-0 at p = 1 only
    for ep in (1, 2):
        p2 = dataclasses.replace(zero1, pp=2, dp=1, ep=ep)
        _check_expert_layout(p2, engine(1), SimpleNamespace(layout=ParallelLayout(dp=2)), "ck")
        _check_expert_layout(p2, engine(0), SimpleNamespace(layout=ParallelLayout(dp=2)), "ck")
        with pytest.raises(CheckpointError, match=r"\(tp 1, pp 2, dp 1\) with ZeRO-1 fp32; this run is at "):
            _check_expert_layout(p2, engine(0), SimpleNamespace(layout=ParallelLayout(pp=2)), "ck")


def test_scheduler_state_fits_another_group_count():
    """E > 1 runs hold two param groups (dense, experts), E = 1 runs one: equal per-group scheduler entries are
    resized, unequal ones refused (mtds.checkpoint.scheduler_groups)."""
    from mtds.checkpoint.errors import CheckpointFormatError
    from mtds.checkpoint.scheduler_groups import fit_groups
    saved = {"base_lrs": [5e-4, 5e-4], "_last_lr": [4e-4, 4e-4], "lr_lambdas": [None, None], "last_epoch": 2}
    assert fit_groups(saved, 1) == {"base_lrs": [5e-4], "_last_lr": [4e-4], "lr_lambdas": [None], "last_epoch": 2}
    assert fit_groups(fit_groups(saved, 1), 2) == saved and fit_groups(saved, 2) is saved
    with pytest.raises(CheckpointFormatError, match="differs between its 2 param groups"):
        fit_groups({**saved, "_last_lr": [4e-4, 3e-4]}, 1)


def _live_layers(per_rank) -> dict:
    """{global layer: {name: tensor}} of the live model at the last save: the dense weights of rank 0, each
    block's stacked experts as rank 0's then rank 1's (the global order: rank r holds experts 2r and 2r + 1)."""
    import torch
    from mtds.checkpoint.expert_files import STACKED
    from mtds.checkpoint.names import parse
    cfg, layers = _training_model("mixtral"), {}
    for name, tensor in per_rank[0][3].items():
        try:
            layer, inner = parse(cfg, name)
        except KeyError:        # the ExpertGroups module's view of the same experts
            continue
        if inner in STACKED:
            tensor = torch.cat([ranks[3][name] for ranks in per_rank])
        layers.setdefault(layer, {})[inner] = tensor
    return dict(sorted(layers.items()))


@pytest.fixture(scope="module")
def exported(saved, tmp_path_factory):
    """``mtds-convert mtds-to-hf`` of the E = 2 ZeRO-1 checkpoint (step 5); the same export of the live weights."""
    from mtds.cli.convert import main as convert
    from mtds.hf.stream_export import write_hf_dir
    root, per_rank = saved
    out = tmp_path_factory.mktemp("ephf")
    convert(["mtds-to-hf", "--ckpt", f"{root}/zero1", "--out", str(out / "ckpt")])
    write_hf_dir(str(out / "live"), _training_model("mixtral"), iter(_live_layers(per_rank).items()))
    return out


def test_the_hf_export_of_an_e2_checkpoint_is_the_trained_model(exported):
    """The reader joins every block's experts from the per-expert files in global order: the export equals the
    live model's, tensor for tensor, bit for bit (the experts all differ, so any other order shows)."""
    import torch
    from safetensors.torch import load_file
    got, want = (load_file(exported / d / "model.safetensors") for d in ("ckpt", "live"))
    assert sorted(got) == sorted(want) and len(want) > 20, sorted(got)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []
    experts = [want[f"model.layers.0.block_sparse_moe.experts.{e}.w1.weight"] for e in range(4)]
    assert all(not torch.equal(a, b) for i, a in enumerate(experts) for b in experts[i + 1:])
    assert (exported / "ckpt" / "config.json").read_text() == (exported / "live" / "config.json").read_text()


def test_transformers_and_mtds_eval_read_the_export(saved, exported):
    """transformers loads the exported folder: its logits equal those of mtds's model holding the live weights
    (1e-5); ``mtds-eval --ckpt`` of the E = 2 checkpoint (run at (1,1,2), E = 1, in the fixture's body) gives
    transformers' loss of the live weights' export (1e-5 relative)."""
    import torch
    import transformers
    from mtds.model import GPTModel
    _, per_rank = saved
    cfg = _training_model("mixtral")
    model = GPTModel(cfg).eval()
    for layer, tensors in _live_layers(per_rank).items():
        model.global_layers()[layer].load_state_dict(tensors)
    hf, live = (transformers.AutoModelForCausalLM.from_pretrained(exported / d).eval() for d in ("ckpt", "live"))
    ids = torch.tensor([EVAL_ROWS[2]])
    with torch.no_grad():
        diff = (model.logits(ids)[..., :cfg.vocab_size] - hf(ids).logits).abs().max().item()
        losses = [live(torch.tensor([r]), labels=torch.tensor([r])).loss.item() for r in EVAL_ROWS]
    assert diff < 1e-5, diff
    want = sum(loss * (len(r) - 1) for loss, r in zip(losses, EVAL_ROWS)) / sum(len(r) - 1 for r in EVAL_ROWS)
    for evaluated in (ranks[4] for ranks in per_rank):
        assert evaluated["tokens"] == sum(len(r) - 1 for r in EVAL_ROWS), evaluated
        assert abs(evaluated["loss"] - want) / want < 1e-5, (evaluated, want)


def _split_over_tp(tag: str, root: str, t: int = 2) -> None:
    """The t = 1 E = 2 checkpoint ``tag`` as t TP ranks would write it, committed under ``root``: each model file
    and expert file holds its TP shard (mtds.checkpoint.shard_spec), the meta says tp t."""
    import dataclasses

    import torch
    from mtds.checkpoint.commit import commit, describe_files, write_manifest
    from mtds.checkpoint.complete import Marker
    from mtds.checkpoint.dsformat import expert_file, mp_rank_file
    from mtds.checkpoint.expert_files import STACKED, file_key
    from mtds.checkpoint.meta import CheckpointMeta
    from mtds.checkpoint.names import parse
    from mtds.checkpoint.safe_load import safe_load
    from mtds.checkpoint.shard_spec import layer_names, shard
    cfg, staging = _training_model("mixtral"), os.path.join(root, "staging")
    module = safe_load(mp_rank_file(tag, 0))["module"]
    os.makedirs(staging)
    for r in range(t):
        torch.save({"module": {k: shard(cfg, *parse(cfg, k), v, t, r).clone() for k, v in module.items()}},
                   mp_rank_file(staging, r))
    blocks = [i for i in range(1, cfg.num_layers + 1) if cfg.is_moe_layer(i)]
    names = layer_names(cfg)      # the stacked tensors this model has (GPT-OSS's expert biases too)
    for g in range(cfg.num_experts):
        state = safe_load(expert_file(tag, g, 0))
        for r in range(t):     # shard_spec splits the stacked [E, ...] tensor: expert g's slice alone as [1, ...]
            torch.save({file_key(cfg, i, n, g): shard(cfg, i, n, state[file_key(cfg, i, n, g)][None], t, r)[0].clone()
                        for i in blocks for n in STACKED if n in names[i]}, expert_file(staging, g, r))
    write_manifest(staging, 0, describe_files(staging, sorted(os.listdir(staging))))
    commit(root, os.path.basename(tag), staging, Marker(step=STEPS, world_size=1),
           dataclasses.replace(CheckpointMeta.load(tag), tp=t))


def test_tp_shards_of_the_experts_are_merged(saved, tmp_path):
    """At t > 1 each TP rank's expert files hold its shard: the reader merges them as the dense weights (the
    same tensors as the t = 1 checkpoint they were cut from); an expert file missing, or ZeRO-3 at E > 1 (which
    training refuses), is refused in one line."""
    import torch
    from mtds.checkpoint.errors import CheckpointFormatError
    from mtds.checkpoint.meta import META_FILE
    from mtds.checkpoint.reader import open_checkpoint
    root, _ = saved
    tag = f"{root}/zero1/global_step{STEPS}"
    _split_over_tp(tag, str(tmp_path))
    t2 = tmp_path / f"global_step{STEPS}"
    want, got = dict(open_checkpoint(tag).layers()), dict(open_checkpoint(str(t2)).layers())
    assert sorted(got) == sorted(want)
    assert [(i, n) for i in want for n in want[i] if not torch.equal(got[i][n], want[i][n])] == []
    meta = json.loads((t2 / META_FILE).read_text())
    (t2 / META_FILE).write_text(json.dumps({**meta, "zero_stage": 3}))
    with pytest.raises(CheckpointFormatError) as err:
        open_checkpoint(str(t2))
    assert "saved at --expert-model-parallel-size 2 with ZeRO-3" in str(err.value) and "\n" not in str(err.value)
    os.remove(t2 / "layer_0_expert_3_mp_rank_01_model_states.pt")
    with pytest.raises(CheckpointFormatError, match="missing file layer_0_expert_3_mp_rank_01_model_states.pt"):
        open_checkpoint(str(t2))
