"""Mixture of experts (docs/moe.md) against transformers' MixtralForCausalLM and Qwen3MoeForCausalLM, fp32:
logits, the training loss with transformers' load-balancing term and its gradients, the export round trip
(transformers' own per-expert files, bit for bit), training parity (10 clipped AdamW steps) at (1,1,1) and
at t = 2 in one spawned body, and the one-line refusals of what is not built.

Router ties: a token whose k-th and (k+1)-th expert probabilities are within rounding of each other could
go to different experts in two correct implementations. The one-process checks assert that no such token
is near on their batch (margin > 1e-4 on every MoE block). The training runs (10 x 4 micro-batches of the
shipped corpus, mtds's init) do not assert it: with router logits O(0.1) their margins are smaller, and
they are held to 1e-5 as a whole; a flip that moved the loss or the norm by more would fail them (they reach
about 1e-7, see docs/moe.md).
"""
import dataclasses

import pytest
import torch

from mtds.hf import (UnsupportedHFConfig, hf_config_dict, load_hf_into_model, model_config_from_hf,
                     model_to_hf_state, save_hf_checkpoint)
from mtds.model import GPTModel

REL_TOL = 1e-5
VOCAB, SEQ = 256, 16
MARGIN = 1e-4


def _shape(**kw):
    return dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=64, bos_token_id=0,
                eos_token_id=1, **kw)


CASES = {
    # every block MoE, always renormalised over the k
    "mixtral": lambda T: T.MixtralConfig(**_shape(num_local_experts=4, router_aux_loss_coef=0.02)),
    # block 0 MoE, block 1 dense (mlp_only_layers), experts narrower than the dense MLP, no renormalisation
    "qwen3_moe": lambda T: T.Qwen3MoeConfig(**_shape(num_experts=4, moe_intermediate_size=48, mlp_only_layers=[1],
                                                     head_dim=32, norm_topk_prob=False, router_aux_loss_coef=0.02)),
    # decoder_sparse_step 2: block 0 dense, block 1 MoE; renormalised; head_dim defaulting to hidden / heads
    "qwen3_moe_step": lambda T: T.Qwen3MoeConfig(**_shape(num_experts=4, moe_intermediate_size=48,
                                                          decoder_sparse_step=2, norm_topk_prob=True,
                                                          router_aux_loss_coef=0.02)),
}


# each case's weight seed: one whose routing of the test batch has no near tie (asserted; other seeds have
# margins down to 1e-7 on these 64 tokens x blocks)
SEEDS = {"mixtral": 1, "qwen3_moe": 0, "qwen3_moe_step": 0}


def _hf(name):
    import transformers as T
    return random_moe(CASES[name](T), SEEDS[name])


def random_moe(config, seed: int):
    """transformers' model with every weight random and O(1) router logits (the init's 0.02 leaves the
    experts' probabilities within 1e-3 of each other, too near a tie to compare routings); an expert-choice
    bias buffer (DeepSeek-V3's) random too: it moves the choice, not the weights."""
    import transformers as T
    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif pname.endswith("gate.weight"):      # the router's and a shared expert's gate
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
        for pname, b in model.named_buffers():
            if pname.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    return model


def train_loss_and_grads_match(hf, model, cfg, ids, labels, name, tmp_path, no_grad: tuple[str, ...] = ()):
    """In training mode: the loss (LM + coef x aux) and every gradient, in transformers' names, within REL_TOL;
    ``no_grad``: name suffixes without a gradient (buffers). Returns transformers' output."""
    hf.train(), model.train()
    out = hf(ids, labels=ids, output_router_logits=True)     # transformers shifts ids itself
    loss = model(ids, labels)
    got, want = float(loss.detach()), float(out.loss.detach())
    assert abs(got - want) / want < REL_TOL, (name, got, want)
    out.loss.backward()
    loss.backward()
    ours, theirs = grads_in_hf_names(model, cfg, hf, tmp_path / "grads")
    assert sorted(ours) == sorted(theirs)
    worst = max(_rel(ours[k], theirs[k]) for k in theirs if not (no_grad and k.endswith(no_grad)))
    assert worst < REL_TOL, (name, worst)
    return out


def _imported(name, tmp_path):
    """transformers' model, its own files on disk, and mtds's model loaded from them."""
    hf = _hf(name)
    hf.save_pretrained(str(tmp_path))
    cfg = model_config_from_hf(hf.config)
    model = GPTModel(cfg)
    load_hf_into_model(model, str(tmp_path))
    return hf, cfg, model


def _ids(seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    return ids, torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _min_margin(router_logits, k) -> float:
    """The smallest gap between a token's k-th and (k+1)-th expert probability over every MoE block."""
    probs = torch.softmax(torch.stack(router_logits).float(), dim=-1).sort(dim=-1, descending=True).values
    return float((probs[..., k - 1] - probs[..., k]).min())


@pytest.mark.parametrize("name", list(CASES))
def test_logits_loss_and_grads_match_transformers(name, tmp_path):
    """Evaluation logits; then in training mode the loss (LM + router_aux_loss_coef x aux, transformers'
    ``loss`` with output_router_logits) and every gradient, through the export's names."""
    hf, cfg, model = _imported(name, tmp_path)
    assert [cfg.is_moe_layer(i) for i in (1, 2)] == {"mixtral": [True, True], "qwen3_moe": [True, False],
                                                     "qwen3_moe_step": [False, True]}[name]
    ids, labels = _ids()
    hf.eval(), model.eval()
    with torch.no_grad():
        out = hf(ids, output_router_logits=True)
        assert _min_margin(out.router_logits, cfg.moe_top_k) > MARGIN, name
        assert _rel(model.full_logits(ids), out.logits) < REL_TOL, name
        # evaluation: the LM loss only (transformers' default output_router_logits=False), no aux term kept
        lm = hf(ids, labels=ids).loss
        assert abs(float(model(ids, labels)) - float(lm)) / float(lm) < REL_TOL, name
    out = train_loss_and_grads_match(hf, model, cfg, ids, labels, name, tmp_path)
    aux = cfg.router_aux_loss_coef * out.aux_loss
    assert aux > 1e-3 * out.loss, (name, float(aux), float(out.loss))   # the term is there to see


def test_recomputed_training_then_evaluation(tmp_path):
    """--recompute full (the p = 1 model's blocks in mtds.tp.checkpoint, non-reentrant) keeps the router
    statistics' gradient: loss and gradients equal those without it. The backward's recompute sets the
    blocks' statistics again; an evaluation afterwards reports the LM loss only, as transformers does."""
    import types

    from mtds.hf.init import load_hf_into_stages
    from mtds.pipe.module import SequentialGPT
    from mtds.tp import model_parallel_seed
    hf, cfg, _ = _imported("mixtral", tmp_path)
    groups = types.SimpleNamespace(tp_group=None, ep_group=None)
    ids, labels = _ids()
    losses, grads = [], []
    for interval in (0, 1):
        model = SequentialGPT(cfg, groups, seed=0, rng_tracker=model_parallel_seed(0, 0),
                              recompute_interval=interval).train()
        load_hf_into_stages(model, str(tmp_path), cfg, groups)
        loss = model(ids, labels)
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in model.named_parameters()})
    assert torch.equal(losses[0], losses[1])
    assert all(torch.equal(g, grads[0][n]) for n, g in grads[1].items())
    assert any(b.stats is not None for b in model.modules() if hasattr(b, "stats")), "no recompute seen"
    model.eval()
    with torch.no_grad():
        lm = hf.eval()(ids, labels=ids).loss
        assert abs(float(model(ids, labels)) - float(lm)) / float(lm) < REL_TOL


