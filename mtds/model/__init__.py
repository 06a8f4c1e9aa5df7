"""GPT-family decoder built from tensor-parallel layers; each piece usable alone as a pipeline LayerSpec.

Global layer indices (seeding, checkpoint names, HF tables): 0 GPTEmbedding, 1..L TransformerLayer,
L+1 FinalNorm, L+2 LMHead (untied only; tied models use GPTEmbedding.lm_logits).
"""
from .attention import SelfAttention
from .embedding import GPTEmbedding
from .gpt import GPTModel, gather_logits
from .head import FinalNorm, LMHead, LMLoss
from .init import seed_for, seeded
from .layer import TransformerLayer
from .mlp import MLP
from .norms import RMSNorm, make_norm
from .parallel import check_tensor_parallel
from .shard import full_of, full_state, load_full_state, shard_of

__all__ = ["GPTEmbedding", "TransformerLayer", "FinalNorm", "LMHead", "LMLoss", "GPTModel", "gather_logits",
           "SelfAttention", "MLP", "RMSNorm", "make_norm", "seed_for", "seeded", "check_tensor_parallel",
           "full_of", "full_state", "load_full_state", "shard_of"]
