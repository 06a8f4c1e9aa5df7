"""The MoE families beyond Mixtral / Qwen3-MoE (docs/moe.md) against transformers, fp32: Qwen2-MoE (a shared
expert scaled by sigmoid(shared_expert_gate(x)) beside the routed experts), DeepSeek-V3 (multi-head latent
attention; sigmoid routing with the expert bias, groups, scaling; shared experts; dense first blocks) and GPT-OSS
(attention sinks, alternating windows, biases on attention, router and experts, the clamped quick-GeGLU; its
4-rank part: logits at t = 2, e = 2 and training at (2,1,2) e = 2 with --sequence-parallel only). Per family:
evaluation logits, the training loss (LM + aux) and every gradient in one process; the export round trip bit for
bit (also through mtds-convert at t = 2, p = 2); and one pooled 4-rank body: logits at t = 2 with e = 2 from
transformers' files, then 10 clipped AdamW steps against transformers (loss and pre-clip grad norm within 1e-5)
at (2,1,2) e = 2 with --sequence-parallel and at (2,2,1) with --sequence-parallel; for DeepSeek-V3 also the
aux-loss-free bias update at (2,1,2) e = 2 (ZeRO-1, no sequence parallelism) against transformers trained with
the same update by hand: losses, norms, and the biases after every step bit for bit on every rank; latent
attention at c = 2 (ring and Ulysses, value head dim below and above the query/key one) against c = 1;
Qwen3-MoE at t = 2 + SP, c = 2, e = 2; and Mixtral (aux loss on) at (1,2,1) c = 2 on 1F1B and zb-h1. MoE models with context parallelism at c = 2, d = 1 (Qwen3-MoE's aux loss
over the ring and Ulysses, DeepSeek-V3 over both, with e = 2 and the bias update) in a pooled 2-rank body.

Tolerance 1e-5 relative (fp32): the two sides sum in other orders (TP partial sums, the experts' grouped rows);
measured differences are ~1e-7 (docs/moe.md). Router ties: the one-process checks assert every token's k-th and
(k+1)-th probabilities differ by more than 1e-4 on their batch (tests/test_moe.py's margin)."""
import dataclasses
import functools

import pytest
import torch

from mtds.hf import hf_config_dict, load_hf_into_model, model_config_from_hf, model_to_hf_state
from mtds.model import GPTModel
from tests.test_moe import MARGIN, REL_TOL, TRAIN_LR, VOCAB, _ids, _min_margin, _parity, _rel, _shape, \
    random_moe, train_loss_and_grads_match

CASES = {
    # block 0 MoE (4 experts, top-2, not renormalised, a gated shared expert of width 80), block 1 dense
    "qwen2_moe": lambda T: T.Qwen2MoeConfig(**_shape(num_experts=4, moe_intermediate_size=48,
                                                     shared_expert_intermediate_size=80, mlp_only_layers=[1],
                                                     norm_topk_prob=False, router_aux_loss_coef=0.02)),
}
_DEEPSEEK = dict(num_key_value_heads=4, n_routed_experts=8, moe_intermediate_size=32, n_shared_experts=2,
                 kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, routed_scaling_factor=2.5,
                 num_mtp_layers=0)
_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
         "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
CASES["deepseek_v3"] = lambda T: T.DeepseekV3Config(**{**_shape(), **_DEEPSEEK}, q_lora_rank=24, n_group=4,
                                                    topk_group=2, first_k_dense_replace=1, rope_interleave=True,
                                                    rope_parameters=_YARN)
# no q LoRA, RoPE not interleaved and not scaled, one group (plain top-k), every block MoE
CASES["deepseek_v3_plain"] = lambda T: T.DeepseekV3Config(**{**_shape(), **_DEEPSEEK}, q_lora_rank=None, n_group=1,
                                                          topk_group=1, first_k_dense_replace=0,
                                                          rope_interleave=False, norm_topk_prob=False)
# every block MoE; blocks alternate sliding (window 4 < seq 16) and full attention; sinks; biases on attention,
# router and experts; a clamp of 0.5 that bites on the experts' O(1) pre-activations; YaRN
_GPT_OSS_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
                 "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False}
