"""DeepSpeed checkpoint internals mtds uses: its checkpoint engine (replaced by a durable one), the
universal-checkpoint switch, the optimizers' master-weight refresh, ZeRO-3 consolidation.

Checked against DeepSpeed 0.19.8.
"""
from __future__ import annotations

import contextlib


def wrap_checkpoint_engine(engine, wrapper_cls):
    """Route the engine's checkpoint file writes and loads through ``wrapper_cls(original)`` (once per
    engine); returns the wrapper. DeepSpeed reads ``engine.checkpoint_engine`` for every file it saves
    or loads, and the pipeline module's per-layer files go through the same object."""
    if not isinstance(engine.checkpoint_engine, wrapper_cls):
        engine.checkpoint_engine = wrapper_cls(engine.checkpoint_engine)
    return engine.checkpoint_engine


@contextlib.contextmanager
def loading_universal(engine):
    """``engine.load_checkpoint`` inside reads a universal checkpoint (the flag is read by the load and
    by the ZeRO optimizer's state loading only)."""
    config = engine._config
    config.load_universal_checkpoint = True
    try:
        yield
    finally:
        config.load_universal_checkpoint = False


def refresh_master_weights(engine) -> bool:
    """Copy the module's (new) weights into the optimizer's fp32 master copy, where it keeps one
    (ZeRO-1/2, BF16 optimizer). False where the optimizer has no such copy."""
    optimizer = engine.optimizer
    refresh = getattr(optimizer, "refresh_fp32_params", None) or getattr(optimizer, "_restore_from_bit16_weights", None)
    if refresh is None:
        return False
    refresh()
    return True


def consolidate_zero3(model_files: list[str], optim_files: list[str], tag_dir: str) -> tuple[int, dict]:
    """ZeRO-3 partitions of one model-parallel rank -> (stage found, full fp32 state dict). Raises what
    DeepSpeed raises on damaged files (ValueError, KeyError, AssertionError, FileNotFoundError)."""
    from deepspeed.utils import zero_to_fp32 as z
    states = z.parse_model_states(model_files)
    stage, world, flat, _ = z.parse_optim_states(optim_files, tag_dir)
    if stage != 3:
        return stage, {}
    return stage, z._get_fp32_state_dict_from_zero3_checkpoint(world, flat, states, False)
