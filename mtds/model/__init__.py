"""GPT-family decoder built from tensor-parallel layers; each piece usable alone as a pipeline LayerSpec.

Global layer indices (seeding, checkpoint names, HF tables): 0 GPTEmbedding, 1..L TransformerLayer,
L+1 FinalNorm, L+2 LMHead (untied only; tied models use GPTEmbedding.lm_logits).
"""
from mtds import lazy_exports

# Resolved on first use (PEP 562): the model's config (mtds.model.config) is read by the planner and the
# checkpoint tools, which must not pay for torch.
_HOMES = {
    "SelfAttention": "attention",
    "GPTEmbedding": "embedding",
    "GPTModel": "gpt",
    "gather_logits": "gpt",
    "FinalNorm": "head",
    "LMHead": "head",
    "LMLoss": "head",
    "seed_for": "init",
    "seeded": "init",
    "TransformerLayer": "layer",
    "MLP": "mlp",
    "RMSNorm": "norms",
    "make_norm": "norms",
    "check_tensor_parallel": "parallel",
    "full_of": "shard",
    "full_state": "shard",
    "load_full_state": "shard",
    "shard_of": "shard"
}

__all__ = list(_HOMES)

__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
