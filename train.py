#!/usr/bin/env python
"""Train a GPT with Megatron tensor parallelism inside DeepSpeed's pipeline and data parallelism.

    deepspeed --num_gpus 2 train.py --deepspeed_config ds_configs/cpu_fp32.json --tp 2

Run with --help for every option. The library entry point is mtds.training.run(TrainConfig(...)).
"""
from mtds.training.cli import main

if __name__ == "__main__":
    main()
