"""Pipeline parallelism: GPT as DeepSpeed LayerSpecs, built into a PipelineModule (or one stage)."""
from mtds.pipe.module import SequentialGPT, build_model, build_pipeline_module
from mtds.pipe.specs import gpt_layer_specs

__all__ = ["build_model", "build_pipeline_module", "SequentialGPT", "gpt_layer_specs"]