def grads_in_hf_names(model, cfg, hf, path):
    """(mtds's gradients, transformers' gradients), both in transformers' names: mtds's through the export's
    tables (they map gradients as they map weights), transformers' saved and read back at ``path``."""
    grads = {n: p.grad for n, p in model.named_parameters()}
    as_weights = GPTModel(cfg)
    with torch.no_grad():
        for n, p in as_weights.named_parameters():
            p.copy_(grads[n])
    return model_to_hf_state(as_weights), _hf_state_of_grads(hf, path)


def _hf_state_of_grads(hf, path):
    """transformers' gradients in its on-disk (per-expert) names: save the model with its grads as weights."""
    from safetensors.torch import load_file
    with torch.no_grad():
        saved = {n: p.detach().clone() for n, p in hf.named_parameters()}
        for n, p in hf.named_parameters():
            p.copy_(p.grad if p.grad is not None else torch.zeros_like(p))   # an expert no token chose
        hf.save_pretrained(str(path))
        for n, p in hf.named_parameters():
            p.copy_(saved[n])
    return load_file(str(path / "model.safetensors"))


@pytest.mark.parametrize("name", list(CASES))
def test_export_round_trip(name, tmp_path):
    """transformers' files -> mtds -> export: the same keys and tensors bit for bit, the same config, and
    transformers loads the export to the same logits; the same through mtds-convert's sharded checkpoint."""
    import transformers as T
    from safetensors.torch import load_file
    hf, cfg, model = _imported(name, tmp_path / "hf")
    disk = load_file(str(tmp_path / "hf" / "model.safetensors"))
    state = model_to_hf_state(model)
    assert sorted(state) == sorted(disk)
    assert all(torch.equal(state[k], disk[k]) for k in disk), name
    assert model_config_from_hf(hf_config_dict(cfg)) == cfg
    save_hf_checkpoint(cfg, state, str(tmp_path / "back"))
    back = T.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), attn_implementation="eager").eval()
    ids, _ = _ids()
    hf.eval()
    with torch.no_grad():
        assert torch.equal(back(ids).logits, hf(ids).logits), name
    assert model_config_from_hf(back.config) == cfg
    # and through mtds-convert: a checkpoint sharded at t = 2, p = 2 (mtds/checkpoint/shard_spec.py) and back
    from mtds.cli.convert import main as convert
    convert(["hf-to-mtds", "--hf", str(tmp_path / "hf"), "--tp", "2", "--pp", "2", "--out", str(tmp_path / "ck")])
    convert(["mtds-to-hf", "--ckpt", str(tmp_path / "ck"), "--out", str(tmp_path / "conv")])
    converted = load_file(str(tmp_path / "conv" / "model.safetensors"))
    assert sorted(converted) == sorted(disk) and all(torch.equal(converted[k], disk[k]) for k in disk), name
    # as training state it is not resharded (no optimizer state): refused, not done wrong
    from mtds.checkpoint.errors import CheckpointFormatError
    from mtds.checkpoint.universal import ensure_universal
    with pytest.raises(CheckpointFormatError, match="with weights only: mixture-of-experts checkpoints reshard only "
                                                    "between ZeRO-1/2 runs of the same precision"):
        ensure_universal(str(tmp_path / "ck"))


# Training parity: the suite's reference loop (tests/training_helpers.py: mtds's batches of the shipped corpus,
# torch AdamW, 10 clipped steps) on transformers' model of the same config with mtds's initial weights. The
# vocabulary is the shipped tokenizer's; the aux coefficient 0.02 (not 0.001) so the term moves the loss by
# ~2e-3 relative, 200x the tolerance; the peak LR is tests/test_hf_families.py's FAMILY_LR.
TRAIN_LR = 5e-4
FP32_ACC = {"data_types": {"grad_accum_dtype": "fp32"}}     # bf16 through DeepSpeed's BF16_Optimizer
HALF_STEPS = 3      # the 16-bit stage-without-experts runs: every step clipped (norms ~1.5 > 0.5)


def _training_model(name):
    import transformers as T
    from tests.training_helpers import TINY
    cfg = model_config_from_hf(CASES[name](T))
    return dataclasses.replace(cfg, vocab_size=TINY.vocab_size)


def _parity(results, models, what):
    from tests.training_helpers import CLIP, hf_reference, max_rel_diff
    for result, (name, cfg) in zip(results, models):
        ref = hf_reference(cfg, lr=TRAIN_LR)
        loss, norm = max_rel_diff(result.losses, ref.losses), max_rel_diff(result.grad_norms, ref.grad_norms)
        assert loss < REL_TOL and norm < REL_TOL, \
            f"{name} {what}: max rel diff loss {loss:.2e} grad norm {norm:.2e}\n{result.losses}\n{ref.losses}\n" \
            f"{result.grad_norms}\n{ref.grad_norms}"
        assert sum(n > CLIP for n in ref.grad_norms) >= 8, (name, ref.grad_norms)
        print(f"parity {name} {result.layout[:19]}: max rel diff loss {loss:.1e} grad norm {norm:.1e}")


def _eval_body(root):
    """mtds-eval's loss (evaluation: the LM loss, no aux term) of each case, from transformers' files and
    from an mtds checkpoint converted at t = 2 (resharded on load to t = 1), against transformers' eval loss."""
    import os

    from mtds.cli.convert import main as convert
    from mtds.eval import build_eval_model, evaluate
    from mtds.hf.init import hf_model_config
    from mtds.parallel.layout import ParallelLayout
    from mtds.training.distributed import init_distributed
    init_distributed()
    groups = ParallelLayout.for_world(1).build_groups()
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (5, 17, 32)]
    out = {}
    for name in CASES:
        hf = _hf(name).eval()
        hf_dir, ck = os.path.join(root, name, "hf"), os.path.join(root, name, "ck")
        hf.save_pretrained(hf_dir)
        convert(["hf-to-mtds", "--hf", hf_dir, "--tp", "2", "--out", ck])
        with torch.no_grad():
            losses = [hf(torch.tensor([r]), labels=torch.tensor([r])).loss.item() for r in rows]
        want = sum(loss * (len(r) - 1) for loss, r in zip(losses, rows)) / sum(len(r) - 1 for r in rows)
        cfg = hf_model_config(hf_dir)
        for source in ("hf", "ckpt"):
            model = build_eval_model(cfg, groups, **{source: hf_dir if source == "hf" else ck})
            out[(name, source)] = abs(evaluate(model, rows, cfg, groups)["loss"] - want) / want
    return out


def test_eval_matches_transformers(tmp_path):
    """The evaluation path (mtds.eval, as mtds-eval runs it) on one pooled rank."""
    from tests.dist import spawn
    (result,) = spawn(_eval_body, 1, str(tmp_path))
    assert all(err < REL_TOL for err in result.values()), result