CASES["gpt_oss"] = lambda T: T.GptOssConfig(**_shape(num_local_experts=4, head_dim=16, sliding_window=4,
                                                     swiglu_limit=0.5, router_aux_loss_coef=0.02),
                                            rope_parameters=_GPT_OSS_YARN)
SEEDS = {"qwen2_moe": 2, "deepseek_v3": 0, "deepseek_v3_plain": 0, "gpt_oss": 2}
BIAS = "e_score_correction_bias"


def _hf(name):
    import transformers as T
    return random_moe(CASES[name](T), SEEDS[name])


@pytest.mark.parametrize("name", list(CASES))
def test_logits_loss_grads_and_export_match_transformers(name, tmp_path):
    """Evaluation logits and LM loss; in training the loss (LM + coef x aux) and every gradient, in
    transformers' names; then transformers' files -> mtds -> export bit for bit (keys, tensors, config),
    directly and through mtds-convert at t = 2, p = 2."""
    from safetensors.torch import load_file
    from mtds.cli.convert import main as convert
    hf = _hf(name)
    hf.save_pretrained(str(tmp_path / "hf"))
    cfg = model_config_from_hf(hf.config)
    model = GPTModel(cfg)
    load_hf_into_model(model, str(tmp_path / "hf"))
    ids, labels = _ids()
    hf.eval(), model.eval()
    with torch.no_grad():
        out = hf(ids, output_router_logits=True)
        if cfg.moe_router_score_function == "softmax":   # sigmoid routing: a flip shows in the logits (0.1 or so)
            assert _min_margin(out.router_logits, cfg.moe_top_k) > MARGIN, name
        assert _rel(model.full_logits(ids), out.logits) < REL_TOL, name
    train_loss_and_grads_match(hf, model, cfg, ids, labels, name, tmp_path, no_grad=(BIAS,))   # a buffer: no grad
    # the round trip
    disk = load_file(str(tmp_path / "hf" / "model.safetensors"))
    state = model_to_hf_state(model)
    assert sorted(state) == sorted(disk) and all(torch.equal(state[k], disk[k]) for k in disk), name
    assert model_config_from_hf(hf_config_dict(cfg)) == cfg
    convert(["hf-to-mtds", "--hf", str(tmp_path / "hf"), "--tp", "2", "--pp", "2", "--out", str(tmp_path / "ck")])
    convert(["mtds-to-hf", "--ckpt", str(tmp_path / "ck"), "--out", str(tmp_path / "conv")])
    converted = load_file(str(tmp_path / "conv" / "model.safetensors"))
    assert sorted(converted) == sorted(disk) and all(torch.equal(converted[k], disk[k]) for k in disk), name


def _training_model(name):
    import transformers as T
    from tests.training_helpers import TINY
    return dataclasses.replace(model_config_from_hf(CASES[name](T)), vocab_size=TINY.vocab_size)


