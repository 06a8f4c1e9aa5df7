"""Megatron-core's router options on mtds's MoE (docs/moe.md): the router z-loss (--moe-z-loss-coeff) and the
expert capacity (--moe-expert-capacity-factor, --moe-token-drop-policy). One process: the z-loss against a
by-hand formula on transformers' router logits (value and every gradient), the capacity's dropped
assignments against a by-hand reference of Megatron's policies, the capacity block against dropless. One
2-rank body: both at (1,2,1) and (1,1,2) e = 2 against (1,1,2) e = 1, and the z-loss of one block under
sequence parallelism against t = 1."""
import dataclasses
import math

import torch

from tests.test_moe import _ids, grads_in_hf_names, _imported, _rel, _training_model

Z_COEF = 0.1     # large enough that the z-loss moves every router gradient well past the tolerances


def test_z_loss_matches_by_hand_on_transformers_logits(tmp_path):
    """C · Σ_blocks mean_tokens logsumexp(router logits)² from transformers' own router logits, added to
    transformers' loss (LM + aux): mtds's training loss equals it and every gradient equals autograd's of it
    (1e-5 relative, the suite's HF tolerance); the logged per-block value is the by-hand mean."""
    from mtds.model import GPTModel
    from mtds.model.gpt import moe_blocks
    from mtds.hf import load_hf_into_model
    hf, cfg, _ = _imported("mixtral", tmp_path / "hf")
    cfg = dataclasses.replace(cfg, moe_z_loss_coeff=Z_COEF)
    model = GPTModel(cfg)
    load_hf_into_model(model, str(tmp_path / "hf"))
    ids, labels = _ids()
    hf.train(), model.train()
    out = hf(ids, labels=ids, output_router_logits=True)
    per_block = [torch.logsumexp(logits.float(), dim=-1).square().mean() for logits in out.router_logits]
    z = Z_COEF * sum(per_block)
    want = out.loss + z
    assert z > 0.05 * out.loss, (float(z.detach()), float(out.loss.detach()))      # the term is there to see
    loss = model(ids, labels)
    got = float(loss.detach())
    assert abs(got - float(want.detach())) / float(want.detach()) < 1e-5, (got, float(want.detach()))
    seen = [float(b.z_seen) for b in moe_blocks(model)]
    by_hand = [float(b.detach()) for b in per_block]
    assert all(abs(a - b) / b < 1e-5 for a, b in zip(seen, by_hand)), (seen, by_hand)
    want.backward()
    loss.backward()
    ours, theirs = grads_in_hf_names(model, cfg, hf, tmp_path / "grads")
    worst = max(_rel(ours[k], theirs[k]) for k in theirs)
    assert worst < 1e-5, worst
    # evaluation: no z-loss (Megatron computes it in training only)
    model.eval()
    with torch.no_grad():
        lm = hf.eval()(ids, labels=ids).loss
        assert abs(float(model(ids, labels)) - float(lm)) / float(lm) < 1e-5


SEQ_COEF = 0.1