def test_training_parity_single_rank(tmp_path):
    """(1,1,1): Mixtral and Qwen3-MoE, loss (LM + aux) and pre-clip grad norm of every step within 1e-5;
    the step log's tokens per expert add up to k x the step's tokens x the MoE blocks (dropless)."""
    import json

    from tests.training_helpers import BATCH, SEQ, run_layouts, train_config
    models = [(name, _training_model(name)) for name in ("mixtral", "qwen3_moe")]
    logs = [str(tmp_path / f"{name}.jsonl") for name, _ in models]
    configs = [train_config(model=cfg, lr=TRAIN_LR, min_lr=TRAIN_LR / 10, log_jsonl=log)
               for (_, cfg), log in zip(models, logs)]
    (results,) = run_layouts(1, configs)
    _parity(results, models, "(1,1,1)")
    for (name, cfg), log in zip(models, logs):
        with open(log) as f:
            records = [r for r in map(json.loads, f) if r["kind"] == "train"]
        blocks = sum(cfg.is_moe_layer(i) for i in range(1, cfg.num_layers + 1))
        assert len(records) == 10
        for r in records:
            assert r["expert_assignments"] == cfg.moe_top_k * BATCH["train_batch_size"] * SEQ * blocks, (name, r)
            mean = r["expert_assignments"] / (blocks * cfg.num_experts)
            assert r["expert_tokens_min"] <= mean <= r["expert_tokens_max"], (name, r)
            assert r["expert_imbalance"] == r["expert_tokens_max"] / mean