def _logits_at(hf_dir, tp: int, ep: int) -> float:
    """transformers' files loaded at (tp, 1, 4 / tp) with expert parallelism ``ep`` (each rank reads its own
    experts and TP shards), evaluated on the same ids everywhere: the largest relative logit difference."""
    import transformers as T
    from mtds.eval import build_eval_model
    from mtds.hf.init import hf_model_config
    from mtds.parallel.layout import ParallelLayout
    groups = ParallelLayout(tp=tp, dp=4 // tp, ep=ep).build_groups()
    cfg = hf_model_config(hf_dir)
    model = build_eval_model(cfg, groups, hf=hf_dir)
    _split_spec_matches(cfg, model)
    ids, _ = _ids()
    hf = T.AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager").float().eval()
    with torch.no_grad():
        logits = model(ids)
    if tp > 1:      # vocab-parallel logits: gather the TP pieces
        import torch.distributed as dist
        parts = [torch.empty_like(logits) for _ in range(tp)]
        dist.all_gather(parts, logits.contiguous(), group=groups.tp_group)
        logits = torch.cat(parts, dim=-1)
    return _rel(logits[..., :VOCAB], hf(ids).logits)


def _split_spec_matches(cfg, model):
    """mtds.checkpoint.shard_spec's table (checkpoints, mtds-convert, resharding) names every parameter of the
    built model and agrees with the TP attributes its parameters carry."""
    from mtds.checkpoint.shard_spec import layer_names, split_of
    from mtds.model.shard import weights_of
    names, L = layer_names(cfg), cfg.num_layers
    modules = {0: model.embedding, **{i + 1: m for i, m in enumerate(model.layers)}, L + 1: model.final_norm}
    if model.lm_head is not None:
        modules[L + 2] = model.lm_head
    assert sorted(modules) == sorted(names)
    for layer, module in modules.items():
        assert sorted(names[layer]) == sorted(weights_of(module)), layer
        for pname, p in weights_of(module).items():
            s = split_of(cfg, layer, pname)
            if getattr(p, "tensor_model_parallel", False):
                assert (s.dim, s.segments) == (p.partition_dim, p.partition_segments), (layer, pname)
            else:
                assert s.dim is None, (layer, pname)


def _latent_attention_cp2(v_head_dim: int) -> float:
    """Multi-head latent attention at c = 2 (ranks 0-1 and 2-3 each a context-parallel pair), ring and Ulysses,
    against the same module unsplit: this rank's output, its input's gradient and every weight gradient (summed
    over the pair), largest relative difference. ``v_head_dim`` below and above the query/key head dim (24)."""
    import torch.distributed as dist
    from mtds.cp.context import ContextParallel
    from mtds.model.latent_attention import MultiLatentAttention
    from mtds.training.distributed import init_distributed
    init_distributed()      # Ulysses runs DeepSpeed's DistributedAttention, through deepspeed.comm
    rank = dist.get_rank()
    pair = [dist.new_group(g) for g in ([0, 1], [2, 3])][rank // 2]
    cfg = dataclasses.replace(_training_model("deepseek_v3"), v_head_dim=v_head_dim)
    torch.manual_seed(0)
    whole = MultiLatentAttention(cfg)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 16, cfg.hidden_size, generator=g, requires_grad=True)
    w = torch.randn(2, 16, cfg.hidden_size, generator=g)
    y = whole(x)
    y.mul(w).sum().backward()
    worst = 0.0
    for comm in ("p2p", "a2a"):
        ctx = ContextParallel(pair, 2, rank % 2, comm)
        split = MultiLatentAttention(cfg, context=ctx)
        split.load_state_dict(whole.state_dict())
        xs = ctx.split(x.detach()).requires_grad_()
        ys = split(xs)
        ys.mul(ctx.split(w)).sum().backward()
        worst = max(worst, _rel(ys, ctx.split(y.detach())), _rel(xs.grad, ctx.split(x.grad)))
        for (name, p), q in zip(split.named_parameters(), whole.parameters()):
            dist.all_reduce(p.grad, group=pair)
            worst = max(worst, _rel(p.grad, q.grad))
    return worst


def _four_rank_body(hf_dirs, configs, bias_runs):
    """``bias_runs``: the indices of the configs with the bias update, whose biases are recorded after each step."""
    cp = {v: _latent_attention_cp2(v) for v in (12, 32)}
    assert all(err < REL_TOL for err in cp.values()), cp
    logits = {name: _logits_at(d, 2, 2) for name, d in hf_dirs.items()}
    assert all(err < REL_TOL for err in logits.values()), logits
    return (logits, cp), *_runs_recording_biases(configs, bias_runs)


def _runs_recording_biases(configs, bias_runs):
    """Each config's run; for the indices ``bias_runs``, every MoE block's expert bias after each step."""
    import mtds.training.hooks as hooks
    from mtds.training import run
    update, biases = hooks.update_expert_biases, []

    def recorded(blocks, rate, group):
        update(blocks, rate, group)
        biases[-1].append([b.router.e_score_correction_bias.clone() for b in blocks])
    results = []
    for k, cfg in enumerate(configs):
        biases.append([])
        hooks.update_expert_biases = recorded
        try:
            results.append(run(cfg))
        finally:
            hooks.update_expert_biases = update
    return results, [biases[k] for k in bias_runs]


@functools.lru_cache(maxsize=None)     # test_four_ranks and test_context_parallel_two_ranks train the same one
def _reference_with_bias_update(cfg, rate: float):
    """transformers + torch AdamW (the suite's reference loop) with DeepSeek-V3's bias update done by hand:
    each router's choices counted over the step's micro-batches, then after the optimizer step
    bias += rate · sign(mean − load). (losses, grad norms, [per step: [per MoE block: bias]])."""
    from tests.training_helpers import SEED, hf_with_mtds_weights, train_hf
    hf = hf_with_mtds_weights(cfg, SEED)
    routers = [m for m in hf.modules() if type(m).__name__ == "DeepseekV3TopkRouter"]
    loads = [torch.zeros(cfg.num_experts, dtype=torch.float64) for _ in routers]
    history = []

    def count(i):
        def hook(module, args, out):
            loads[i] += torch.bincount(out[2].reshape(-1), minlength=cfg.num_experts).double()
        return hook

    def after_step(optimizer, args, kwargs):
        with torch.no_grad():
            for router, load in zip(routers, loads):
                router.e_score_correction_bias += torch.sign(load.mean() - load).float() * rate
                load.zero_()
        history.append([r.e_score_correction_bias.clone() for r in routers])
    handles = [r.register_forward_hook(count(i)) for i, r in enumerate(routers)]
    from torch.optim.optimizer import register_optimizer_step_post_hook
    handles.append(register_optimizer_step_post_hook(after_step))
    try:
        ref = train_hf(hf, lr=TRAIN_LR)
    finally:
        for h in handles:
            h.remove()
    return ref, history


BIAS_RATE = 1e-2     # Megatron's default is 1e-3; 10 steps of 1e-2 move the choice on this model's O(0.1) scores


def test_four_ranks(tmp_path):
    """One pooled 4-rank body per the module docstring."""
    from tests.dist import spawn
    from tests.training_helpers import ds_config, max_rel_diff, train_config
    names = ["qwen2_moe", "deepseek_v3"]
    lr = dict(lr=TRAIN_LR, min_lr=TRAIN_LR / 10)
    models = [(name, _training_model(name)) for name in names]
    configs = []
    for _, cfg in models:
        configs += [train_config(model=cfg, tp=2, sequence_parallel=True, expert_model_parallel_size=2,
                                 deepspeed_config=ds_config(zero=0), **lr),
                    train_config(model=cfg, tp=2, pp=2, sequence_parallel=True, **lr)]
    deepseek = models[1][1]
    # Qwen3-MoE at t = 2 + SP with c = 2 and e = 2 (each EP pair a context-parallel pair of one TP rank): the
    # statistics summed over the slices, then over the chunks
    from tests.test_moe import _training_model as moe_model
    configs.append(train_config(model=moe_model("qwen3_moe"), tp=2, sequence_parallel=True, context_parallel_size=2,
                                expert_model_parallel_size=2, deepspeed_config=ds_config(zero=1), **lr))
    # Mixtral (aux loss on) at (1,2,1) c = 2, one block per stage: the statistics summed over the pair in each
    # block, carried over the stage boundary, their gradient back through 1F1B's and zb-h1's sends
    mixtral = moe_model("mixtral")
    configs += [train_config(model=mixtral, pp=2, context_parallel_size=2, pipeline_layout="Et|tL",
                             pipeline_schedule=schedule, **lr) for schedule in ("1f1b", "zb-h1")]
    # GPT-OSS at one layout: sinks split with the heads, expert biases split with the experts (e = 2) and over TP
    gpt_oss = _training_model("gpt_oss")
    configs += [train_config(model=gpt_oss, tp=2, sequence_parallel=True, expert_model_parallel_size=2,
                             deepspeed_config=ds_config(zero=0), **lr),
                train_config(model=gpt_oss, tp=2, pp=2, sequence_parallel=True, **lr)]    # sinks on both stages
    # without --sequence-parallel: latent attention's replicated down-projections on the replicated input
    configs.append(train_config(model=deepseek, tp=2, expert_model_parallel_size=2,
                                deepspeed_config=ds_config(zero=1), moe_router_enable_expert_bias=True,
                                moe_router_bias_update_rate=BIAS_RATE, save=str(tmp_path / "ck"), save_interval=5,
                                **lr))
    # resumed at step 5: the biases come back from the checkpoint (a persistent buffer of the module's state)
    configs.append(dataclasses.replace(configs[-1], save=None, load=str(tmp_path / "ck" / "global_step5")))
    hf_dirs = {}
    for name in names + ["gpt_oss"]:
        hf_dirs[name] = str(tmp_path / name)
        _hf(name).save_pretrained(hf_dirs[name])
    per_rank = spawn(_four_rank_body, 4, hf_dirs, configs, [len(configs) - 2, len(configs) - 1], timeout=600)
    (logits, cp), results, _ = per_rank[-1]
    print("logits at (2,1,2) e = 2, max rel diff:", logits, "latent attention c = 2 vs 1 (v head dim):", cp)
    assert [r.layout for r in results[:9]] == ["(tp=2, pp=1, dp=2, ep=2)", "(tp=2, pp=2, dp=1)"] * len(names) + \
        ["(tp=2, pp=1, dp=1, cp=2, ep=2)"] + ["(tp=1, pp=2, dp=1, cp=2)"] * 2 + \
        ["(tp=2, pp=1, dp=2, ep=2)", "(tp=2, pp=2, dp=1)"]
    _parity(results[:9], [m for m in models for _ in range(2)] + [("qwen3_moe", configs[4].model)] +
            [("mixtral", mixtral)] * 2 + [("gpt_oss", gpt_oss)] * 2,
            "(2,1,2)e2+sp (2,2,1)+sp; (2,1,1)c2e2+sp; (1,2,1)c2 1f1b, zb-h1; gpt_oss (2,1,2)e2+sp (2,2,1)+sp")
    # the bias update: the same losses and norms as transformers trained with the update by hand, and after every
    # step the same biases, bit for bit, on every rank and in the reference (integer loads, the same signs)
    ref, history = _reference_with_bias_update(deepseek, BIAS_RATE)
    got, resumed = results[-2:]
    loss, norm = max_rel_diff(got.losses, ref.losses), max_rel_diff(got.grad_norms, ref.grad_norms)
    print(f"bias update (2,1,2)e2: max rel diff loss {loss:.1e} grad norm {norm:.1e}")
    assert loss < REL_TOL and norm < REL_TOL, (loss, norm, got.losses, ref.losses)
    assert len(history) == 10 and history[-1][0].abs().max() > 0
    for rank, (_, _, (biases, biases_resumed)) in enumerate(per_rank):
        assert len(biases) == 10 and len(biases_resumed) == 5, (rank, len(biases), len(biases_resumed))
        for step, (ours, theirs) in enumerate(zip(biases + biases_resumed, history + history[5:])):
            assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True)), (rank, step, ours, theirs)
    assert (resumed.losses, resumed.grad_norms) == (got.losses[5:], got.grad_norms[5:]), (resumed, got)
    # ... and the step-10 checkpoint exported (mtds-to-hf: the expert files joined) holds the step-10 biases
    from safetensors.torch import load_file
    from mtds.cli.convert import main as convert
    convert(["mtds-to-hf", "--ckpt", str(tmp_path / "ck" / "global_step10"), "--out", str(tmp_path / "exported")])
    exported = load_file(str(tmp_path / "exported" / "model.safetensors"))
    keys = sorted(k for k in exported if k.endswith(BIAS))
    assert len(keys) == len(history[-1]) and all(torch.equal(exported[k], b) for k, b in zip(keys, history[-1]))
    # resharding carries parameters and optimizer states, not the bias buffer: another layout is refused
    from mtds.checkpoint.expert_layout import reshard_problem
    from mtds.checkpoint.meta import CheckpointMeta
    from mtds.parallel.layout import ParallelLayout
    problem = reshard_problem(CheckpointMeta.load(str(tmp_path / "ck" / "global_step5")), ParallelLayout(dp=2), 1,
                              "fp32", "ck")
    assert problem and "resharding does not carry yet" in problem and "\n" not in problem, problem
    # the update moved the model off the run without it (a bias that is not used would not)
    assert max_rel_diff(got.losses, results[2].losses) > 1e-4, (got.losses, results[2].losses)


