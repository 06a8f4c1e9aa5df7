"""Benchmarks: mtds against HuggingFace, and the layouts against each other (a regression guard)."""
