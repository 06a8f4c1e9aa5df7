"""HuggingFace interop: config conversion, weight-mapping tables, loading into (sharded) models, export.

registry.py dispatches to one adapter per architecture (gpt2.py, neox.py, llama.py); table.py holds the
weight-mapping rows; checkpoint.py reads safetensors/.bin; load.py and export.py move weights in and out;
stream_source.py / stream_export.py stream checkpoints larger than memory; resolve.py turns a preset name or a
HF config into a ModelConfig.
"""
from mtds import lazy_exports

# Resolved on first use (PEP 562): resolving a preset name (mtds.hf.resolve) and the planner must not pay for
# torch and transformers, which the adapters' loaders pull in.
_HOMES = {
    "HFCheckpoint": "checkpoint",
    "UnsupportedHFConfig": "common",
    "model_to_hf_state": "export",
    "model_to_layers": "export",
    "save_hf_checkpoint": "export",
    "load_hf_into_model": "load",
    "load_hf_into_modules": "load",
    "open_hf_checkpoint": "load",
    "ADAPTERS": "registry",
    "adapter_for": "registry",
    "hf_config_dict": "registry",
    "hf_config_from_model_config": "registry",
    "hf_state_to_layers": "registry",
    "layers_to_hf_state": "registry",
    "model_config_from_hf": "registry",
    "weight_table": "registry",
    "WeightMap": "table",
    "resolve_model_config": "resolve"
}

__all__ = list(_HOMES)

__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