def _moe_block_cp2(z_coef: float = 0.1) -> float:
    """One Qwen3-MoE block (aux coefficient 1, z-loss ``z_coef``) at c = 2 against c = 1 on the same weights:
    the statistics (the aux and z terms of the whole sequence), this rank's output, and the gradients as the
    d·c mean takes them (each rank's output term weighed c, as its LM loss is: the input's gradient / c, the
    weights' summed over the pair / c). Largest relative difference."""
    import torch.distributed as dist
    from mtds.cp.context import ContextParallel
    from mtds.model.aux_loss import collect_aux_loss
    from mtds.model.moe import MoEBlock
    from tests.test_moe import _training_model as moe_model
    group, c = dist.group.WORLD, dist.get_world_size()
    ctx = ContextParallel(group, c, dist.get_rank())
    cfg = dataclasses.replace(moe_model("qwen3_moe"), router_aux_loss_coef=1.0, moe_z_loss_coeff=z_coef)
    torch.manual_seed(0)
    whole, split = MoEBlock(cfg).train(), MoEBlock(cfg, cp_group=group).train()
    with torch.no_grad():
        whole.router.weight.mul_(25)      # O(1) logits
    split.load_state_dict(whole.state_dict())
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 16, cfg.hidden_size, generator=g, requires_grad=True)
    w = torch.randn(2, 16, cfg.hidden_size, generator=g)
    y = whole(x)
    terms = collect_aux_loss([whole], 1.0, True, z_coef)
    (y.mul(w).sum() + terms).backward()
    xs = ctx.split(x.detach()).requires_grad_()
    ys = split(xs)
    split_terms = collect_aux_loss([split], 1.0, True, z_coef)
    (c * ys.mul(ctx.split(w)).sum() + split_terms).backward()
    worst = max(_rel(split_terms.detach(), terms.detach()), _rel(ys, ctx.split(y.detach())),
                _rel(xs.grad / c, ctx.split(x.grad)))
    for p, q in zip(split.parameters(), whole.parameters()):
        dist.all_reduce(p.grad, group=group)
        worst = max(worst, _rel(p.grad / c, q.grad))
    return worst


