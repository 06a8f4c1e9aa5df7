"""The work of the peer comparison (issue 21), spelled once for mtds's side of it.

Same job as ``../shared/tools/peers`` runs on Megatron-core and torchtitan: 4 layers, hidden 256, 4 heads,
vocabulary 8192, sequence 256, micro-batch 4, fp32, AdamW(1e-3, (0.9, 0.95), 1e-8, wd 0.1), clipping 1.0,
constant learning rate, no dropout. The two model configs are HF ``config.json`` contents, so mtds reads
them exactly as ``train.py --model config.json`` would.
"""
from __future__ import annotations

import json
import os

MICRO_BATCH, SEQ = 4, 256

MODELS = {
    "gpt2": {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_layer": 4, "n_embd": 256, "n_head": 4,
             "n_inner": None, "vocab_size": 8192, "n_positions": 256, "activation_function": "gelu_new",
             "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "layer_norm_epsilon": 1e-05,
             "tie_word_embeddings": True, "bos_token_id": 0, "eos_token_id": 0},
    "llama": {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 8192, "hidden_size": 256,
              "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
              "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
              "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "hidden_act": "silu"},
}
# The peer that runs each model: Megatron-core GPT-2, torchtitan Llama-3.
PEER_OF = {"gpt2": "megatron", "llama": "torchtitan"}


def write_model_config(model: str, directory: str) -> str:
    """``directory/<model>/config.json``; its path (what TrainConfig.model / --model take)."""
    path = os.path.join(directory, model, "config.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(MODELS[model], f, indent=2)
    return path


def ds_config(microbatches: int = 1) -> dict:
    return {"train_batch_size": MICRO_BATCH * microbatches, "train_micro_batch_size_per_gpu": MICRO_BATCH,
            "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                                      "weight_decay": 0.1, "torch_adam": True}},
            "zero_optimization": {"stage": 1}, "steps_per_print": 10 ** 9}
