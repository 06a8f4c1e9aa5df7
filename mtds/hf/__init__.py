"""HuggingFace interop: config conversion, weight-mapping tables, loading into (sharded) models, export.

registry.py dispatches to one adapter per architecture (gpt2.py, neox.py, llama.py); table.py holds the
weight-mapping rows; checkpoint.py reads safetensors/.bin; load.py and export.py move weights in and out.
"""
from .checkpoint import HFCheckpoint
from .common import UnsupportedHFConfig
from .export import model_to_hf_state, model_to_layers, save_hf_checkpoint
from .load import load_hf_into_model, load_hf_into_modules, open_hf_checkpoint
from .registry import (ADAPTERS, adapter_for, hf_config_dict, hf_config_from_model_config, hf_state_to_layers,
                       layers_to_hf_state, model_config_from_hf, weight_table)
from .table import WeightMap

__all__ = ["ADAPTERS", "adapter_for", "model_config_from_hf", "hf_config_dict", "hf_config_from_model_config",
           "weight_table", "hf_state_to_layers", "layers_to_hf_state", "open_hf_checkpoint", "load_hf_into_modules",
           "load_hf_into_model", "model_to_layers", "model_to_hf_state", "save_hf_checkpoint", "HFCheckpoint",
           "WeightMap", "UnsupportedHFConfig"]