def _cp_body(configs, bias_runs):
    return _moe_block_cp2(), *_runs_recording_biases(configs, bias_runs)


def test_context_parallel_two_ranks():
    """MoE models at c = 2 (d = 1) against transformers, 10 clipped AdamW steps fp32, loss and pre-clip grad norm
    within 1e-5 (the ring's and the all-to-all's sums in another order; measured ~2e-7): Qwen3-MoE with the aux
    loss (its router statistics summed over the pair before the loss) over the ring (ZeRO-0) and Ulysses
    (ZeRO-1); DeepSeek-V3 (latent attention, sigmoid routing with groups and the bias, shared experts) over
    Ulysses, and over the ring with its 8 experts split over the pair (e = 2: expert parallelism folds over
    d·c, the context-parallel peers exchange tokens) and the aux-loss-free bias update, whose loads are the
    whole sequence's: losses and norms as transformers updated by hand, and the biases after every step bit for
    bit on both ranks. Before them, one Qwen3-MoE block with the aux loss and the router z-loss at c = 2 against
    c = 1 (value, output, gradients within 1e-5)."""
    from tests.dist import spawn
    from tests.test_moe import _training_model as moe_model
    from tests.training_helpers import ds_config, max_rel_diff, train_config
    lr = dict(lr=TRAIN_LR, min_lr=TRAIN_LR / 10)
    qwen, deepseek = moe_model("qwen3_moe"), _training_model("deepseek_v3")
    configs = [train_config(model=qwen, context_parallel_size=2, **lr),
               train_config(model=qwen, context_parallel_size=2, cp_comm_type="a2a",
                            deepspeed_config=ds_config(zero=1), **lr),
               train_config(model=deepseek, context_parallel_size=2, cp_comm_type="a2a", **lr),
               train_config(model=deepseek, context_parallel_size=2, expert_model_parallel_size=2,
                            deepspeed_config=ds_config(zero=1), moe_router_enable_expert_bias=True,
                            moe_router_bias_update_rate=BIAS_RATE, **lr)]
    per_rank = spawn(_cp_body, 2, configs, [3], timeout=600)
    block = max(r[0] for r in per_rank)
    print(f"one MoE block with aux and z-loss, c = 2 against 1: max rel diff {block:.1e}")
    assert block < REL_TOL, block
    per_rank = [r[1:] for r in per_rank]
    results = per_rank[-1][0]
    assert [r.layout for r in results] == ["(tp=1, pp=1, dp=1, cp=2)"] * 3 + ["(tp=1, pp=1, dp=1, cp=2, ep=2)"]
    _parity(results[:3], [("qwen3_moe", qwen)] * 2 + [("deepseek_v3", deepseek)], "c = 2 p2p, a2a; a2a")
    ref, history = _reference_with_bias_update(deepseek, BIAS_RATE)
    got = results[3]
    loss, norm = max_rel_diff(got.losses, ref.losses), max_rel_diff(got.grad_norms, ref.grad_norms)
    print(f"DeepSeek-V3 c = 2 p2p e = 2, bias update: max rel diff loss {loss:.1e} grad norm {norm:.1e}")
    assert loss < REL_TOL and norm < REL_TOL, (loss, norm, got.losses, ref.losses)
    for rank, (_, (biases,)) in enumerate(per_rank):
        assert len(biases) == 10, (rank, len(biases))
        for step, (ours, theirs) in enumerate(zip(biases, history)):
            assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True)), (rank, step, ours, theirs)


