# Two commands on a fresh machine:  `make train`  (set up + main job)  and  `make test`  (set up + tests).
# CPU machines get the local CPU torch wheel; GPU users: `make train TORCH_SPEC=torch` (CUDA build from PyPI).
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
NPROC ?= 2
BIN := $(VENV)/bin
# Set up once: a stamp per torch spec, older than pyproject.toml means stale (mtds itself is installed editable,
# so source changes need nothing). Another TORCH_SPEC, or a changed pyproject.toml, installs again.
SETUP_STAMP := $(VENV)/.setup-$(subst /,_,$(subst $() ,_,$(TORCH_SPEC)))
TEST_STAMP := $(SETUP_STAMP)-test

.PHONY: setup setup-test train test test-slow gpu-check gpu-bench peers clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(SETUP_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e .
	touch "$@"

$(TEST_STAMP): $(SETUP_STAMP) pyproject.toml
	$(BIN)/pip install -q -e ".[test]"
	touch "$@"

# Megatron-LM 0.19's training package, the oracle of tests/test_megatron_lm.py: it declares Python >= 3.12 and its
# megatron.core imports triton, so it cannot replace the test extra's 0.16.1 in the venv; its wheel (no
# dependencies) goes into a folder of its own that only that test's subprocess puts on its path.
MEGATRON_LM := $(VENV)/megatron-lm-0.19
$(MEGATRON_LM)/.installed: | $(BIN)/python
	$(BIN)/pip install -q --no-deps --ignore-requires-python --target "$(MEGATRON_LM)" megatron-core==0.19.2
	touch "$@"

setup: $(SETUP_STAMP)

setup-test: $(TEST_STAMP) $(MEGATRON_LM)/.installed

# The main job: gpt2-tiny on the shipped Shakespeare corpus, 2 ranks (tp=2), fp32, DeepSpeed launcher.
train: setup
	PATH=$(abspath $(BIN)):$$PATH OMP_NUM_THREADS=1 $(BIN)/deepspeed --num_gpus $(NPROC) train.py \
		--deepspeed_config ds_configs/cpu_fp32.json --model gpt2-tiny --tp 2 --pp 1 \
		--steps 200 --warmup-steps 20 --log-jsonl runs/main/log.jsonl --tensorboard runs/main/tb \
		--plot runs/main/curves.png

# Two pytest workers (pytest-xdist) share the two cores: while one waits (a launcher starting, a fault's timeout),
# the other computes; each file runs whole on one worker (docs/testing.md). TEST_WORKERS=0: one process. The GPU
# mode (MTDS_TEST_DEVICE=cuda) runs in one process: its ranks take GPUs 0..N-1, which two workers would share.
TEST_WORKERS ?= $(if $(filter cuda,$(MTDS_TEST_DEVICE)),0,2)
XDIST = $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)
test: setup-test
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q --durations=15 $(XDIST) tests

# The suite as on the slowest machine of our kind (AVX2-only kernels, one core's worth of CPU): run it before a
# submission that adds numeric bounds or multi-rank tests (docs/testing.md).
test-slow: setup-test
	scripts/slow-machine --isa avx2 --cpus 1.0 -- $(MAKE) --no-print-directory test

# On a GPU machine (with TORCH_SPEC=torch): parity, p2p stress, eval/resume and speed on CUDA + NCCL,
# report in gpucheck.md. GPUCHECK_ARGS="--quick --gpus 2" for less; --device cpu runs the CPU mode.
gpu-check: setup
	$(BIN)/python -m mtds.gpucheck $(GPUCHECK_ARGS)

# One prepared speed run for a lent GPU (benchmarks/gpu_bench.py; at most 8 minutes on an H100): host launch
# cost, baseline vs HF, b = 8/16/32, one profiled step, --compile on/off, A/B of each speed change, the
# baseline again. results.json and summary.md in GPU_BENCH_OUT ($OUT when set, else gpu_bench/) after every
# stage. No set-up step: it runs with $(PYTHON) as it is (the GPU image's, with the carried wheels:
# docs/gpucheck.md#prepared-gpu-run). GPU_BENCH_ARGS="--dry-run --device cpu": every stage at tiny shapes.
GPU_BENCH_OUT ?= $(or $(OUT),gpu_bench)
gpu-bench:
	$(PYTHON) benchmarks/gpu_bench.py --out $(GPU_BENCH_OUT) $(GPU_BENCH_ARGS)

# The peers of `python -m compare run` (schemes megatron:... and torchtitan:...), optional and never imported by
# mtds: Megatron-core 0.19.2 and torchtitan 0.3.0 with torch 2.13.0 in a venv of their own ($(PEERS_WORK)/venv,
# which compare/peer_launch.py finds; PEERS_PYTHON names another). Megatron-core 0.17+ declares Python >= 3.12,
# its cp311 wheel works; numpy first, or pip picks one that needs 3.12 to build. torchtitan without its pins (they
# would replace torch), plus what its model and TP code import.
PEERS_WORK ?= $(or $(TMPDIR),/tmp)/mtds-peers
PEERS_BIN := $(PEERS_WORK)/venv/bin
peers: $(PEERS_WORK)/venv/.installed
$(PEERS_WORK)/venv/.installed:
	$(PYTHON) -m venv $(PEERS_WORK)/venv
	$(PEERS_BIN)/pip install -q --upgrade pip
	$(PEERS_BIN)/pip install -q torch==2.13.0 numpy packaging transformers
	$(PEERS_BIN)/pip install -q --ignore-requires-python megatron-core==0.19.2
	$(PEERS_BIN)/pip install -q --no-deps torchtitan==0.3.0
	$(PEERS_BIN)/pip install -q torchdata torch_checkpointing spmd_types==0.2.3 tyro einops safetensors tokenizers \
	    tensorboard pillow "datasets>=3.6,<4.8"
	$(PEERS_BIN)/python -c "import torch; assert torch.__version__.startswith('2.13'), torch.__version__"
	touch "$@"

clean:
	rm -rf $(VENV) runs
