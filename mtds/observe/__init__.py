"""What a run tells about itself: the step record (logger.py: console line, JSONL, TensorBoard), curves
(plot.py), FLOP and parameter counts, MFU (metrics.py, gemm_peak.py), bytes per collective (comm_trace.py),
the pipeline timeline and bubble (timeline.py, pipe_instrument.py), one profiled step (step_profile.py), and
the third-party output mtds hides unless --debug (quiet.py)."""