def test_seq_aux_loss_matches_by_hand_on_transformers_logits(tmp_path):
    """--moe-router-load-balancing-type seq_aux_loss (Megatron-core's sequence_load_balancing_loss_func) in place
    of transformers' aux term: C · Σ_blocks mean_sequences Σ_e f_e P_e, f_e = the sequence's top-k assignments
    to e · E / (s k), P_e = e's softmax probability averaged over the sequence, written here from transformers'
    own router logits ([b·s, E], sequence-major) and added to transformers' LM loss: mtds's training loss equals
    it and every gradient equals autograd's of it (1e-5 relative)."""
    import torch.nn.functional as F
    from mtds.model import GPTModel
    from mtds.hf import load_hf_into_model
    hf, cfg, _ = _imported("mixtral", tmp_path / "hf")
    cfg = dataclasses.replace(cfg, moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=SEQ_COEF)
    model = GPTModel(cfg)
    load_hf_into_model(model, str(tmp_path / "hf"))
    ids, labels = _ids()
    hf.train(), model.train()
    out = hf(ids, output_router_logits=True)
    b, s = ids.shape
    E, k = cfg.num_experts, cfg.moe_top_k
    seq = 0
    for logits in out.router_logits:
        probs = torch.softmax(logits.float(), dim=-1).view(b, s, E)
        chosen = torch.zeros(b, s, E).scatter_(2, probs.topk(k, dim=-1).indices, 1.0)
        seq = seq + (chosen.sum(dim=1) * E / (s * k) * probs.mean(dim=1)).sum(dim=-1).mean()
    lm = F.cross_entropy(out.logits[:, :-1].reshape(-1, out.logits.shape[-1]), ids[:, 1:].reshape(-1))
    want = lm + SEQ_COEF * seq
    assert SEQ_COEF * seq > 0.01 * lm, (float(seq.detach()), float(lm.detach()))      # the term is there to see
    loss = model(ids, labels)
    got = float(loss.detach())
    assert abs(got - float(want.detach())) / float(want.detach()) < 1e-5, (got, float(want.detach()))
    want.backward()
    loss.backward()
    ours, theirs = grads_in_hf_names(model, cfg, hf, tmp_path / "grads")
    worst = max(_rel(ours[name], theirs[name]) for name in theirs)
    assert worst < 1e-5, worst


def test_hf_reference_refuses_the_router_options():
    """The HF reference (the suite's and gpucheck's parity loop) is transformers' dropless model without a
    z-loss: asked for either option it stops in one line instead of comparing against another model."""
    import pytest

    from mtds.gpucheck.hf_reference import hf_with_mtds_weights
    cfg = _training_model("mixtral")
    for kw in (dict(moe_z_loss_coeff=1e-3), dict(moe_expert_capacity_factor=1.25),
               dict(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=1e-2)):
        with pytest.raises(ValueError) as err:
            hf_with_mtds_weights(dataclasses.replace(cfg, **kw), 0)
        assert "\n" not in str(err.value) and "dropless" in str(err.value)


