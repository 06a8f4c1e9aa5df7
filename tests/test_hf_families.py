"""The dense families users train in 2026 against transformers (tiny random models, fp32): Llama 3 with
the llama3 / linear / yarn RoPE scalings, Qwen2 (q/k/v biases), Qwen3 (q/k norm, head_dim != h / a),
Mistral (full attention and a window shorter than the sequence).

Logits parity on one process, the export round trip back into transformers, tensor parallelism (t = 2,
with sequence parallelism and selective recomputation) on the pooled ranks, and the one-line refusals
of what is not supported.
"""
import pytest
import torch
import torch.distributed as dist

from mtds.hf import (UnsupportedHFConfig, hf_config_dict, hf_config_from_model_config, load_hf_into_model,
                     model_config_from_hf, model_to_hf_state, save_hf_checkpoint)
from mtds.model import GPTModel
from tests.dist import spawn
from tests.test_hf_cases import FAMILIES, FAMILY_SEQ, VOCAB, hf_model, input_ids

REL_TOL = 1e-5
NAMES = list(FAMILIES)


def _family_ids():
    return input_ids(batch=2, seq=FAMILY_SEQ)


def _imported(name):
    hf = hf_model(name)
    cfg = model_config_from_hf(hf.config)
    model = GPTModel(cfg).eval()
    load_hf_into_model(model, hf.state_dict())
    return hf, cfg, model


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(name):
    from mtds.model.rotary import inv_freq_and_scale
    hf, cfg, model = _imported(name)
    # RoPE as transformers computes it: the same inverse frequencies, bit for bit, and yarn's cos/sin factor
    inv_freq, scale = inv_freq_and_scale(cfg)
    assert torch.equal(inv_freq, hf.model.rotary_emb.inv_freq), name
    assert scale == hf.model.rotary_emb.attention_scaling, name
    ids = _family_ids()
    with torch.no_grad():
        rel = _rel(model.full_logits(ids), hf(ids).logits)
    assert rel < REL_TOL, (name, rel)


def _on_disk(name, hf):
    """transformers' state dict as a checkpoint holds it: no separate copy of a tied head."""
    state = hf.state_dict()
    if hf.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    return state


# config keys that say nothing about the model (bookkeeping, generation defaults)
_NOT_MODEL = {"transformers_version", "architectures", "dtype", "torch_dtype", "_name_or_path", "use_cache",
              "bos_token_id", "eos_token_id", "pad_token_id", "output_attentions", "output_hidden_states",
              "return_dict", "chunk_size_feed_forward", "id2label", "label2id", "problem_type", "tokenizer_class",
              "is_encoder_decoder", "tie_encoder_decoder", "add_cross_attention", "pretraining_tp",
              "layer_types", "max_window_layers", "use_sliding_window"}


def _model_keys(config) -> dict:
    d = {k: v for k, v in config.to_dict().items() if k not in _NOT_MODEL}
    # transformers keeps an old config's "type" beside the "rope_type" it copies it to: one value, two spellings
    d["rope_parameters"] = {k: v for k, v in d["rope_parameters"].items() if k != "type"}
    return d


@pytest.mark.parametrize("name", NAMES)
def test_export_round_trip(tmp_path, name):
    import transformers as T
    hf, cfg, model = _imported(name)
    state = model_to_hf_state(model)
    want = _on_disk(name, hf)
    assert sorted(state) == sorted(want)                     # transformers' key names, no more, no fewer
    assert all(torch.equal(state[k], want[k]) for k in want)  # bit-exact
    assert model_config_from_hf(hf_config_from_model_config(cfg)) == cfg
    # each RoPE spelling alone says the same: transformers 5's rope_parameters, 4.x's rope_scaling + flat keys
    exported = hf_config_dict(cfg)
    for drop in ("rope_scaling", "rope_parameters"):
        alone = {k: v for k, v in exported.items() if k != drop}
        assert model_config_from_hf(alone) == cfg, drop
        assert _model_keys(T.AutoConfig.for_model(**alone)) == _model_keys(hf.config), drop
    save_hf_checkpoint(cfg, state, str(tmp_path))
    back = T.AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").float().eval()
    before, after = _model_keys(hf.config), _model_keys(back.config)
    changed = {k: (before.get(k), after.get(k)) for k in set(before) | set(after) if before.get(k) != after.get(k)}
    assert not changed, (name, changed)
    ids = _family_ids()
    with torch.no_grad():
        assert torch.equal(back(ids).logits, hf(ids).logits), name


