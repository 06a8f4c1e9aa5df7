"""Run a function on N local ranks (gloo on CPU, NCCL with one GPU per rank) with a hard timeout: what
``mtds.gpucheck`` and the benchmarks start their ranks with (the test-suite adds a pool of live ranks on top,
outside the package)."""