def test_shared_expert_flops_and_width_rule():
    """The step log's FLOPs count the shared expert (6·h·f per token, plus the gate's 2·h, x 3 for forward and
    backward) in every MoE block; the rulebook refuses a t that does not divide its width."""
    from mtds import rules
    from mtds.observe.metrics import model_config_flops
    cfg = _training_model("qwen2_moe")
    plain = dataclasses.replace(cfg, moe_shared_expert_intermediate_size=None, moe_shared_expert_gate=False)
    batch, seq, h, blocks = 2, 16, cfg.hidden_size, 1
    extra = model_config_flops(cfg, batch, seq) - model_config_flops(plain, batch, seq)
    assert abs(extra / (3 * batch * seq * blocks * (6 * h * 80 + 2 * h)) - 1) < 1e-9
    odd = dataclasses.replace(cfg, moe_shared_expert_intermediate_size=81)
    found = rules.problems(rules.Job(odd.facts(), 2, tp=2))
    assert found and "does not divide the shared expert FFN size 81" in found[0].message, found


@pytest.mark.parametrize("config, needles", [
    (lambda T: T.DeepseekV3Config(**{**_shape(), **_DEEPSEEK, "num_mtp_layers": 1}),
     ("num_nextn_predict_layers 1", "multi-token prediction")),
    (lambda T: {**T.DeepseekV3Config(**{**_shape(), **_DEEPSEEK}).to_dict(), "scoring_func": "softmax"},
     ("scoring_func 'softmax'",)),
    (lambda T: T.DeepseekV3Config(**{**_shape(), **_DEEPSEEK, "attention_bias": True}), ("attention_bias",)),
    (lambda T: {"model_type": "deepseek_v32"}, ("'deepseek_v32'", "sparse attention indexer")),
    (lambda T: T.Qwen2MoeConfig(**_shape(num_experts=4, use_sliding_window=True, sliding_window=8)),
     ("qwen2_moe", "use_sliding_window")),
    (lambda T: {**CASES["gpt_oss"](T).to_dict(), "quantization_config": {"quant_method": "mxfp4"}},
     ("quantization_config 'mxfp4'", "dequantize")),
    (lambda T: {**CASES["gpt_oss"](T).to_dict(), "swiglu_alpha": 1.0}, ("swiglu_alpha 1.0",)),
    (lambda T: {**CASES["gpt_oss"](T).to_dict(), "num_hidden_layers": 3,
                "layer_types": ["full_attention", "sliding_attention", "sliding_attention"]},
     ("layer_types", "every N-th block full")),
])
def test_unbuilt_configs_are_refused(config, needles):
    """What these families' configs may ask for that mtds does not compute: one line naming it."""
    import transformers as T
    from mtds.hf import UnsupportedHFConfig
    with pytest.raises(UnsupportedHFConfig) as e:
        model_config_from_hf(config(T))
    line = str(e.value)
    assert "\n" not in line and all(n in line for n in needles), line


