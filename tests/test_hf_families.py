"""The dense families users train in 2026 against transformers (tiny random models, fp32): Llama 3 with
the llama3 / linear / yarn RoPE scalings, Qwen2 (q/k/v biases), Qwen3 (q/k norm, head_dim != h / a),
Mistral (full attention and a window shorter than the sequence).

Logits parity on one process, the export round trip back into transformers, tensor parallelism (t = 2,
with sequence parallelism and selective recomputation) on the pooled ranks, training parity of each
family at a multi-rank layout (10 clipped AdamW steps against transformers' model + torch AdamW), and
the one-line refusals of what is not supported.
"""
import pytest
import torch
import torch.distributed as dist

from mtds.hf import (UnsupportedHFConfig, hf_config_dict, hf_config_from_model_config, load_hf_into_model,
                     model_config_from_hf, model_to_hf_state, save_hf_checkpoint)
from mtds.model import GPTModel
from tests.dist import spawn
from tests.test_hf_cases import FAMILIES, FAMILY_SEQ, VOCAB, hf_config, hf_model, input_ids

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


def _universal_categories(ds_param: str, info: dict) -> tuple:
    import re

    def hit(patterns) -> bool:   # DeepSpeed matches with re.match
        return any(re.match(p, ds_param) for p in patterns)
    return (hit(info["tp_replicated_parameter_patterns"]), hit(info["parameter_with_row_parallelism_patterns"]),
            hit([p for sub in info["parameter_with_sub_params"] for p in sub["patterns"]]),
            hit(info["vocabulary_parameter_patterns"]))


@pytest.mark.parametrize("name", NAMES)
def test_convert_round_trip_and_init_from_hf(tmp_path, name):
    """mtds-convert hf-to-mtds at (t, p) = (2, 2), then mtds-to-hf: every tensor bit-exact and a config.json
    transformers reads as the same model (equal logits); --init-from-hf's loader, the model resolved from
    the directory as train.py does without --model, gives transformers' logits; and DeepSpeed's universal
    checkpoint patterns (resharding on --load) put each parameter, in both module namings, in the class
    of its tensor-parallel split (a q/k norm or a row-parallel weight concatenated as a column shard would
    reload wrong weights)."""
    import json
    import os
    import types

    import transformers as T
    from safetensors.torch import load_file

    from mtds.checkpoint.names import ds_name
    from mtds.checkpoint.shard_spec import layer_names, split_of
    from mtds.checkpoint.universal import universal_info
    from mtds.cli.convert import main as convert
    from mtds.hf import resolve_model_config
    from mtds.hf.init import load_hf_into_stages
    hf = hf_model(name)
    hf_dir, ckpt, back = (str(tmp_path / d) for d in ("hf", "ck", "back"))
    hf.save_pretrained(hf_dir)
    convert(["hf-to-mtds", "--hf", hf_dir, "--tp", "2", "--pp", "2", "--out", ckpt])
    convert(["mtds-to-hf", "--ckpt", ckpt, "--out", back])
    original, exported = (load_file(os.path.join(d, "model.safetensors")) for d in (hf_dir, back))
    assert sorted(exported) == sorted(original)
    assert all(torch.equal(exported[k], original[k]) for k in original), name
    with open(os.path.join(back, "config.json")) as f:
        assert model_config_from_hf(json.load(f)) == model_config_from_hf(hf.config)
    ids = _family_ids()
    again = T.AutoModelForCausalLM.from_pretrained(back, attn_implementation="eager").eval()
    with torch.no_grad():
        want = hf(ids).logits
        assert torch.equal(again(ids).logits, want), name

    cfg = resolve_model_config(hf_dir)
    model = GPTModel(cfg, seed=1).eval()
    load_hf_into_stages(model, hf_dir, cfg, types.SimpleNamespace(tp_group=None))
    with torch.no_grad():
        assert _rel(model.full_logits(ids), want) < REL_TOL, name

    info = universal_info(cfg, 2)
    for layer, names in layer_names(cfg).items():
        for pname in names:
            s = split_of(cfg, layer, pname)
            for pipeline in (True, False):
                ds_param = ds_name(cfg, layer, pname, pipeline)
                assert _universal_categories(ds_param, info) == (
                    s.dim is None, s.dim == 1, s.segments is not None, s.vocab), (name, ds_param)


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


