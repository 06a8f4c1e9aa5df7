"""Model construction: initial weights independent of t and of which modules are built; TP attributes;
dropout keeps replicated activations identical across TP ranks."""
import dataclasses

import torch
import torch.distributed as dist

from mtds.model.config import ModelConfig

from mtds.hf.resolve import resolve_model_config
from mtds.hf import model_to_layers
from mtds.model import GPTEmbedding, GPTModel, LMHead, TransformerLayer
from tests.dist import spawn

GPT2 = resolve_model_config("gpt2-tiny", hidden_size=64, num_layers=2, vocab_size=250, max_position_embeddings=32)
LLAMA = ModelConfig(vocab_size=250, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=96,
                    position_embedding="rotary", normalization="rmsnorm", activation="swiglu", qkv_bias=False,
                    linear_bias=False, tie_word_embeddings=False, architecture="llama")
NEOX = ModelConfig(vocab_size=250, hidden_size=64, num_layers=2, num_heads=4, position_embedding="rotary",
                   rotary_percent=0.25, parallel_residual=True, tie_word_embeddings=False, activation="gelu",
                   architecture="gpt_neox")
CFGS = {"gpt2": GPT2, "llama": LLAMA, "neox": NEOX}
SEED = 7
IDS = torch.randint(0, 250, (2, 12), generator=torch.Generator().manual_seed(3))


def _rank_build(names):
    group = dist.group.WORLD
    out = {}
    for name in names:
        model = GPTModel(CFGS[name], tp_group=group, seed=SEED).eval()
        for pname, p in model.named_parameters():
            sharded = getattr(p, "tensor_model_parallel", False)
            # A param is sharded exactly when it is a column/row/vocab-parallel weight (or column bias).
            expect = not any(s in pname for s in ("norm", "position_embeddings", "out_proj.bias", "fc_out.bias"))
            assert sharded == expect, (name, pname, sharded)
        with torch.no_grad():
            logits = model.full_logits(IDS)
        # numpy, not tensors: torch tensors cross the result queue via shared memory that dies with the rank.
        layers = model_to_layers(model.cfg, model.global_layers(), group)
        out[name] = {"layers": {i: {n: t.numpy() for n, t in d.items()} for i, d in layers.items()},
                     "logits": logits.numpy()}
    # Training-mode dropout: replicated activations must be dropped identically on every TP rank.
    torch.manual_seed(11)
    cfg = dataclasses.replace(GPT2, hidden_dropout=0.2, attention_dropout=0.2)
    model = GPTModel(cfg, tp_group=group, seed=SEED).train()
    labels = torch.roll(IDS, -1, dims=1)
    loss = model(IDS, labels)
    loss.backward()
    out["dropout_loss"] = float(loss.detach())
    return out


def test_initial_weights_do_not_depend_on_t():
    per_rank = spawn(_rank_build, 2, list(CFGS), timeout=180)
    assert per_rank[0]["dropout_loss"] == per_rank[1]["dropout_loss"]
    for name, cfg in CFGS.items():
        ref = GPTModel(cfg, seed=SEED).eval()
        ref_layers = model_to_layers(cfg, ref.global_layers())
        with torch.no_grad():
            ref_logits = ref.full_logits(IDS)
        for rank in range(2):
            got = per_rank[rank][name]
            assert got["layers"].keys() == ref_layers.keys()
            for index, tensors in ref_layers.items():
                assert got["layers"][index].keys() == tensors.keys(), (name, index)
                for pname, tensor in tensors.items():
                    assert torch.equal(torch.from_numpy(got["layers"][index][pname]), tensor), (name, index, pname)
            assert (torch.from_numpy(got["logits"]) - ref_logits).abs().max() < 1e-5, name


def test_layers_built_alone_match_the_full_model():
    """A pipeline stage builds only some layers: each must still get the weights the full model has."""
    model = GPTModel(LLAMA, seed=SEED)
    alone = TransformerLayer(LLAMA, 2, seed=SEED)
    for (n1, p1), (n2, p2) in zip(model.layers[1].named_parameters(), alone.named_parameters(), strict=True):
        assert n1 == n2 and torch.equal(p1, p2), n1
    assert torch.equal(GPTEmbedding(LLAMA, seed=SEED).word_embeddings.weight, model.embedding.word_embeddings.weight)
    assert torch.equal(LMHead(LLAMA, seed=SEED).weight, model.lm_head.weight)
    assert not torch.equal(model.layers[0].attention.qkv.weight, model.layers[1].attention.qkv.weight)


def test_init_statistics_and_rng_untouched():
    state = torch.get_rng_state()
    model = GPTModel(GPT2, seed=SEED)
    assert torch.equal(state, torch.get_rng_state())           # construction forks the RNG
    layer = model.layers[0]
    std = GPT2.init_std
    assert abs(layer.attention.qkv.weight.std().item() - std) < 0.1 * std
    scaled = std / (2 * GPT2.num_layers) ** 0.5                 # GPT-2's residual-output scaling
    assert abs(layer.mlp.fc_out.weight.std().item() - scaled) < 0.1 * scaled
    assert torch.all(layer.attention.qkv.bias == 0) and torch.all(layer.input_norm.weight == 1)
    emb = model.embedding.word_embeddings.weight
    assert emb.shape[0] == GPT2.padded_vocab_size(1) == 256 and torch.all(emb[250:] == 0)


def test_tied_head_uses_embedding_and_loss_ignores_minus_100():
    model = GPTModel(GPT2, seed=SEED).eval()
    assert model.lm_head is None and GPT2.num_layers + 2 not in model.global_layers()
    labels = torch.roll(IDS, -1, dims=1)
    labels[:, -1] = -100
    with torch.no_grad():
        logits = model.full_logits(IDS)
        want = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 250), labels[:, :-1].reshape(-1))
        assert abs(float(model(IDS, labels)) - float(want)) < 1e-5
