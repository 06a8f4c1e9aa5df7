"""mtds: Megatron-style tensor parallelism layered on DeepSpeed (PTD-P: tensor x pipeline x data)."""
__version__ = "0.1.0"