def _block_against_t1(name, group, sequence_parallel, **cfg_kw):
    """One MoE block (with its attention) at t = 2 against the same block at t = 1: this rank's output and
    every gradient shard, with the load-balancing loss (router_aux_loss_coef 1) in the loss so the
    router's aux gradient is compared too (and the router z-loss, given ``moe_z_loss_coeff``). The largest
    relative difference."""
    from mtds.model import TransformerLayer
    from mtds.model.aux_loss import collect_aux_loss
    from mtds.model.gpt import moe_blocks
    from mtds.model.shard import shard_of
    from mtds.tp import model_parallel_seed
    import torch.distributed as dist
    cfg = dataclasses.replace(_training_model(name), router_aux_loss_coef=1.0, **cfg_kw)
    layer = next(i for i in range(1, cfg.num_layers + 1) if cfg.is_moe_layer(i))
    t, rank = dist.get_world_size(group), dist.get_rank(group)
    dense = TransformerLayer(cfg, layer, rng_tracker=model_parallel_seed(3, 0)).train()
    split = TransformerLayer(cfg, layer, tp_group=group, rng_tracker=model_parallel_seed(3, rank),
                             sequence_parallel=sequence_parallel).train()
    with torch.no_grad():      # t = 2 from the t = 1 weights (the init is layout independent anyway)
        full = dict(dense.named_parameters())
        for pname, p in split.named_parameters():
            p.copy_(shard_of(full[pname], p, group))
    x = torch.randn(2, 16, cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    w = torch.randn(2, 16, cfg.hidden_size, generator=torch.Generator().manual_seed(6))
    x_split, w_split = (x.chunk(t, dim=1)[rank], w.chunk(t, dim=1)[rank]) if sequence_parallel else (x, w)
    outs = []
    for layer_, inp, weights in ((dense, x, w), (split, x_split.contiguous(), w_split)):
        y = layer_(inp)
        seq = cfg.moe_aux_loss_coeff if cfg.moe_router_load_balancing_type == "seq_aux_loss" else None
        loss = y.mul(weights).sum() + collect_aux_loss(moe_blocks(layer_), cfg.router_aux_loss_coef, True,
                                                       cfg.moe_z_loss_coeff, seq)
        loss.backward()
        outs.append(y)
    want = outs[0].chunk(t, dim=1)[rank] if sequence_parallel else outs[0]
    worst = _rel(outs[1], want)
    # sequence-parallel replicated weights (norms, the router) sum their slices' gradients per use here
    for pname, p in split.named_parameters():
        worst = max(worst, _rel(p.grad, shard_of(full[pname].grad, p, group)))
    return worst


def _split_spec_matches(group):
    """mtds.checkpoint.shard_spec's table (checkpoints, mtds-convert) agrees with the attributes the expert
    tensors carry at t = 2."""
    from mtds.checkpoint.shard_spec import split_of
    cfg = _training_model("qwen3_moe")
    model = GPTModel(cfg, tp_group=group)
    checked = 0
    for layer, module in model.global_layers().items():
        for pname, p in module.named_parameters():
            s = split_of(cfg, layer, pname)
            if getattr(p, "tensor_model_parallel", False):
                assert (s.dim, s.segments) == (p.partition_dim, p.partition_segments), (layer, pname)
                checked += "experts" in pname
            else:
                assert s.dim is None, (layer, pname)
    assert checked == 2, checked


def _hf_import_at_e2(hf_dir) -> float:
    """transformers' Mixtral files loaded at (1,1,2) with e = 2 (each rank reads its 2 of the 4 experts,
    mtds.model.shard.shard_of's expert_rows), evaluated on the same ids on both ranks (the all-to-all without
    autograd): the logits' largest difference from transformers', relative."""
    import transformers as T
    from mtds.eval import build_eval_model
    from mtds.hf.init import hf_model_config
    from mtds.parallel.layout import ParallelLayout
    groups = ParallelLayout(dp=2, ep=2).build_groups()
    cfg = hf_model_config(hf_dir)
    model = build_eval_model(cfg, groups, hf=hf_dir)
    experts = model.layers[0].mlp.experts.gate_up
    assert experts.shape[0] == 2 and experts.expert_rows == (2 * groups.ep_rank, 2 * groups.ep_rank + 2)
    ids, _ = _ids()
    hf = T.AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").float().eval()
    with torch.no_grad():
        return _rel(model(ids)[..., :VOCAB], hf(ids).logits)


def _tp_body(configs, hf_dir, deepspeed_bf16=()):
    """``deepspeed_bf16``: the indices of the configs run with mtds's bf16 reduce-scatter and flat
    bookkeeping switched off (DeepSpeed's BF16_Optimizer as it ships)."""
    import torch.distributed as dist
    import mtds.deepspeed_compat.bf16_flat as bf16_flat
    import mtds.deepspeed_compat.bf16_reduce as bf16_reduce
    from mtds.training import run

    gather, flat_calls = bf16_flat.accumulate_flat, []

    def counted(owner, clear_lp_grads):
        flat_calls[-1] += 1
        gather(owner, clear_lp_grads)

    def run_one(k, cfg):
        bf16_reduce.SCATTER = bf16_flat.FLAT = k not in deepspeed_bf16
        bf16_flat.accumulate_flat, flat_calls[len(flat_calls):] = counted, [0]
        try:
            return run(cfg)
        finally:
            bf16_reduce.SCATTER = bf16_flat.FLAT = True
            bf16_flat.accumulate_flat = gather
    _split_spec_matches(dist.group.WORLD)
    imported = _hf_import_at_e2(hf_dir)
    assert imported < REL_TOL, imported
    blocks = {f"{name} sp={sp}": _block_against_t1(name, dist.group.WORLD, sp)
              for name, sp in (("mixtral", False), ("qwen3_moe", True))}
    # here, not after the runs: TP ranks whose blocks disagree route differently in training and then part
    # ways in the per-expert collectives (a crash, not a number)
    assert all(err < REL_TOL for err in blocks.values()), blocks
    return blocks, [run_one(k, cfg) for k, cfg in enumerate(configs)], flat_calls


def test_tensor_parallel(tmp_path):
    """t = 2 in one spawned 2-rank body: an MoE block (each expert's gate/up column-parallel, down
    row-parallel, all-reduced per expert) against t = 1, without and with sequence parallelism, output and
    every gradient (aux term included); then training parity of Mixtral at (2,1,1) with --recompute full
    (the blocks' router statistics come out of a non-reentrant checkpoint with their gradient), Qwen3-MoE
    at (2,1,1) with --sequence-parallel, and Mixtral at (1,1,2) without and with expert parallelism (e = 2)
    against transformers; both ranks report the same numbers. Before them: transformers' Mixtral files loaded
    at e = 2 (each rank its own experts) give transformers' logits."""
    from tests.dist import spawn
    from tests.training_helpers import ds_config, train_config
    models = [(name, _training_model(name)) for name in ("mixtral", "qwen3_moe")]
    lr = dict(lr=TRAIN_LR, min_lr=TRAIN_LR / 10)
    configs = [train_config(model=models[0][1], tp=2, recompute="full", **lr),
               train_config(model=models[1][1], tp=2, sequence_parallel=True, **lr),
               train_config(model=models[0][1], **lr),    # (1,1,2): each rank's micro-batches, their aux terms
               # e = d = 2: each rank holds 2 of the 4 experts, tokens exchanged by all-to-all
               train_config(model=models[0][1], expert_model_parallel_size=2, deepspeed_config=ds_config(zero=0),
                            trace_comm=True, **lr),
               # bf16 with ZeRO-1 at e = 1 and e = 2 (DeepSpeed's MoE param groups and expert reduction) through
               # DeepSpeed's BF16_Optimizer (fp32 accumulation), e = 2 also with mtds's reduce-scatter and flat
               # bookkeeping off
               *(train_config(model=models[0][1], expert_model_parallel_size=e, trace_comm=e == 2,
                              deepspeed_config=ds_config(zero=1, precision="bf16", **FP32_ACC), **lr) for e in (1, 2, 2))]
    _hf("mixtral").save_pretrained(str(tmp_path))
    per_rank = spawn(_tp_body, 2, configs, str(tmp_path), (6,), timeout=600)
    blocks, results, flat_calls = per_rank[0]
    print("t = 2 blocks against t = 1, max rel diff:", blocks)
    assert all(err < REL_TOL for err in blocks.values()), blocks
    assert [r.layout for r in results] == ["(tp=2, pp=1, dp=1)", "(tp=2, pp=1, dp=1)", "(tp=1, pp=1, dp=2)",
                                           "(tp=1, pp=1, dp=2, ep=2)", "(tp=1, pp=1, dp=2)",
                                           "(tp=1, pp=1, dp=2, ep=2)", "(tp=1, pp=1, dp=2, ep=2)"], [r.layout for r in results]
    _parity(results[:4], models + models[:1] * 2, "(2,1,1) (2,1,1)+sp (1,1,2) (1,1,2)e2")
    # bf16: the e = 1 and e = 2 runs reduce in other orders and dtypes, measured (loss / norm) 8.6e-6 / 3.3e-4 under
    # native (AVX-512) kernels, 1.2e-5 / 3.9e-4 avx2, 6.1e-6 / 1.8e-4 default (docs/testing.md, "16-bit bounds"),
    # held to 5e-5 / 2e-3; an expert reduced over the wrong ranks moves the loss ~3e-4 and a norm without the
    # experts ~4e-3 (docs/moe.md)
    from tests.bounds import same, within
    from tests.training_helpers import max_rel_diff
    e1, e2, ds = results[4:]
    loss, norm = max_rel_diff(e2.losses, e1.losses), max_rel_diff(e2.grad_norms, e1.grad_norms)
    assert all([within("moe.bf16_e2_vs_e1.loss", loss, 5e-5), within("moe.bf16_e2_vs_e1.norm", norm, 2e-3)]), \
        (loss, norm, e1.losses, e2.losses, e1.grad_norms, e2.grad_norms)
    # e = 2 through mtds's bf16 reduce-scatter and flat bookkeeping against DeepSpeed's own BF16_Optimizer MoE
    # path (both switched off):
    # the gradients are summed in the same order (d = 2; the experts' expert-data-parallel group is one rank:
    # the same cast, division by d and copy), so the losses are bit-identical; the norm sums its fp32 squares
    # per partition slice instead of per whole tensor, and the norm kernels' fp32 sums round per CPU: measured
    # 3.8e-7 relative under native kernels, 8.8e-6 avx2, 6.4e-8 default, held to 3e-5 (the losses bit-equal under
    # all three); the experts' norms summed over d instead of their group moves it to 4.0e-3 (and the losses)
    norm = max_rel_diff(e2.grad_norms, ds.grad_norms)
    print("bf16 e = 2 vs e = 1:", max_rel_diff(e2.losses, e1.losses), max_rel_diff(e2.grad_norms, e1.grad_norms),
          "mtds reduce-scatter vs DeepSpeed: grad norm", norm)
    assert all([same("moe.bf16_reduce_scatter_vs_deepspeed.losses", e2.losses, ds.losses),
                within("moe.bf16_reduce_scatter_vs_deepspeed.norm", norm, 3e-5)]), \
        (norm, e2.losses, ds.losses, e2.grad_norms, ds.grad_norms)
    # ... and BF16_Optimizer's bookkeeping on flat buffers (bf16_flat.py) there: one gather per micro-batch
    assert flat_calls[4] == flat_calls[5] > 0 == flat_calls[6], flat_calls
    # ... with no gradient in an all-reduce (those left: the step's flags and norm), the dense group's ring
    # sends = its bf16 parameter all-gather (the experts' expert-data-parallel group is one rank: no traffic)
    for rank in per_rank:
        comm, off = rank[1][5].comm, rank[1][6].comm
        print("bf16 e = 2 comm:", comm, "DeepSpeed:", off)
        assert all(v["bytes"] <= 64 for key, v in comm.items() if key.startswith("all_reduce/")), comm
        assert comm["send/dp"]["bus_bytes"] == comm["all_gather/dp"]["bus_bytes"] > 0, comm
    _assert_all_to_all_bytes([rank[1][3].comm for rank in per_rank], models[0][1])
    assert [(r.losses, r.grad_norms) for r in per_rank[1][1]] == [(r.losses, r.grad_norms) for r in results]


def _assert_all_to_all_bytes(comms, cfg, e=2, d=2):
    """The collective tracer's all-to-all bytes on the EP group in the last step = the formula, summed over
    the group (each rank's share depends on its routing, the sum does not). Per MoE block and micro-batch a
    rank sends its E counts (int64), its N·k rows out and the R rows its experts received back, and in
    backward the same two exchanges reversed: 8E + 4h(2Nk + 2R) bytes; over the e ranks ΣR = e·N·k, so
    e·8E + 16·h·e·N·k."""
    from tests.training_helpers import BATCH, SEQ
    micro = BATCH["train_micro_batch_size_per_gpu"]
    n_tokens, micro_batches = micro * SEQ, BATCH["train_batch_size"] // (micro * d)
    blocks = sum(cfg.is_moe_layer(i) for i in range(1, cfg.num_layers + 1))
    want = blocks * micro_batches * (e * 8 * cfg.num_experts + 16 * cfg.hidden_size * e * n_tokens * cfg.moe_top_k)
    got = [comm["all_to_all/ep"] for comm in comms]
    assert sum(c["bytes"] for c in got) == want and all(c["group_size"] == e for c in got), (got, want)


def test_expert_and_pipeline_parallel_four_ranks(tmp_path):
    """Four layouts on 4 ranks, one after another in the same processes, fp32, 10 clipped AdamW steps against
    transformers:
    - Mixtral (1,1,4) e = 2, ZeRO-1: each expert on two data ranks, its gradient summed over that pair (the
      expert-data-parallel group) and no other rank, its optimizer state partitioned over the pair by
      DeepSpeed's MoE param groups;
    - Qwen3-MoE (2,1,2) e = 2, --sequence-parallel, ZeRO-0: each TP rank exchanges with the same TP rank of its
      EP peer; mtds's clipping norm sums the expert squares over the EP group; DeepSpeed's expert groups
      under the same name as the first run's, with other ranks (the first run released its own);
    - Mixtral (1,2,2) e = 2, ZeRO-1, one MoE block per stage: the router statistics travel with the
      activations from stage to stage and the last stage's loss adds the load-balancing term;
    - Qwen3-MoE (2,2,1) --sequence-parallel --recompute full (the MoE block on stage 0, the dense one on
      stage 1): the statistics pass a stage without MoE blocks and a recomputation (counted once in the step
      log: k x tokens x MoE blocks per step).
    Then checkpoints of the expert-parallel pipeline (docs/moe.md, "Checkpoints at E > 1 on a pipeline"): the
    (1,2,2) run saves at step 8 (and 10) and a fifth run resumes it at step 8: steps 9-10 equal the uninterrupted
    run's losses and grad norms bit for bit; each stage's experts in files of its own model-parallel rank, written
    by the rank holding them; read back as a whole model (mtds-to-hf's reader) its step-10 checkpoint is the
    (1,1,4) run's step-10 checkpoint within 1e-3 (the two layouts reduce in other orders; measured 4e-5, a dense
    weight; a misplaced expert is off by its whole size). Resharded (fp32 ZeRO-1, every stage's partitions
    converted): the step-8 pipeline checkpoint at (1,1,4) E = 4 (steps 9-10), that run's step-9 checkpoint at
    (1,2,2) E = 2 again (step 10), and the Qwen3-MoE (2,2,1) E = 1 run's step-8 checkpoint at (1,1,4) E = 2
    continue the uninterrupted runs within 1e-5. Last, Mixtral (2,2,1) without --sequence-parallel (the stage
    outputs sent whole: DeepSpeed's TP scatter of them stopped at the router statistics' gradient) vs transformers."""
    import json

    from tests.training_helpers import BATCH, SEQ, ds_config, max_rel_diff, run_layouts, train_config
    mixtral, qwen, qwen4 = _training_model("mixtral"), _training_model("qwen3_moe"), _qwen3_moe_four_blocks()
    lr = dict(lr=TRAIN_LR, min_lr=TRAIN_LR / 10)
    half = {p: dict(steps=HALF_STEPS, deepspeed_config=ds_config(zero=1, precision=p, **(FP32_ACC if p == "bf16" else {})), **lr)
            for p in ("bf16", "fp16")}
    log = str(tmp_path / "pp.jsonl")
    pipe = dict(model=mixtral, pp=2, expert_model_parallel_size=2, pipeline_balance="uniform", **lr)
    configs = [train_config(model=mixtral, expert_model_parallel_size=2, deepspeed_config=ds_config(zero=1),
                            save=str(tmp_path / "flat"), save_interval=10, trace_comm=True, **lr),
               train_config(model=qwen, tp=2, sequence_parallel=True, expert_model_parallel_size=2,
                            deepspeed_config=ds_config(zero=0), **lr),
               train_config(**pipe, save=str(tmp_path / "pipe"), save_interval=8),
               train_config(model=qwen, tp=2, pp=2, sequence_parallel=True, recompute="full", log_jsonl=log,
                            save=str(tmp_path / "qwen"), save_interval=8, **lr),
               train_config(**pipe, load=str(tmp_path / "pipe" / "global_step8")),
               # resharded (mtds.checkpoint.reshard_experts, each stage's ZeRO-1 partitions): p 2 -> 1, 1 -> 2
               train_config(model=mixtral, expert_model_parallel_size=4, load=str(tmp_path / "pipe" / "global_step8"),
                            save=str(tmp_path / "e4"), save_interval=9, **lr),
               train_config(**pipe, load=str(tmp_path / "e4" / "global_step9")),
               # a (2,2,1) E = 1 pipeline checkpoint (stage-major model-parallel ranks, stage 1 without experts)
               train_config(model=qwen, expert_model_parallel_size=2, load=str(tmp_path / "qwen" / "global_step8"),
                            **lr),
               # t > 1 and p > 1 without --sequence-parallel: the stage outputs (hidden + router statistics) go
               # whole, not split over the TP ranks (DeepSpeed's scatter refuses a second tensor with a gradient)
               train_config(model=mixtral, tp=2, pp=2, **lr),
               # the default (cost) balancing puts all four blocks on stage 0: stage 1 holds no expert param
               # group and runs the expert groups' norm collectives empty (stage_expert_norms.py)
               train_config(model=qwen4, pp=2, expert_model_parallel_size=2, **lr),
               # the same in bf16 (BF16_Optimizer) and fp16 (ZeRO's), stage 1 holding the two dense blocks
               *(train_config(model=qwen4, pp=2, expert_model_parallel_size=2, pipeline_balance="uniform", **half[p])
                 for p in ("bf16", "fp16"))]
    per_rank = run_layouts(4, configs, force_fp16=True)
    results = per_rank[-1]      # a last-stage rank: the pipelines report their loss there
    assert [r.layout for r in results] == ["(tp=1, pp=1, dp=4, ep=2)", "(tp=2, pp=1, dp=2, ep=2)",
                                           "(tp=1, pp=2, dp=2, ep=2)", "(tp=2, pp=2, dp=1)", "(tp=1, pp=2, dp=2, ep=2)",
                                           "(tp=1, pp=1, dp=4, ep=4)", "(tp=1, pp=2, dp=2, ep=2)",
                                           "(tp=1, pp=1, dp=4, ep=2)", "(tp=2, pp=2, dp=1)",
                                           "(tp=1, pp=2, dp=2, ep=2)", "(tp=1, pp=2, dp=2, ep=2)", "(tp=1, pp=2, dp=2, ep=2)"]
    _parity(results[:4] + results[8:10], [("mixtral", mixtral), ("qwen3_moe", qwen)] * 2 + [("mixtral", mixtral)],
            "(1,1,4)e2 (2,1,2)e2+sp (1,2,2)e2 (2,2,1)+sp (2,2,1)")
    # fp32 ZeRO-1 at E = 2: mtds's reduce-scatter reduces the dense group over d = 4 and the experts' group over
    # their expert-data-parallel pair (DeepSpeed's partitions): no gradient goes through an all-reduce (those
    # left carry the step's flags and norm), and each group's ring sends equal its parameter all-gather,
    # (d-1)/d of its bytes each -- 2Ψ(d-1)/d, where DeepSpeed's MoE path all-reduces (3Ψ(d-1)/d)
    for rank in per_rank:
        comm = rank[0].comm
        assert all(v["bytes"] <= 64 for key, v in comm.items() if key.startswith("all_reduce/")), comm
        for group in ("dp", "other"):       # "other": the expert-data-parallel pair, unnamed by the tracer
            assert comm[f"send/{group}"]["bus_bytes"] == comm[f"all_gather/{group}"]["bus_bytes"] > 0, comm
    assert all([(r.losses, r.grad_norms) for r in other[:2]] == [(r.losses, r.grad_norms) for r in results[:2]]
               for other in per_rank[:-1])
    full, resumed = results[2], results[4]
    assert (resumed.losses, resumed.grad_norms) == (full.losses[8:], full.grad_norms[8:]), (resumed, full)
    _pipeline_checkpoint_placement(str(tmp_path / "pipe" / "global_step8"))
    _same_weights(str(tmp_path / "pipe" / "global_step10"), str(tmp_path / "flat" / "global_step10"), 1e-3)
    for got, want in ((results[5].losses, full.losses[8:]), (results[6].losses, full.losses[9:]),
                      (results[7].losses, results[3].losses[8:])):
        assert len(got) == len(want) and max_rel_diff(got, want) < 1e-5, (got, want)
    with open(log) as f:
        records = [r for r in map(json.loads, f) if r["kind"] == "train"]
    assert [r["expert_assignments"] for r in records] == [qwen.moe_top_k * BATCH["train_batch_size"] * SEQ] * 10
    # any stage layout with E > 1 and ZeRO-1: the (1,2,2) run equals (1,1,1) within 1e-6 (the same sums but the
    # norm's, reduced over stages and ranks in another order: measured 0 / 1.3e-7); every stage clips by it
    last_stage = per_rank[-1][9].layers       # 1..4: the blocks (0 the embedding, 5-6 the final norm and head)
    assert not any(qwen4.is_moe_layer(i) for i in last_stage if 1 <= i <= qwen4.num_layers), last_stage
    ((single, *single_half),) = run_layouts(1, [train_config(model=qwen4, **lr), train_config(model=qwen4, **half["bf16"]),
                                                train_config(model=qwen4, **half["fp16"])], force_fp16=True)
    assert all(rank[9].grad_norms == per_rank[0][9].grad_norms for rank in per_rank)     # both stages' norm
    got = per_rank[-1][9]
    loss, norm = max_rel_diff(got.losses, single.losses), max_rel_diff(got.grad_norms, single.grad_norms)
    assert loss < 1e-6 and norm < 1e-6, (loss, norm, got, single)
    print(f"Qwen3-MoE 4 blocks (1,2,2) E = 2 ZeRO-1, cost balancing, vs (1,1,1): loss {loss:.1e} norm {norm:.1e}")
    for k, p in enumerate(("bf16", "fp16")):
        _half_stage_without_experts(p, qwen4, [rank[10 + k] for rank in per_rank], single_half[k])


def _half_stage_without_experts(precision, qwen4, ranks, single):
    """bf16 (BF16_Optimizer) or fp16 (DeepSpeedZeroOptimizer) ZeRO-1 at (1,2,2) E = 2: stage 1 without MoE blocks
    (blocks 3-4 dense) runs the expert groups' norm collectives empty (stage_expert_norms.py), so both stages clip
    by the same norm, bit for bit; against (1,1,1) in the same precision within the 16-bit bounds of E = 2 against
    E = 1 (moe.bf16_e2_vs_e1, 5e-5 / 2e-3: the runs partition and reduce in other orders, and 16-bit parameters
    round what differs): measured (loss / norm) bf16 7.7e-6 / 6.7e-5 natively, worst of three kernel sets
    1.0e-5 / 2.9e-4; fp16 5.3e-7 / 3.4e-5, worst 1.1e-6 / 3.4e-5 (docs/testing.md). Without the empty group the
    ranks hang in the pipeline group's all-reduce; bf16's stage 1 adding a one instead of a zero to the experts'
    squares (summed into both stages' norms) moves the norm 0.40 off (1,1,1)."""
    from tests.bounds import within
    from tests.training_helpers import max_rel_diff
    got = ranks[-1]
    assert not any(qwen4.is_moe_layer(i) for i in got.layers if 1 <= i <= qwen4.num_layers), got.layers
    assert all(rank.grad_norms == ranks[0].grad_norms for rank in ranks), [rank.grad_norms for rank in ranks]
    loss, norm = max_rel_diff(got.losses, single.losses), max_rel_diff(got.grad_norms, single.grad_norms)
    print(f"{precision} Qwen3-MoE (1,2,2) E = 2 ZeRO-1, stage 1 without experts, vs (1,1,1): loss {loss:.1e} "
          f"norm {norm:.1e}")
    assert all([within(f"moe.{precision}_stage_without_experts.loss", loss, 5e-5),
                within(f"moe.{precision}_stage_without_experts.norm", norm, 2e-3)]), (loss, norm, got, single)


def _qwen3_moe_four_blocks():
    """Qwen3-MoE of four blocks, the last two dense (mlp_only_layers): the cost balancer's split leaves stage 1
    of a two-stage pipeline without MoE blocks."""
    import transformers as T
    from tests.training_helpers import TINY
    hf = T.Qwen3MoeConfig(**{**_shape(num_experts=4, moe_intermediate_size=48, mlp_only_layers=[2, 3], head_dim=32,
                                      norm_topk_prob=False, router_aux_loss_coef=0.02), "num_hidden_layers": 4})
    return dataclasses.replace(model_config_from_hf(hf), vocab_size=TINY.vocab_size)


def _pipeline_checkpoint_placement(tag: str) -> None:
    """(1,2,2) E = 2, 4 experts: ranks 0-1 are stage 0 (model-parallel rank 00), 2-3 stage 1 (01); data rank j
    holds experts 2j, 2j + 1 and writes their files; data rank 0 of each stage its module file (no experts in it)
    and each rank its ZeRO-1 partition."""
    from mtds.checkpoint.complete import rank_manifest
    from mtds.checkpoint.safe_load import safe_load
    expert = "layer_0_expert_{}_mp_rank_{:02d}_model_states.pt".format
    for rank in range(4):
        stage, j = divmod(rank, 2)
        want = [expert(2 * j, stage), expert(2 * j + 1, stage), f"zero_pp_rank_{j}_mp_rank_{stage:02d}_optim_states.pt"]
        want += [f"mp_rank_{stage:02d}_model_states.pt"] if j == 0 else []
        assert sorted(safe_load(rank_manifest(tag, rank))["files"]) == sorted(want), (rank, want)
    module = safe_load(f"{tag}/mp_rank_01_model_states.pt")["module"]
    assert "2.mlp.router.weight" in module and not [k for k in module if ".experts." in k], sorted(module)
    assert sorted(safe_load(f"{tag}/{expert(3, 1)}")) == sorted(
        f"deepspeed_expert_groups.deepspeed_moe.experts.deepspeed_experts.3.2.mlp.experts.{w}"
        for w in ("gate_up", "down"))


def _same_weights(tag: str, flat: str, tol: float) -> None:
    """The pipeline checkpoint ``tag`` read as a whole model (mtds.checkpoint.reader, what mtds-to-hf and mtds-eval
    read) holds the tensors of the (1,1,4) checkpoint ``flat`` within ``tol`` of each tensor's largest value: its
    dense weights as the reader gives them, its experts straight from DeepSpeed's per-expert files (global expert
    G under its own number), so the reader's stacking is checked against DeepSpeed's naming, not itself."""
    import torch
    from mtds.checkpoint.expert_files import STACKED
    from mtds.checkpoint.reader import open_checkpoint
    from mtds.checkpoint.safe_load import safe_load
    theirs = dict(open_checkpoint(flat).layers())
    files = [safe_load(f"{flat}/layer_0_expert_{g}_mp_rank_00_model_states.pt") for g in range(4)]
    worst = {}
    for layer, tensors in open_checkpoint(tag).layers():
        for name, t in tensors.items():
            want = theirs[layer].pop(name)
            if name in STACKED:
                want = torch.stack([f["deepspeed_expert_groups.deepspeed_moe.experts.deepspeed_experts."
                                     f"{g}.layers.{layer - 1}.{name}"] for g, f in enumerate(files)])
            worst[f"{layer}.{name}"] = ((t - want).abs().max() / want.abs().max()).item()
    assert not any(theirs.values()) and max(worst.values()) < tol, (max(worst.values()), worst)


def test_expert_groups_are_deepspeeds():
    """mtds's expert-parallel and expert-data-parallel groups are the ones DeepSpeed's own MoE builds for the
    same (t, p, d, c, e) with an mpu (so DeepSpeed's tools read mtds's expert layout alike)."""
    from deepspeed.utils.groups import _get_expert_parallel_ranks
    from mtds.parallel.layout import ParallelLayout
    # with c > 1 DeepSpeed's data axis is d·c (the mpu's): e folds over data and context parallelism
    for tp, pp, dp, ep, cp in ((1, 1, 4, 2, 1), (2, 1, 4, 2, 1), (2, 2, 4, 4, 1), (1, 2, 8, 2, 1), (1, 1, 2, 2, 2),
                               (2, 1, 2, 4, 2), (1, 2, 1, 2, 4), (1, 1, 4, 8, 2)):
        layout = ParallelLayout(tp=tp, pp=pp, dp=dp, ep=ep, cp=cp)
        theirs = _get_expert_parallel_ranks(layout.world_size, tp, ep, pp)
        assert (sorted(layout.ep_groups()), sorted(layout.expert_dp_groups())) == tuple(map(sorted, theirs)), layout


def test_expert_parallel_refusals():
    """One line each, from the rulebook (mtds.rules, whose own cases are tests/test_rules.py), of the real models'
    facts: e not dividing d or the experts, e on a dense model, what e > 1 does not build yet."""
    from mtds import rules
    from mtds.parallel.layout import LayoutError, ParallelLayout
    from tests.training_helpers import TINY
    mixtral = _training_model("mixtral").facts()       # 4 experts
    with pytest.raises(LayoutError) as e:
        ParallelLayout.for_world(6, ep=4)
    assert "does not divide the data-parallel size 6" in _one_line(e)

    def line(job):
        found = rules.problems(job)
        return found[0].message if found else None
    assert "does not divide the model's 4 experts" in line(rules.Job(mixtral, 6, ep=3))
    assert "needs a mixture-of-experts model" in line(rules.Job(TINY.facts(), 2, ep=2))
    assert line(rules.Job(mixtral, 4, ep=4)) is None
    for precision, zero, needle in (("bf16", 0, "bf16 needs ZeRO-1 or 2"), ("fp16", 0, "fp16 needs ZeRO-1"),
                                    ("fp32", 3, "with ZeRO-3 is not built")):
        assert needle in line(rules.Job(mixtral, 2, ep=2, precision=precision, zero_stage=zero))
    # checkpoints are built at p = 1 (tests/test_moe_checkpoint.py) and on pipelines (the four-rank test)
    for precision, zero in (("fp32", 0), ("fp32", 1), ("bf16", 1), ("fp16", 2)):
        assert line(rules.Job(mixtral, 2, ep=2, precision=precision, zero_stage=zero)) is None
        assert line(rules.Job(mixtral, 4, pp=2, ep=2, precision=precision, zero_stage=min(zero, 1))) is None
    assert line(rules.Job(mixtral, 2, precision="bf16", zero_stage=3)) is None


def _one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert msg and "\n" not in msg
    return msg


@pytest.mark.parametrize("config, needles", [
    (lambda T: T.MixtralConfig(**_shape(num_local_experts=4, router_jitter_noise=0.1)), ("router_jitter_noise",)),
])
def test_unsupported_moe_is_refused(config, needles):
    import transformers as T
    with pytest.raises(UnsupportedHFConfig) as e:
        model_config_from_hf(config(T))
    line = _one_line(e)
    assert all(n in line for n in needles), line


@pytest.mark.parametrize("job, expert_ffn, needle", [
    (dict(world_size=2, tp=2), 97, "expert FFN size 97"),
])
def test_unbuilt_layouts_are_refused(job, expert_ffn, needle):
    """The rulebook, of the real Mixtral's facts: an expert width t does not divide."""
    from mtds import rules
    cfg = dataclasses.replace(_training_model("mixtral"), moe_ffn_hidden_size=expert_ffn)
    found = rules.problems(rules.Job(cfg.facts(), **job))
    assert found and needle in found[0].message and "\n" not in found[0].message, found


@pytest.mark.parametrize("flag, value, words", [
    ("--expert-tensor-parallel-size", "2", "expert TP = TP"),
    ("--moe-pad-expert-input-to-capacity", "1", "not built"),
    ("--moe-shared-expert-intermediate-size", "64", "shared_expert_intermediate_size"),
])
def test_megatron_moe_flags_say_what_is_built(flag, value, words, capsys):
    """Megatron's MoE flags mtds does not take: one error line with what mtds does instead (never silently
    ignored). Megatron's --expert-model-parallel-size, --moe-z-loss-coeff and --moe-expert-capacity-factor
    are train.py's own flags."""
    from mtds.training.cli import build_parser
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["--deepspeed_config", "ds_configs/cpu_fp32.json", flag, value])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and words in err, err


