"""``python -m mtds.gpucheck``: one command that validates mtds on a GPU machine (CUDA + NCCL, 1-8 GPUs)
-- HF parity of every pipeline schedule in bf16 and fp16, a p2p stress of large crossing stage
boundaries, eval and save/resume on the device, and a speed table against HuggingFace -- and writes a
markdown report. ``--device cpu`` runs the same checks on tiny shapes with gloo (the test-suite does).

One concept per module: :mod:`.machine` (device, ranks, versions), :mod:`.workloads` (shapes),
:mod:`.ds_configs` (DeepSpeed configs), :mod:`.reference` (the HF reference), :mod:`.ranks` (bounded
multi-rank runs), :mod:`.parity`, :mod:`.p2p_stress`, :mod:`.resume_eval`, :mod:`.speed`, :mod:`.microbatch`
(the checks), :mod:`.report` (markdown), :mod:`.cli`.
"""
