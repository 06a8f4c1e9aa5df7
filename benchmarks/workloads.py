"""The benchmarked shape, spelled once for both sides (mtds and HuggingFace).

A ``Shape`` is the GPT of the issue: l layers, hidden h, a heads, vocabulary V, sequence s, micro
batch b. Both sides train it in fp32 with AdamW(lr 1e-3, betas (0.9, 0.95), eps 1e-8, weight decay
0.1 on every parameter) and gradient clipping at 1.0 — the settings of ds_configs/cpu_fp32.json.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

ADAMW = {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
CLIP = 1.0


@dataclass(frozen=True)
class Shape:
    layers: int = 4
    hidden: int = 256
    heads: int = 4
    vocab: int = 8192
    seq: int = 256
    micro_batch: int = 4

    @property
    def tokens_per_micro_batch(self) -> int:
        return self.micro_batch * self.seq

    def as_dict(self) -> dict:
        return asdict(self)

    def model_config(self):
        """mtds ModelConfig: GPT-2 architecture, no dropout (so both sides run the same ops)."""
        from mtds.model.config import ModelConfig
        return ModelConfig(vocab_size=self.vocab, hidden_size=self.hidden, num_layers=self.layers,
                           num_heads=self.heads, max_position_embeddings=self.seq)

    def hf_config(self):
        """transformers GPT2Config of the same model (tied embeddings, gelu_new, no dropout)."""
        from transformers import GPT2Config
        return GPT2Config(vocab_size=self.vocab, n_positions=self.seq, n_embd=self.hidden, n_layer=self.layers,
                          n_head=self.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                          activation_function="gelu_new", bos_token_id=None, eos_token_id=None)


def ds_config(micro_batch: int, global_batch: int, zero_stage: int = 1) -> dict:
    """The DeepSpeed config of the mtds side: ds_configs/cpu_fp32.json with the benchmark's batch."""
    return {
        "train_batch_size": global_batch,
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {**ADAMW, "torch_adam": True}},
        "zero_optimization": {"stage": zero_stage},
        "steps_per_print": 10 ** 9,
    }