def test_router_flags_and_latent_attention_rules(capsys):
    """The bias update asks for a router with a bias; DeepSeek-V3 with context parallelism and experts split over
    the context-parallel pair is taken (trained in the 4-rank body);
    Megatron's latent-attention and DeepSeek routing flags say where the sizes come from."""
    from mtds import rules
    from mtds.training.cli import build_parser
    qwen, deepseek = _training_model("qwen2_moe"), _training_model("deepseek_v3")
    found = rules.problems(rules.Job(qwen.facts(), 2, moe_bias_update=True))
    assert found and "needs a router with an expert bias" in found[0].message, found
    assert not rules.problems(rules.Job(deepseek.facts(), 2, moe_bias_update=True))
    assert not rules.problems(rules.Job(deepseek.facts(), 2, cp=2, ep=2, seq_length=32))    # trained in the body
    for flag, words in (("--q-lora-rank", "q_lora_rank"), ("--moe-router-num-groups", "n_group")):
        with pytest.raises(SystemExit) as exit_:
            build_parser().parse_args(["--deepspeed_config", "ds_configs/cpu_fp32.json", flag, "4"])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.count("\n") == 1 and words in err, err


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v3_plain"])
def test_latent_attention_flops_are_counted(name):
    """The step log's FLOPs of multi-head latent attention (mtds.observe.metrics.latent_attention_flops) equal
    torch's own count of the module's matmuls (FlopCounterMode: projections and the attention kernel)."""
    from torch.utils.flop_counter import FlopCounterMode
    from mtds.model.latent_attention import MultiLatentAttention
    from mtds.observe.metrics import latent_attention_flops
    cfg = _training_model(name)
    attention, x = MultiLatentAttention(cfg), torch.randn(2, 16, cfg.hidden_size)
    with FlopCounterMode(display=False) as counter:
        attention(x)
    projections, core = latent_attention_flops(cfg, 16)
    assert counter.get_total_flops() == 2 * 16 * (projections + core), (counter.get_total_flops(), projections, core)