def _block_sp_recompute(name, group):
    """One Qwen3 block at t = 2 with sequence parallelism and selective recomputation against the same block
    at t = 1 (HF weights): this rank's output slice and every gradient (the q/k norms' summed over TP)."""
    from mtds.hf import hf_state_to_layers
    from mtds.model import TransformerLayer
    from mtds.model.shard import shard_of
    from mtds.tp import model_parallel_seed
    hf = hf_model(name)
    cfg = model_config_from_hf(hf.config)
    t, rank = dist.get_world_size(group), dist.get_rank(group)
    full = dict(hf_state_to_layers(cfg, hf.state_dict().__getitem__, layers=[1]))[1]
    dense = TransformerLayer(cfg, 1, rng_tracker=model_parallel_seed(3, 0))
    split = TransformerLayer(cfg, 1, tp_group=group, rng_tracker=model_parallel_seed(3, rank), sequence_parallel=True,
                             recompute_attention=True)
    with torch.no_grad():
        for layer in (dense, split):
            for pname, p in layer.named_parameters():
                p.copy_(shard_of(full[pname], p, group if layer is split else None))
    x = torch.randn(2, 16, cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    weights = torch.randn(2, 16, cfg.hidden_size, generator=torch.Generator().manual_seed(6))
    ys = [layer(inp) for layer, inp in ((dense, x), (split, x.chunk(t, dim=1)[rank].contiguous()))]
    ys[0].mul(weights).sum().backward()
    ys[1].mul(weights.chunk(t, dim=1)[rank]).sum().backward()
    err = float((ys[1] - ys[0].chunk(t, dim=1)[rank]).abs().max())
    grads = dict(dense.named_parameters())
    for pname, p in split.named_parameters():
        err = max(err, float((p.grad - shard_of(grads[pname].grad, p, group)).abs().max()))
    return err


def _rank_tp(names):
    from tests.test_hf_parity import compare_case
    group = dist.group.WORLD
    results = {name: compare_case(name, group) for name in names}
    results["qwen3 block sp+recompute"] = _block_sp_recompute("qwen3", group)
    return results


def test_tensor_parallel_qwen2_qwen3():
    """t = 2: logits, loss and every gradient shard equal transformers' (= t = 1): Qwen2's q/k/v bias
    segments, Qwen3's replicated q/k norm (gradient summed over TP) and heads x head_dim != hidden."""
    names = ["qwen2", "qwen3"]
    for results in spawn(_rank_tp, 2, names, timeout=120):
        for name in names:
            r = results[name]
            assert max(r["logits"], r["loss"], r["grad"]) < REL_TOL and r["grads_checked"] == r["n_params"], (name, r)
        assert results["qwen3 block sp+recompute"] < REL_TOL, results


def _one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert msg and "\n" not in msg
    return msg


def _t(cls_name, **kw):
    import transformers as T
    return lambda: getattr(T, cls_name)(**kw)


@pytest.mark.parametrize("make, needles", [
    (lambda: {"model_type": "llama", "rope_scaling": {"type": "dynamic", "factor": 2.0}},
     ("rope_scaling", "'dynamic'", "inference")),
    (_t("LlamaConfig", rope_parameters={"rope_type": "dynamic", "factor": 2.0}), ("rope_parameters", "'dynamic'")),
    (_t("MistralConfig", rope_parameters={"rope_type": "longrope", "short_factor": [1.0] * 64,
                                          "long_factor": [1.0] * 64, "original_max_position_embeddings": 16}),
     ("'longrope'",)),
    (_t("GemmaConfig"), ("'gemma'", "supported: gpt2, gpt_neox, llama, qwen2, qwen3, mistral")),
    (_t("Gemma2Config"), ("'gemma2'", "soft-capping")),
    (_t("PhiConfig"), ("'phi'", "supported:")),
    (_t("Qwen2Config", use_sliding_window=True, sliding_window=8, max_window_layers=0, num_hidden_layers=2),
     ("qwen2", "use_sliding_window", "max_window_layers")),
    (lambda: {"model_type": "qwen3", "use_sliding_window": True, "sliding_window": 8, "num_hidden_layers": 4,
              "max_window_layers": 2}, ("qwen3", "use_sliding_window")),
])
def test_unsupported_families_and_options_are_refused(make, needles):
    with pytest.raises(UnsupportedHFConfig) as e:
        model_config_from_hf(make())
    line = _one_line(e)
    assert all(n in line for n in needles), line


def test_qwen_window_reaching_no_layer_is_full_attention():
    """use_sliding_window with max_window_layers >= the layers: transformers slides on no layer, nor do we."""
    cfg = model_config_from_hf({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8,
                                "num_hidden_layers": 2, "max_window_layers": 2, "hidden_size": 64,
                                "num_attention_heads": 4, "intermediate_size": 96, "vocab_size": VOCAB})
    assert cfg.sliding_window is None and cfg.qkv_bias and not cfg.has_out_proj_bias and not cfg.linear_bias