def test_carried_router_statistics():
    """A pipeline's MoE block adds its statistics to the carried (counts, probs) and counts its tokens for the
    step log once: not in a recomputation's replay (flagged by the RNG tracker); the carried aux term equals
    the one-process load_balancing_loss of the same block and is exactly 0 when nothing was routed."""
    from mtds.model import TransformerLayer, router_carry
    from mtds.model.aux_loss import RouterStats, load_balancing_loss
    from mtds.tp import model_parallel_seed
    cfg = _training_model("mixtral")
    tracker = model_parallel_seed(3, 0)
    layer = TransformerLayer(cfg, 1, rng_tracker=tracker, carry_router_stats=True).train()
    x = torch.randn(2, 16, cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    counts, probs = router_carry.start(cfg.num_experts, x.device)
    _, counts, probs = layer((x, counts, probs))
    seen = layer.mlp.tokens_seen.clone()
    assert int(counts[-1]) == 32 and int(counts[:-1].sum()) == 32 * cfg.moe_top_k == int(seen.sum())
    tracker.replaying = True
    layer((x, *router_carry.start(cfg.num_experts, x.device)))
    tracker.replaying = False
    assert torch.equal(layer.mlp.tokens_seen, seen)
    routing = layer.mlp.router(layer.post_attention_norm(x + layer.attention(layer.input_norm(x))).reshape(-1, 64))
    want = load_balancing_loss([RouterStats.of(routing)])
    assert torch.allclose(router_carry.aux_loss(counts, probs, 1.0), want, rtol=1e-6, atol=0)
    assert router_carry.aux_loss(*router_carry.start(cfg.num_experts, x.device), 1.0).item() == 0.0


def _collapsed_router_body():
    """e = 2, every assignment of both ranks to experts 0-1 (rank 0's): rank 1's experts receive no rows. Two
    rounds of dispatch -> experts -> combine -> backward on the same group, then each rank's gradients (tokens,
    routing weights, its experts) against e = 1 on both ranks' tokens."""
    import datetime

    import torch.distributed as dist

    from mtds.model.dispatch import AllToAllDispatcher, LocalDispatcher
    from mtds.model.experts import TensorParallelExperts
    from mtds.model.router import Routing
    rank, (n, k) = dist.get_rank(), (8, 2)
    # a short timeout: a rank left waiting in an exchange its peer skipped fails in seconds, not minutes
    group = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=30))
    cfg = _training_model("mixtral")
    E = cfg.num_experts

    def run(dispatcher, experts, x, w):
        routing = Routing(torch.full((x.shape[0], E), 1 / E), w, torch.tensor([[0, 1]] * x.shape[0]))
        sent = dispatcher.dispatch(x, routing)
        dispatcher.combine(experts(sent.rows, sent.counts), routing, sent, x.shape[0]).square().sum().backward()

    torch.manual_seed(0)
    ep = TensorParallelExperts(cfg, ep_group=group)
    torch.manual_seed(0)
    full = TensorParallelExperts(cfg)
    xs = [torch.randn(n, cfg.hidden_size, generator=torch.Generator().manual_seed(r)) for r in (0, 1)]
    ws = [torch.rand(n, k, generator=torch.Generator().manual_seed(2 + r)) for r in (0, 1)]
    x, w = xs[rank].clone().requires_grad_(), ws[rank].clone().requires_grad_()
    ref_x, ref_w = torch.cat(xs).requires_grad_(), torch.cat(ws).requires_grad_()
    for _ in range(2):
        run(AllToAllDispatcher(E, group), ep, x, w)
        run(LocalDispatcher(E), full, ref_x, ref_w)
    mine = slice(rank * n, (rank + 1) * n)
    got = [x.grad, w.grad] + [torch.zeros_like(p) if p.grad is None else p.grad for p in (ep.gate_up, ep.down)]
    want = [ref_x.grad[mine], ref_w.grad[mine], full.gate_up.grad[2 * rank:2 * rank + 2],
            full.down.grad[2 * rank:2 * rank + 2]]
    return [float((a - b).abs().max() / max(b.abs().max(), 1e-30)) for a, b in zip(got, want)]