def test_expert_bias_stays_float32():
    """The expert bias is kept in float32 when the model is cast to bf16 (a 1e-3 step would vanish in bf16),
    and follows the model's device."""
    model = GPTModel(_training_model("deepseek_v3")).bfloat16()
    from mtds.model.gpt import moe_blocks
    blocks = moe_blocks(model)
    assert blocks and all(b.router.e_score_correction_bias.dtype == torch.float32 for b in blocks)
    assert all(b.router.weight.dtype == torch.bfloat16 for b in blocks)


def test_deepseek_mtp_layer_weights_are_skipped():
    """DeepSeek-V3's files keep the multi-token prediction layer as model.layers.61: with
    num_nextn_predict_layers 0 it is skipped on load, as transformers skips it; other stray keys are refused."""
    from mtds.hf import UnsupportedHFConfig
    cfg = model_config_from_hf(CASES["deepseek_v3_plain"](__import__("transformers")))
    state = model_to_hf_state(GPTModel(cfg, seed=3))
    load_hf_into_model(GPTModel(cfg), {**state, "model.layers.61.eh_proj.weight": torch.zeros(2, 2)})
    with pytest.raises(UnsupportedHFConfig, match="have no place"):
        load_hf_into_model(GPTModel(cfg), {**state, "model.layers.5.eh_proj.weight": torch.zeros(2, 2)})


def test_latent_attention_documents_and_recompute():
    """Latent attention with packed documents (positions and mask reset at each document) gives each document
    what it gives alone (RoPE is shift-invariant, so with the mask reset this holds the mask, not the positions);
    selective recomputation of its core gives the same output and gradients."""
    from mtds.model.documents import DocumentMasking
    from mtds.model.latent_attention import MultiLatentAttention
    cfg = _training_model("deepseek_v3")
    torch.manual_seed(0)
    plain = MultiLatentAttention(cfg)
    packed = MultiLatentAttention(cfg, documents=DocumentMasking(0, reset_position_ids=True,
                                                                 reset_attention_mask=True))
    recomputed = MultiLatentAttention(cfg, recompute_core=True)
    for other in (packed, recomputed):
        other.load_state_dict(plain.state_dict())
    x = torch.randn(1, 16, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    segments = torch.tensor([[0] * 6 + [1] * 10])
    with torch.no_grad():
        together = packed(x, segments)
        alone = torch.cat([plain(x[:, :6]), plain(x[:, 6:])], dim=1)
    assert _rel(together, alone) < REL_TOL
    plain.train(), recomputed.train()
    outs = []
    for module in (plain, recomputed):
        y = module(x)
        y.square().sum().backward()
        outs.append((y.detach(), [p.grad for p in module.parameters()]))
    assert torch.equal(outs[0][0], outs[1][0])
    assert all(torch.equal(a, b) for a, b in zip(outs[0][1], outs[1][1]))
