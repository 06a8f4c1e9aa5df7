"""The live rank pools (lab.testing.pool) leave nothing behind between test bodies.

- A body that changes what DeepSpeed, mtds and torch keep in process globals is followed by one that
  sees exactly what a fresh process sees (the same fingerprint of that state as new processes report).
- Two different layouts run back to back on one pool: the second trains bit for bit as it does on
  fresh processes.
- A body that fails leaves a pool that is started anew, and the next body runs.
"""
import hashlib
import logging
import os

import pytest
import torch
import torch.distributed as dist
import torch.utils._device

from lab import testing
from tests.training_helpers import TINY, ds_config, train_config

PROBE_ENV = "MTDS_POOL_PROBE"


def _fingerprint():
    """What a body could inherit from the one before it, as plain values."""
    import deepspeed
    import deepspeed.comm.comm as ds_comm
    import deepspeed.runtime.activation_checkpointing.checkpointing as ds_ckpt
    import deepspeed.utils.groups as ds_groups
    import torch.distributed.distributed_c10d as c10d
    from deepspeed.accelerator import real_accelerator
    accel = real_accelerator.ds_accelerator
    return {
        "default_dtype": str(torch.get_default_dtype()),
        "torch_rng": hashlib.sha1(torch.get_rng_state().numpy().tobytes()).hexdigest(),
        "grad_enabled": torch.is_grad_enabled(),
        "global_module_hooks": len(torch.nn.modules.module._global_forward_hooks),
        "default_device": str(torch.utils._device.CURRENT_DEVICE),    # None: no device mode around every op
        "threads": torch.get_num_threads(),
        "env_probe": os.environ.get(PROBE_ENV),
        "cwd": os.getcwd(),
        "accelerator_patched": accel is not None and "is_fp16_supported" in vars(accel),
        "ds_comm_backend": ds_comm.cdb is not None,
        "ds_world_group": ds_groups._WORLD_GROUP is not None,
        "ds_groups_mpu": ds_groups.mpu is not None,
        "ds_ckpt_mpu": ds_ckpt.mpu is not None,
        "ds_rng_states": sorted(ds_ckpt.get_cuda_rng_tracker().get_states()),
        "traced_all_reduce": hasattr(c10d.all_reduce, "_mtds_tracers") or hasattr(dist.all_reduce, "_mtds_tracers"),
        "process_groups": len(c10d._world.pg_map),
        "ds_logger_handlers": len(logging.getLogger("DeepSpeed").handlers),
        "linear": f"{torch.nn.functional.linear.__module__}.{torch.nn.functional.linear.__name__}",
        "tensor_new": getattr(torch.Tensor.__new__, "__qualname__", str(torch.Tensor.__new__)),
        "ds_version": deepspeed.__version__,
        "gloo_threads": _gloo_threads(),      # three per live gloo process group
    }


def _gloo_threads() -> int:
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:       # the thread ended meanwhile
            pass
    return sum(name.startswith(("pt_gloo", "gloo")) for name in names)