def test_collapsed_router_expert_parallel():
    """A collapsed router (every token to one EP rank's experts) at e = 2: the rank that receives no rows
    still runs the backward of both all-to-alls (its experts' empty output stays in the graph of the rows);
    skipping them made its peer's next exchange pair up with the wrong one (gloo: "Received data size
    doesn't match", or garbage split sizes). Gradients equal e = 1's within 1e-6 (the same sums; fp32)."""
    from tests.dist import spawn
    per_rank = spawn(_collapsed_router_body, 2, timeout=120)
    print("collapsed router, e = 2 vs e = 1, max rel diff per rank (tokens, weights, gate_up, down):", per_rank)
    assert all(err < 1e-6 for errs in per_rank for err in errs), per_rank


def test_grouped_gemm_equals_the_loop(monkeypatch):
    """The local experts' grouped GEMM (F.grouped_mm) against the per-expert loop: outputs and gradients
    (rows and both weights) within 1e-6 in fp32 on CPU (bit-equal here), with an expert that got no rows; an expert width whose
    rows are not 16-byte multiples takes the loop."""
    from mtds.model import experts as X
    cfg = dataclasses.replace(_training_model("mixtral"), moe_ffn_hidden_size=48)
    torch.manual_seed(0)
    module = X.TensorParallelExperts(cfg)
    counts = [5, 0, 9, 2]
    rows = torch.randn(sum(counts), cfg.hidden_size, requires_grad=True)
    g = torch.randn(sum(counts), cfg.hidden_size)
    got = {}
    for grouped in (True, False):
        monkeypatch.setitem(X._GROUPED, (rows.device.type, rows.dtype), grouped)
        assert module.grouped(rows) == grouped
        module.zero_grad()
        rows.grad = None
        y = module(rows, counts)
        y.backward(g)
        got[grouped] = [y.detach(), rows.grad.clone(), module.gate_up.grad.clone(), module.down.grad.clone()]
    # bit-equal on this machine (2026-11-26); grouped_mm and F.linear may take other BLAS paths on another CPU,
    # so the test holds a few ulps (a wrong offset or weight moves these by O(1))
    assert all(_rel(a, b) < 1e-6 for a, b in zip(got[True], got[False])), [_rel(a, b) for a, b in zip(*got.values())]
    X._GROUPED.clear()
    odd = X.TensorParallelExperts(dataclasses.replace(cfg, moe_ffn_hidden_size=6))
    assert X.grouped_gemm_works(rows.device, rows.dtype) and not odd.grouped(rows)


