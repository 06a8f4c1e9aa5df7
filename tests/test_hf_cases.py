"""Tiny random HF models (built from configs, never downloaded) shared by the test_hf* files."""
from __future__ import annotations

import torch

VOCAB = 250   # not a multiple of 128 * t for any t: exercises vocab padding


def hf_config(name: str):
    import transformers as T
    common = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=1, pad_token_id=None)
    if name == "gpt2":
        return T.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                            attn_pdrop=0.0, **common)
    if name == "neox":
        return T.GPTNeoXConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                               max_position_embeddings=32, rotary_pct=0.25, rotary_emb_base=10000,
                               use_parallel_residual=True, tie_word_embeddings=False, hidden_act="gelu", **common)
    if name == "neox_seq":   # sequential residual, tanh gelu
        return T.GPTNeoXConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                               max_position_embeddings=32, rotary_pct=0.5, use_parallel_residual=False,
                               tie_word_embeddings=False, hidden_act="gelu_new", **common)
    if name in ("llama", "llama_t4", "llama_tied"):
        heads, kv = {"llama": (4, 2), "llama_t4": (8, 4), "llama_tied": (4, 4)}[name]
        return T.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=heads,
                             num_key_value_heads=kv, intermediate_size=96, max_position_embeddings=32,
                             rope_theta=500.0, tie_word_embeddings=name == "llama_tied", **common)
    if name == "llama_bias":   # biases everywhere, GQA
        return T.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             intermediate_size=96, max_position_embeddings=32, attention_bias=True, mlp_bias=True,
                             tie_word_embeddings=False, **common)
    if name == "gpt2_gelu":    # exact gelu, explicit n_inner, untied head
        return T.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_inner=96, n_positions=32, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0, activation_function="gelu", tie_word_embeddings=False,
                            **common)
    if name == "mixtral":      # 4 experts, top-2, every block MoE
        return T.MixtralConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                               intermediate_size=96, num_local_experts=4, num_experts_per_tok=2,
                               max_position_embeddings=32, **common)
    if name in FAMILIES:
        return FAMILIES[name]()
    raise KeyError(name)


# The dense families of 2026 (tests/test_hf_families.py), one shape for all: hidden 64, 4 heads, 2 kv heads,
# 2 layers; positions up to 64 so a 48-token input reaches past the RoPE scalings' original context (16)
# and past Mistral's short window (8).
FAMILY_SEQ = 48


def _family(cls_name: str, **kw):
    import transformers as T
    shape = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=96, max_position_embeddings=64, rope_theta=500.0, vocab_size=VOCAB,
                 bos_token_id=0, eos_token_id=1, pad_token_id=None)
    return getattr(T, cls_name)(**{**shape, **kw})


FAMILIES = {
    # Llama 3.1's scaling, in transformers 5's spelling
    "llama_rope_llama3": lambda: _family("LlamaConfig", rope_parameters={
        "rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}),
    # position interpolation, in the older rope_scaling spelling; o_proj bias without MLP biases
    "llama_rope_linear": lambda: _family("LlamaConfig", rope_scaling={"type": "linear", "factor": 4.0},
                                         attention_bias=True, mlp_bias=False),
    "llama_rope_yarn": lambda: _family("LlamaConfig", rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}),
    "qwen2": lambda: _family("Qwen2Config"),                                       # q/k/v biases only
    "qwen3": lambda: _family("Qwen3Config", head_dim=32, tie_word_embeddings=True),   # 4 x 32 != 64
    "mistral": lambda: _family("MistralConfig", sliding_window=None),              # full attention
    "mistral_window": lambda: _family("MistralConfig", sliding_window=8),           # the window bites
}


def hf_model(name: str, seed: int = 0):
    """Eval-mode fp32 HF model whose every weight is random (norm weights near 1, biases non-zero),
    so a swapped or mis-permuted tensor cannot hide behind an all-ones/zeros init."""
    import transformers as T
    torch.manual_seed(seed)
    model = T.AutoModelForCausalLM.from_config(hf_config(name), attn_implementation="eager").float().eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname or pname.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    return model


def hf_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def input_ids(batch: int = 2, seq: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def shifted_labels(ids: torch.Tensor) -> torch.Tensor:
    """HF shifts inside the model; mtds takes targets aligned with positions (-100 = ignore)."""
    return torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
