"""The checkpoint reader's list of every layer's parameters (mtds.checkpoint.shard_spec.layer_names, derived from the
ModelConfig alone so that mtds checkpoints load without the HF tables) is the list a real model holds,
and the one each HF weight table maps, for every architecture switch the config has."""
import dataclasses

import pytest

from mtds.model.config import ModelConfig
from mtds.hf.registry import weight_table
from mtds.hf.table import rows_by_layer
from mtds.model import GPTModel
from mtds.checkpoint.shard_spec import layer_names, split_of

GPT2 = ModelConfig(vocab_size=64, hidden_size=16, num_layers=2, num_heads=2, max_position_embeddings=8)
NEOX = dataclasses.replace(GPT2, architecture="gpt_neox", position_embedding="rotary", rotary_percent=0.25,
                           parallel_residual=True, tie_word_embeddings=False, activation="gelu")
LLAMA = dataclasses.replace(GPT2, architecture="llama", position_embedding="rotary", normalization="rmsnorm",
                            activation="swiglu", qkv_bias=False, linear_bias=False, num_kv_heads=1,
                            tie_word_embeddings=False, ffn_hidden_size=24)
QWEN_LIKE = dataclasses.replace(LLAMA, qkv_bias=True, tie_word_embeddings=True)   # bias on QKV only
QWEN2 = dataclasses.replace(QWEN_LIKE, architecture="qwen2")
QWEN3 = dataclasses.replace(LLAMA, architecture="qwen3", qk_norm=True, kv_channels=16)   # 2 heads x 16 != 16
LLAMA_ATTN_BIAS = dataclasses.replace(LLAMA, qkv_bias=True, out_proj_bias=True)          # o_proj bias, none in the MLP
MISTRAL = dataclasses.replace(LLAMA, architecture="mistral", sliding_window=4)


@pytest.mark.parametrize("cfg", [GPT2, NEOX, LLAMA, QWEN_LIKE, QWEN3, LLAMA_ATTN_BIAS],
                         ids=["gpt2", "neox", "llama", "qkv-bias-only", "qwen3", "llama-attention-bias"])
def test_layer_names_are_the_parameters_the_model_holds(cfg):
    model = GPTModel(cfg)
    held = {layer: [name for name, _ in module.named_parameters()] for layer, module in model.global_layers().items()}
    assert layer_names(cfg) == held
    # and the split the checkpoint table gives each is the one the tp layers put on it
    for layer, module in model.global_layers().items():
        for name, p in module.named_parameters():
            sharded = getattr(p, "tensor_model_parallel", False)
            assert split_of(cfg, layer, name).dim == (p.partition_dim if sharded else None), (layer, name)


@pytest.mark.parametrize("cfg", [GPT2, NEOX, LLAMA, QWEN2, QWEN3, LLAMA_ATTN_BIAS, MISTRAL],
                         ids=["gpt2", "neox", "llama", "qwen2", "qwen3", "llama-attention-bias", "mistral"])
def test_layer_names_are_what_the_hf_tables_map(cfg):
    mapped = {layer: sorted(row.name for row in rows) for layer, rows in rows_by_layer(weight_table(cfg)).items()}
    assert {layer: sorted(names) for layer, names in layer_names(cfg).items()} == mapped