def _by_hand_kept(weights, experts, E, factor, policy, batch):
    """Megatron's drop, element by element: capacity = ceil((N·k / E) · F); per expert its assignments
    ranked by routing weight (probs) or by token in [s, b] order (position), the first `capacity` kept."""
    n, k = experts.shape
    capacity = math.ceil((n * k / E) * factor)
    s = n // batch
    kept = torch.ones(n, k, dtype=torch.bool)
    for e in range(E):
        pairs = [(i, j) for i in range(n) for j in range(k) if experts[i, j] == e]
        if policy == "probs":
            pairs.sort(key=lambda p: -float(weights[p]))
        else:
            pairs.sort(key=lambda p: (p[0] % s, p[0] // s))
        for p in pairs[capacity:]:
            kept[p] = False
    return kept


def test_capacity_drops_what_megatron_drops():
    """On 2 x 12 tokens, 4 experts, top-2: for F in (0.5, 0.75, 1.0) and both policies the dropped
    (token, expert) pairs are exactly the by-hand ones (and some are); no drop when the capacity reaches
    the busiest expert's count."""
    from mtds.model.capacity import expert_capacity, kept_assignments
    g = torch.Generator().manual_seed(0)
    logits = 2 * torch.randn(24, 4, generator=g)
    logits[:, 0] += 1.5      # a busy expert 0, so drops happen at every F below
    weights, experts = torch.topk(torch.softmax(logits, -1), 2, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    dropped = {}
    for factor in (0.5, 0.75, 1.0):
        for policy in ("probs", "position"):
            got = kept_assignments(weights, experts, 4, factor, policy, batch=2)
            want = _by_hand_kept(weights, experts, 4, factor, policy, batch=2)
            assert torch.equal(got, want), (factor, policy, got, want)
            dropped[(factor, policy)] = int((~got).sum())
    busiest = int(torch.bincount(experts.reshape(-1), minlength=4).max())
    assert all(v > 0 for v in dropped.values()), dropped
    # the least F whose capacity holds the busiest expert drops nothing; the capacity one below drops
    factor = busiest / (24 * 2 / 4)
    assert expert_capacity(24, 2, 4, factor) == busiest
    assert bool(kept_assignments(weights, experts, 4, factor, "probs").all())
    print("dropped (F, policy) -> pairs:", dropped, "busiest expert", busiest)


def test_capacity_block_against_dropless():
    """The MoE block with a capacity: its output equals the dropless block's computed with the dropped
    pairs' routing weights zeroed (1e-6); at the least F that drops nothing (capacity = the busiest
    expert's count, < N) it equals the dropless block bit for bit, output and gradients."""
    from mtds.model.moe import MoEBlock
    from mtds.model.router import Routing
    cfg = _training_model("mixtral")
    torch.manual_seed(0)
    dropless = MoEBlock(cfg).train()
    with torch.no_grad():
        dropless.router.weight.mul_(25)     # O(1) logits: an uneven load
    x = torch.randn(2, 16, cfg.hidden_size, generator=torch.Generator().manual_seed(5), requires_grad=True)
    tokens = x.detach().reshape(-1, cfg.hidden_size)
    routing = dropless.router(tokens, batch=2)
    busiest = int(torch.bincount(routing.experts.reshape(-1), minlength=cfg.num_experts).max())
    n = tokens.shape[0]
    assert busiest < n
    least = busiest / (n * cfg.moe_top_k / cfg.num_experts)

    def block(factor):
        b = MoEBlock(dataclasses.replace(cfg, moe_expert_capacity_factor=factor)).train()
        b.load_state_dict(dropless.state_dict())
        return b

    outs = []
    for b in (dropless, block(least)):
        x.grad = None
        y = b(x)
        y.square().sum().backward()
        outs.append([y.detach(), x.grad.clone(), *(p.grad.clone() for p in b.parameters())])
    assert all(torch.equal(a, c) for a, c in zip(*outs)), "no drop must change nothing"
    # F = 0.5: the reference zeroes the dropped pairs' weights and runs the dropless dispatch
    half = block(0.5)
    with torch.no_grad():
        got = half(x)
        r = half.router(tokens, batch=2)
        assert r.kept is not None and int((~r.kept).sum()) > 0
        zeroed = Routing(r.probs, r.weights * r.kept, r.experts)
        sent = half.dispatcher.dispatch(tokens, zeroed)
        want = half.dispatcher.combine(half.experts(sent.rows, sent.counts), zeroed, sent, n).reshape(x.shape)
    assert _rel(got, want) < 1e-6, _rel(got, want)


def _sp_z_value(group, **cfg_kw):
    """The z-loss value of one block under sequence parallelism (each rank routes its slice) against t = 1:
    the mean over the whole sequence on every rank, not over this rank's slice (relative difference); with
    ``cfg_kw`` seq_aux_loss, that block's seq_aux_loss value the same way."""
    import torch.distributed as dist
    from mtds.model.aux_loss import sequence_aux_loss
    from mtds.model.moe import MoEBlock
    cfg = dataclasses.replace(_training_model("qwen3_moe"), moe_z_loss_coeff=Z_COEF, **cfg_kw)
    torch.manual_seed(0)
    dense, split = MoEBlock(cfg).train(), MoEBlock(cfg, tp_group=group, sequence_parallel=True).train()
    with torch.no_grad():
        split.router.weight.copy_(dense.router.weight.mul_(25))   # O(1) logits
    x = torch.randn(2, 16, cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    dense(x), split(x.chunk(dist.get_world_size(group), dim=1)[dist.get_rank(group)].contiguous())
    if cfg_kw:
        return _rel(sequence_aux_loss(split.stats).detach(), sequence_aux_loss(dense.stats).detach())
    return _rel(split.stats.z_mean().detach(), dense.stats.z_mean().detach())


def _two_rank_body(configs):
    import torch.distributed as dist
    from mtds.training import run
    from tests.test_moe import _block_against_t1
    seq = dict(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=SEQ_COEF)
    sp = max(_block_against_t1("qwen3_moe", dist.group.WORLD, True, moe_z_loss_coeff=Z_COEF),
             _sp_z_value(dist.group.WORLD),
             _block_against_t1("qwen3_moe", dist.group.WORLD, True, **seq), _sp_z_value(dist.group.WORLD, **seq))
    return sp, [run(cfg) for cfg in configs]


def test_router_options_across_layouts(tmp_path):
    """Mixtral with the z-loss (C = 0.1) and a capacity (F = 0.5, drops on every micro-batch) for 3 clipped
    AdamW steps at (1,2,1) (the z-loss carried from stage 0's block to the loss on stage 1) and (1,1,2) e = 2
    (each rank routes and drops its own tokens; the experts' rows exchanged) against (1,1,2) e = 1 (whose
    micro-batches are (1,1,1)'s, as test_moe's parity shows): losses and pre-clip grad norms within 1e-6;
    the logged moe_z_loss equal too. Before them, in the same 2-rank body: one Qwen3-MoE block at t = 2 with
    --sequence-parallel against t = 1 with the z-loss in the loss (each rank's slice: the mean over the whole
    sequence), output, every gradient and the block's z-loss value within 1e-5; the same with seq_aux_loss in
    place of transformers' term (each sequence's sums over the slices)."""
    import json

    from tests.dist import spawn
    from tests.training_helpers import ds_config, max_rel_diff, train_config
    from tests.test_moe import TRAIN_LR
    common = dict(model=_training_model("mixtral"), moe_z_loss_coeff=Z_COEF, moe_expert_capacity_factor=0.5,
                  lr=TRAIN_LR, min_lr=TRAIN_LR / 10, steps=3, deepspeed_config=ds_config(zero=0))
    logs = [str(tmp_path / f"{i}.jsonl") for i in range(3)]
    # the pipeline before the expert-parallel run: DeepSpeed keeps the pipeline's mpu (d = 1) in its globals,
    # which creating the expert groups read ("1 is not divisible by 2") until create_expert_groups set its own
    configs = [train_config(log_jsonl=logs[0], **common),
               train_config(pp=2, pipeline_balance="uniform", log_jsonl=logs[1], **common),
               train_config(expert_model_parallel_size=2, log_jsonl=logs[2], **common)]
    per_rank = spawn(_two_rank_body, 2, configs, timeout=300)
    sp, _ = per_rank[0]
    assert sp < 1e-5, sp
    ref, pipe, ep = per_rank[1][1]
    assert [r.layout for r in (ref, pipe, ep)] == ["(tp=1, pp=1, dp=2)", "(tp=1, pp=2, dp=1)",
                                                   "(tp=1, pp=1, dp=2, ep=2)"]
    z = []
    for log in logs:
        with open(log) as f:
            z.append([r["moe_z_loss"] for r in map(json.loads, f) if r["kind"] == "train"])
    diffs = {}
    for name, got, zs in (("pp2", pipe, z[1]), ("ep2", ep, z[2])):
        diffs[name] = (max_rel_diff(got.losses, ref.losses), max_rel_diff(got.grad_norms, ref.grad_norms),
                       max_rel_diff(zs, z[0]))
    print("against (1,1,2) e=1, max rel diff loss / grad norm / moe_z_loss:", diffs, "sp block", sp)
    assert all(d < 1e-6 for d3 in diffs.values() for d in d3), (diffs, ref.losses, pipe.losses, ep.losses)
    assert len(z[0]) == 3 and all(v > 0 for v in z[0]), z
