"""ModelConfig validation, presets, resolution from HF configs, and one-line refusals of what we lack."""
import json

import pytest
import transformers as T

from mtds.model.config import PRESETS, ModelConfig

from mtds.hf.resolve import resolve_model_config
from mtds.hf import UnsupportedHFConfig, hf_config_dict, model_config_from_hf
from tests.test_hf_cases import hf_config


def _one_line(excinfo):
    msg = str(excinfo.value)
    assert msg and "\n" not in msg
    return msg


def test_presets_and_derived_sizes():
    tiny = resolve_model_config("gpt2-tiny")
    assert (tiny.vocab_size, tiny.num_layers, tiny.hidden_size, tiny.num_heads) == (8192, 4, 128, 4)
    assert (tiny.head_dim, tiny.kv_heads, tiny.ffn_size) == (32, 4, 512)
    assert tiny.padded_vocab_size(1) == 8192 and tiny.padded_vocab_size(3) == 8448
    xl = PRESETS["gpt2-xl"]
    assert (xl.vocab_size, xl.max_position_embeddings, xl.num_layers, xl.hidden_size) == (50257, 1024, 48, 1600)
    assert xl.padded_vocab_size(1) == 50304
    assert resolve_model_config("gpt2-small", num_layers=2).num_layers == 2


def test_unknown_name_and_bad_values():
    with pytest.raises(ValueError) as e:
        resolve_model_config("gpt5-huge")
    assert "gpt2-tiny" in _one_line(e) and "gpt2-xl" in _one_line(e)
    with pytest.raises(ValueError) as e:
        resolve_model_config("gpt2-tiny", num_layer=3)
    assert "num_layer" in _one_line(e)
    for bad in (dict(hidden_size=100, num_heads=3), dict(num_kv_heads=3), dict(activation="relu"),
                dict(normalization="batchnorm"), dict(position_embedding="rotary", rotary_percent=0.01),
                dict(vocab_size=0), dict(hidden_dropout=1.0)):
        with pytest.raises(ValueError) as e:
            resolve_model_config("gpt2-tiny", **bad)
        _one_line(e)


def test_resolve_from_hf_config_object_dict_file_and_dir(tmp_path):
    hf = hf_config("llama")
    cfg = resolve_model_config(hf)
    assert (cfg.num_heads, cfg.kv_heads, cfg.ffn_size, cfg.rotary_base) == (4, 2, 96, 500.0)
    assert (cfg.normalization, cfg.activation, cfg.tie_word_embeddings, cfg.qkv_bias) == ("rmsnorm", "swiglu",
                                                                                          False, False)
    hf.save_pretrained(tmp_path)
    assert resolve_model_config(str(tmp_path)) == cfg
    assert resolve_model_config(tmp_path / "config.json") == cfg
    assert resolve_model_config(json.loads((tmp_path / "config.json").read_text())) == cfg
    neox = resolve_model_config(hf_config("neox"))
    assert (neox.rotary_percent, neox.parallel_residual, neox.tie_word_embeddings) == (0.25, True, False)
    assert neox.rotary_dim == 4
    gpt2 = resolve_model_config(hf_config("gpt2"))
    assert (gpt2.activation, gpt2.position_embedding, gpt2.tie_word_embeddings) == ("gelu_tanh", "learned", True)


def test_transformers_4_style_flat_keys():
    d = {"model_type": "gpt_neox", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "intermediate_size": 128, "vocab_size": 100, "rotary_pct": 0.5, "rotary_emb_base": 5000,
         "hidden_act": "gelu", "use_parallel_residual": False}
    cfg = model_config_from_hf(d)
    assert (cfg.rotary_percent, cfg.rotary_base, cfg.parallel_residual) == (0.5, 5000.0, False)
    llama = model_config_from_hf({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                                  "num_attention_heads": 4, "intermediate_size": 96, "rope_theta": 1e6,
                                  "rope_scaling": None})
    assert llama.rotary_base == 1e6


@pytest.mark.parametrize("make, needle", [
    (lambda: T.BertConfig(), "supported: gpt2, gpt_neox, llama"),
    (lambda: T.GPTNeoXConfig(rope_scaling={"rope_type": "linear", "factor": 2.0}), "'linear'"),
    (lambda: {"model_type": "llama", "rope_scaling": {"type": "dynamic", "factor": 2.0}}, "'dynamic'"),
    (lambda: T.LlamaConfig(hidden_act="gelu"), "silu"),
    (lambda: {"model_type": "llama", "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    (lambda: T.GPT2Config(activation_function="relu"), "gelu_new"),
    (lambda: T.GPT2Config(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
    (lambda: T.GPTNeoXConfig(hidden_act="relu"), "gelu"),
    (lambda: T.GPTNeoXConfig(attention_bias=False), "attention_bias"),
])
def test_unsupported_hf_options_are_refused(make, needle):
    with pytest.raises(UnsupportedHFConfig) as e:
        model_config_from_hf(make())
    assert needle in _one_line(e)


def test_export_refuses_what_the_architecture_cannot_express():
    cfg = ModelConfig(vocab_size=100, hidden_size=64, num_layers=2, num_heads=4, position_embedding="rotary")
    with pytest.raises(UnsupportedHFConfig) as e:
        hf_config_dict(cfg)                      # architecture gpt2 has learned positions only
    assert "position_embedding" in _one_line(e)
    qwen2_like = ModelConfig(vocab_size=100, hidden_size=64, num_layers=2, num_heads=4, position_embedding="rotary",
                             normalization="rmsnorm", activation="swiglu", qkv_bias=True, linear_bias=False,
                             architecture="llama")   # Llama's attention_bias covers o_proj too
    with pytest.raises(UnsupportedHFConfig) as e:
        hf_config_dict(qwen2_like)
    assert "has_out_proj_bias" in _one_line(e)


def test_new_fields_keep_old_configs_and_metas_the_same():
    """Configs (and mtds_meta.json files) written before kv_channels, out_proj_bias, qk_norm, sliding_window
    and rope scaling existed read as the same model; the overrides are stored only where they differ, so
    replacing the value they override still moves them along."""
    cfg = resolve_model_config(hf_config("llama"))
    old = {k: v for k, v in cfg.to_dict().items()
           if k not in ("kv_channels", "out_proj_bias", "qk_norm", "sliding_window", "rope_scaling",
                        "rope_scaling_params")}
    assert ModelConfig(**old) == cfg
    gpt2 = PRESETS["gpt2-tiny"]
    assert (gpt2.kv_channels, gpt2.out_proj_bias, gpt2.head_dim) == (None, None, 32)
    import dataclasses
    assert not dataclasses.replace(gpt2, linear_bias=False).has_out_proj_bias
    assert dataclasses.replace(gpt2, hidden_size=256).head_dim == 64
    scaled = ModelConfig(vocab_size=100, hidden_size=64, num_layers=2, num_heads=4, kv_channels=32,
                         position_embedding="rotary", rope_scaling="yarn",
                         rope_scaling_params={"factor": 4.0, "original_max_position_embeddings": 16})
    assert ModelConfig(**json.loads(json.dumps(scaled.to_dict()))) == scaled   # the meta's lists of pairs
    assert (scaled.head_dim, scaled.qkv_size) == (32, (4 + 2 * 4) * 32)   # not hidden-wide: 4 heads x 32