# Training parity: each family at one multi-rank layout, 10 clipped fp32 AdamW steps, loss and pre-clip grad
# norm of every step within REL_TOL of transformers' model of that family (the same config, mtds's initial
# weights) trained by the suite's reference loop (tests/training_helpers.py: torch AdamW, mtds's batches).
# The families' shapes (hidden 64, 4 heads, 2 kv heads, Qwen3's head_dim 32, Mistral's window 8 < SEQ, the
# RoPE scalings' original context 16 < SEQ) with the training suite's vocabulary and 4 blocks.
#
# The peak LR is 5e-4, not the suite's 2e-3: at 2e-3 these models' 10-step trajectories are chaotic enough that
# transformers against itself, its initial weights scaled by (1 + 1e-7 N(0, 1)), differs by up to 4e-4 in the
# grad norm (Qwen3; Qwen2 5e-5, Llama 3 2e-5; GPT-2 TINY 1e-7), so no implementation could hold 1e-5. At
# 5e-4 that spread is at most 3.5e-7 for every family, and the loss still falls by 0.13-0.19 in the 10 steps.
FAMILY_LR = 5e-4
# (family, (t, p, d), TrainConfig switches): together every pipeline schedule, sequence parallelism, both
# recompute granularities and ZeRO-1 data parallelism, on 4 ranks
FAMILY_LAYOUTS = [
    ("qwen3", (2, 2, 1), dict(sequence_parallel=True, pipeline_schedule="interleaved", virtual_stages=2)),
    ("qwen2", (2, 1, 2), {}),
    ("llama_rope_llama3", (1, 2, 2), dict(recompute="selective")),
    ("llama_rope_yarn", (2, 2, 1), dict(recompute="full")),
    ("mistral_window", (2, 2, 1), dict(sequence_parallel=True, pipeline_schedule="zb-h1")),
    ("mistral_window", (2, 2, 1), dict(pipeline_schedule="dualpipev")),
]


def family_training_config(name):
    import dataclasses

    from tests.training_helpers import TINY
    return dataclasses.replace(model_config_from_hf(hf_config(name)), vocab_size=TINY.vocab_size,
                               num_layers=TINY.num_layers)


def _documents_configs(tmp_path, model):
    """Mistral's window inside packed documents through the trainer: --reset-position-ids and
    --reset-attention-mask at (2,2,1) with sequence parallelism against (1,1,4), whose ranks each run
    whole micro-batches on one stage (tests/test_documents.py holds that model to HF document by
    document, the window and the document mask combined)."""
    from tests.test_parity import _short_documents
    from tests.training_helpers import train_config
    prefix = str(tmp_path / "docs")
    _short_documents(prefix)          # documents of 2..12 tokens: the window of 8 bites in the longer ones
    docs = dict(model=model, data_path=(prefix,), steps=3, reset_position_ids=True, reset_attention_mask=True,
                lr=FAMILY_LR, min_lr=FAMILY_LR / 10)
    return [train_config(**docs), train_config(tp=2, pp=2, sequence_parallel=True, **docs)]


def test_training_parity_of_each_family_at_a_multi_rank_layout(tmp_path):
    """FAMILY_LAYOUTS against transformers + torch AdamW, and Mistral's window with packed documents, in one
    pooled 4-rank body."""
    from tests.training_helpers import CLIP, SEQ, hf_reference, max_rel_diff, run_layouts, train_config
    models = {name: family_training_config(name) for name, _, _ in FAMILY_LAYOUTS}
    assert models["mistral_window"].sliding_window < SEQ and models["qwen3"].head_dim * 4 != 64
    configs = [train_config(model=models[name], tp=t, pp=p, lr=FAMILY_LR, min_lr=FAMILY_LR / 10, **switches)
               for name, (t, p, _), switches in FAMILY_LAYOUTS]
    configs += _documents_configs(tmp_path, models["mistral_window"])
    per_rank = run_layouts(4, configs)
    results = per_rank[0]
    for index, ((name, layout, switches), result) in enumerate(zip(FAMILY_LAYOUTS, results)):
        what = f"{name} {layout} {switches}"
        assert result.layout.startswith("(tp={}, pp={}, dp={}".format(*layout)), (what, result.layout)
        ref = hf_reference(models[name], lr=FAMILY_LR)
        loss, norm = max_rel_diff(result.losses, ref.losses), max_rel_diff(result.grad_norms, ref.grad_norms)
        assert loss < REL_TOL and norm < REL_TOL, \
            f"{what}: max rel diff loss {loss:.2e} grad norm {norm:.2e}\n{result.losses}\n{ref.losses}\n" \
            f"{result.grad_norms}\n{ref.grad_norms}"
        assert sum(n > CLIP for n in ref.grad_norms) >= 8, (what, ref.grad_norms)     # clipped steps
        for other in per_rank[1:]:
            assert other[index].losses == result.losses and other[index].grad_norms == result.grad_norms, what
    dp, packed = results[len(FAMILY_LAYOUTS):]
    assert dp.layout.startswith("(tp=1, pp=1, dp=4") and packed.layout.startswith("(tp=2, pp=2, dp=1")
    loss, norm = max_rel_diff(packed.losses, dp.losses), max_rel_diff(packed.grad_norms, dp.grad_norms)
    assert loss < REL_TOL and norm < REL_TOL, ("mistral window + documents", packed.losses, dp.losses)


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