def test_config_rules():
    """transformers' layer rule, and MoE fields on a dense model refused rather than ignored."""
    from mtds.model.config import ModelConfig
    base = dict(vocab_size=64, hidden_size=16, num_layers=4, num_heads=2, activation="swiglu", linear_bias=False)
    cfg = ModelConfig(**base, num_experts=4, decoder_sparse_step=2, mlp_only_layers=[3])
    assert [cfg.is_moe_layer(i) for i in range(1, 5)] == [False, True, False, False]
    with pytest.raises(ValueError, match="dense model"):
        ModelConfig(**base, norm_topk_prob=False)
    with pytest.raises(ValueError, match="moe_top_k"):
        ModelConfig(**base, num_experts=2, moe_top_k=3)


def test_model_flops_count_active_experts():
    """TFLOP/s and MFU count the k experts a token visits and the router, not all E experts nor the dense
    width: Mixtral-shaped = the same model with a dense FFN k x the expert width, plus 2·h·E per token and
    block, x 3 (forward and backward)."""
    from mtds.model.config import ModelConfig
    from mtds.observe.metrics import model_config_flops
    shape = dict(vocab_size=256, hidden_size=64, num_layers=4, num_heads=4, activation="swiglu",
                 linear_bias=False, ffn_hidden_size=96)
    moe = ModelConfig(**shape, num_experts=8, moe_top_k=2, mlp_only_layers=[0])
    dense = ModelConfig(**{**shape, "ffn_hidden_size": 2 * 96})
    plain = ModelConfig(**shape)
    batch, seq = 2, 16
    # blocks 2..4 are MoE (k x 96 wide, plus the router), block 1 dense (96 wide)
    want = (3 * model_config_flops(dense, batch, seq) + model_config_flops(plain, batch, seq)) / 4 \
        + 3 * batch * seq * 3 * 2 * 64 * 8
    assert abs(model_config_flops(moe, batch, seq) / want - 1) < 1e-12