def _dirty_everything():
    """Change each thing :func:`_fingerprint` reads, the way a training run or a test would."""
    import deepspeed
    import deepspeed.runtime.activation_checkpointing.checkpointing as ds_ckpt
    from deepspeed.accelerator import get_accelerator

    from mtds.observe.comm_trace import CommTracer
    # An engine left alive: ZeRO-1's gradient hooks refer back to it from inside autograd (a cycle gc
    # cannot see), and it holds process groups the next body must not inherit the threads of.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False     # as mtds does: no inference-only JIT build
    deepspeed.initialize(model=torch.nn.Linear(4, 4), config={
        "train_batch_size": 2 * dist.get_world_size(), "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}, "zero_optimization": {"stage": 1}})
    torch.set_default_dtype(torch.float64)
    torch.set_default_device("cpu")
    torch.manual_seed(1234 + dist.get_rank())
    torch.set_num_threads(2)
    os.environ[PROBE_ENV] = "left behind"
    os.chdir("/")
    get_accelerator().is_fp16_supported = lambda: True
    CommTracer().install()                      # never uninstalled
    deepspeed.init_distributed(dist_backend="gloo")
    import deepspeed.utils.groups as ds_groups
    ds_groups._clone_world_group()
    ds_groups.mpu = object()
    ds_ckpt.get_cuda_rng_tracker().add("model-parallel-rng", 42)
    ds_ckpt.mpu = object()
    dist.new_group(list(range(dist.get_world_size())))
    logging.getLogger("DeepSpeed").addHandler(logging.NullHandler())
    from deepspeed.runtime.zero.linear import zero3_linear_wrap
    torch.nn.functional.linear = zero3_linear_wrap      # what ZeRO-3 leaves behind for good
    original_new = torch.Tensor.__new__

    def new(cls, *args, **kwargs):          # what zero.Init puts there while it is open
        return original_new(cls, *args, **kwargs)
    torch.Tensor.__new__ = new
    torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: None)
    torch.set_grad_enabled(False)
    return _fingerprint()


def test_a_body_sees_a_fresh_process_after_one_that_changed_every_global():
    fresh = testing.spawn(_fingerprint, 2, fresh=True)
    before = testing.spawn(_fingerprint, 2)
    dirty = testing.spawn(_dirty_everything, 2)
    changed = [k for k in fresh[0] if dirty[0][k] == before[0][k] and k != "ds_version"]
    assert changed == [], f"not changed by the dirtying body: {changed}"     # it really changed each one ...
    after = testing.spawn(_fingerprint, 2)       # ... and the next body sees none of it:
    for rank in range(2):
        # what new processes see (torch seeds a new process's generator at random, so not its state, and
        # gloo starts a new process's loop threads as it goes: 1 to 3 of them) ...
        diff = {k: (after[rank][k], fresh[rank][k]) for k in fresh[rank]
                if after[rank][k] != fresh[rank][k] and k not in ("torch_rng", "gloo_threads")}
        assert diff == {}, f"rank {rank}: (pooled after a dirty body, fresh process): {diff}"
        # ... and what this pool's bodies start from, generator state included
        assert after[rank] == before[rank], (rank, after[rank], before[rank])


def _train(config, force_fp16):
    if force_fp16:
        from deepspeed.accelerator import get_accelerator
        get_accelerator().is_fp16_supported = lambda: True
    import gc

    from deepspeed.runtime.engine import DeepSpeedEngine
    from mtds.training import run

    def engines():      # a ZeRO-3 body's engine outlives it: the ones alive before are not this run's
        gc.collect()
        return sum(isinstance(o, DeepSpeedEngine) for o in gc.get_objects())
    before = engines()
    threads = _gloo_threads()
    result = run(config)
    return result.losses, result.grad_norms, engines() - before, threads


def test_two_layouts_back_to_back_on_one_pool_train_as_on_fresh_processes():
    """(1,2,1) interleaved fp16 with dropout, (1,1,2) ZeRO-3 (which replaces torch's F.linear for good),
    then (2,1,1) ZeRO-1 bf16 with dropout, on one pool: the last gives the losses and grad norms that new
    processes give, bit for bit (bf16 turns any ulp of difference into visible ones)."""
    from dataclasses import replace
    dropout = replace(TINY, hidden_dropout=0.1, attention_dropout=0.1)
    first = train_config(pp=2, pipeline_schedule="interleaved", virtual_stages=2, steps=3, model=dropout,
                         deepspeed_config=ds_config(zero=0, precision="fp16"))
    second = train_config(tp=2, steps=3, model=dropout, seed=7,
                          deepspeed_config=ds_config(zero=1, precision="bf16"))
    zero3 = train_config(steps=2, deepspeed_config=ds_config(zero=3))
    first_run = testing.spawn(_train, 2, first, True, timeout=300)
    testing.spawn(_train, 2, zero3, False, timeout=300)
    pooled = testing.spawn(_train, 2, second, False, timeout=300)
    fresh = testing.spawn(_train, 2, second, False, timeout=300, fresh=True)
    assert [r[:3] for r in pooled] == [r[:3] for r in fresh], (pooled, fresh)
    assert len(set(pooled[0][0])) == 3        # it trained
    # the ZeRO-3 run's process groups went with its body (its hooks on module outputs keep its engine and
    # layers; the reset empties them): the next body starts with the gloo threads the one before it did
    assert [r[3] for r in pooled] == [r[3] for r in first_run], (first_run, pooled)
    # run() releases its engine (mtds.training.job.release): none outlives the run (ZeRO-3's does, kept by
    # its hooks on module outputs; the pool's reset empties it, see _dirty_everything's engine).
    assert [r[2] for r in first_run + pooled] == [0] * 4, (first_run, pooled)


def _fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("boom on rank one")
    dist.barrier()


def _stuck_in_a_collective_on_rank_zero():
    if dist.get_rank() == 0:
        dist.recv(torch.zeros(1), src=1)        # rank 1 never sends: rank 0 waits here
    return "ok"


def _rank():
    return dist.get_rank()


def test_a_failed_body_restarts_the_pool_and_names_every_rank():
    if testing.pool_stats() == {} and os.environ.get("MTDS_TEST_POOL") == "0":
        pytest.skip("pools are off (MTDS_TEST_POOL=0)")
    with pytest.raises(testing.RankFailure) as err:
        testing.spawn(_fail_on_rank_one, 2, timeout=60)
    text = str(err.value)
    assert "boom on rank one" in text and "rank 1 failed" in text
    # rank 0, left waiting in the barrier, is named too: by its own error once gloo sees rank 1 gone, or
    # by the stack the pool asks it for
    assert "--- rank 0 " in text and "barrier" in text, text
    starts = testing.pool_stats()[2][1]
    assert testing.spawn(_rank, 2) == [0, 1]
    assert testing.pool_stats()[2][1] == starts + 1
    with pytest.raises(testing.RankFailure, match="did not finish within 3 s") as err:
        testing.spawn(_stuck_in_a_collective_on_rank_zero, 2, timeout=3)
    assert "_stuck_in_a_collective_on_rank_zero" in str(err.value)      # where rank 0 hung
    assert testing.spawn(_rank, 2) == [0, 1]
