"""ZeRO-3 on a pipeline (p > 1): each stage's working parameters partitioned over its data-parallel group.

Why not DeepSpeed's ZeRO-3 (0.19.8): its ``PipelineEngine`` asserts ZeRO stage < 2, and its stage-3 optimizer
gathers and frees parameters from module hooks it fires per submodule and per forward, with a trace-based
prefetcher that assumes one forward then one backward per step -- a pipeline stage interleaves m of each,
and its tied weights are summed across stages from ``weight.grad`` (see zero2_reduce.py). So ZeRO-3 at p > 1
extends mtds's ZeRO-2 (zero2_reduce.py): DeepSpeed's optimizer is built at stage 1 (partitioned fp32 master
weights and Adam state, ZeRO-1's checkpoint files), mtds reduce-scatters the gradients, and here mtds frees
and gathers the working parameters -- the flat buffer DeepSpeed laid each parameter group out in, whose
storage is released (``resize_(0)``: every parameter, a view into it, keeps its shape) and re-allocated and
all-gathered on demand. In fp32 the gather's source is the fp32 master partition itself (DeepSpeed's step
copies it into the working partition unchanged), so between gathers a rank holds no working parameters at
all: 4Ψ/d of master weights plus 8Ψ/d of Adam state per rank. In bf16 (DeepSpeed's BF16_Optimizer, fp32
accumulation; the gradients by bf16_zero2.py) the source is the same fp32 master partition, cast to bf16 for
the gather -- exactly the copy DeepSpeed's step makes into its bf16 partition before its own all-gather, so a
gathered weight is the one ZeRO-1 bf16 holds; keeping a bf16 partition instead would hold 2Ψ/d more per rank
to save one cast of Ψ/d per gather. Between gathers a rank holds the same 12Ψ/d, the gathered weights 2Ψ.
Two modes (``--zero3-pipeline-gather``):

* ``step`` (torchtitan's choice for pipelines): gathered once per step, at the stage's first forward, kept
  until its last backward ends (then freed); the gradients reduce-scattered once then (ZeRO-2's ``step``).
  One all-gather and one reduce-scatter of Ψ per step: ZeRO-1's bytes.
* ``micro-batch`` (least memory): gathered for each forward and each backward of a micro-batch and freed
  after each (2m all-gathers a step); the gradients reduce-scattered per micro-batch (ZeRO-2's
  ``micro-batch``). Prefetched, always (it is exact: the same bytes copied into the same buffer, only
  issued earlier): a pass that receives its input (a forward's activation, a backward's output gradient)
  issues its all-gather asynchronously (``prefetch``) just before that receive waits and waits for the gather
  at the pass (``gather``), so the gather overlaps the wait for the peer stage. The parameters are then whole
  from the issue, i.e. during the receive wait too, instead of from the pass's start; the peak is unchanged
  (one whole stage, as before). A pass with no receive before it (the first stage's forward, the last
  stage's backward) gathers blocking at its start, as before.

DeepSpeed's own post-step all-gather is skipped (the next forward gathers): during ``step`` the optimizer sees
no flat buffers to gather into and writes the updated master partition onto itself. Forward pre-hooks of the
stage module gather for evaluation too; checkpoint save gathers first (the files hold the weights), load frees
after (its fp32 partitions are the truth). fp32, and bf16 with fp32 accumulation. Checked against DeepSpeed
0.19.8.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

MODES = ("step", "micro-batch")


class StageParameterShards:
    """The working parameters of one stage's stage-1 ZeRO optimizer, whole or freed (see the module docstring)."""

    def __init__(self, engine, mode: str, all_gather_single):
        if mode not in MODES:
            raise ValueError(f"ZeRO-3 pipeline gather mode must be one of {MODES}, got {mode!r}")
        opt = engine.optimizer
        self.bf16 = hasattr(opt, "bf16_groups_flat")    # DeepSpeed's BF16_Optimizer (bf16 with fp32 accumulation)
        self.flats = opt.bf16_groups_flat if self.bf16 else opt.bit16_groups_flat
        self.masters = opt.fp32_groups_flat_partition if self.bf16 else opt.single_partition_of_fp32_groups
        want = torch.bfloat16 if self.bf16 else torch.float32
        if any(f.dtype != want for f in self.flats) or any(p.dtype != torch.float32 for p in self.masters):
            raise RuntimeError("ZeRO-3 with a pipeline is built for fp32, and bf16 with fp32 master weights (the "
                               "master partition is the gather's source)")
        self.opt, self.mode = opt, mode
        self.all_gather_single = all_gather_single     # (out, x, group, async_op): the caller's, torch's current name
        self.whole = True       # DeepSpeed built the flat buffers whole
        self.gathers = 0        # all-gathers run (each: every group)
        self.pending = None     # a prefetch's (works, casts) until waited for
        self.overlapped = 0     # prefetches still in flight when the receive after their issue had finished

    def prefetch(self) -> None:
        """Issue the gather asynchronously (no-op when whole or already issued): the buffers are allocated now
        and filled by the time :meth:`gather` (or :meth:`free`) waits for it."""
        if self.whole or self.pending is not None:
            return
        self.pending = self._issue(async_op=True)

    def received(self) -> None:
        """A receive has finished: count the prefetch that was in flight across it (the test's evidence)."""
        if self.pending is not None:
            self.overlapped += 1

    def free(self) -> None:
        """Release every group's flat buffer (the parameters keep shape, no storage)."""
        self.wait()        # a prefetch in flight writes into them
        if not self.whole:
            return
        for flat in self.flats:
            flat.untyped_storage().resize_(0)
        self.whole = False

    def gather(self) -> None:
        """Whole parameters now: wait for a prefetch, or re-allocate every group's flat buffer and all-gather it
        from the ranks' fp32 master partitions (bf16: each cast to bf16 first, as DeepSpeed's step copies it into
        its bf16 partition)."""
        if self.pending is not None:
            self.wait()
        elif not self.whole:
            self._issue(async_op=False)

    def wait(self) -> None:
        """Wait for a prefetch in flight (no-op without one)."""
        if self.pending is None:
            return
        works, _casts = self.pending        # the casts stay referenced until their gathers are done
        for work in works:
            work.wait()
        self.pending = None
        self.whole = True
        self.gathers += 1

    @torch.no_grad()
    def _issue(self, async_op: bool):
        opt, works, casts = self.opt, [], []
        for i, flat in enumerate(self.flats):
            flat.untyped_storage().resize_(flat.numel() * flat.element_size())
            group = opt.real_dp_process_group[i]
            master = self.masters[i]
            if dist.get_world_size(group=group) == 1:
                flat.copy_(master)
            else:
                casts.append(master.to(flat.dtype))
                work = self.all_gather_single(flat, casts[-1], group=group, async_op=async_op)
                if async_op:
                    works.append(work)
        if async_op:
            return works, casts
        self.whole = True
        self.gathers += 1
        return None

    def step(self, original, closure=None):
        """DeepSpeed's step without its working partition copy and all-gather: the flat buffers are freed (or
        dropped after it), the master partition is the next gather's source."""
        opt = self.opt
        self.free()
        if self.bf16:       # BF16_Optimizer's step ends copying into its bf16 partition and all-gathering: skipped
            opt.update_lp_params = lambda: None
            try:
                return original(closure)
            finally:
                del opt.update_lp_params
        saved = opt.bit16_groups_flat, opt.parallel_partitioned_bit16_groups, opt.__dict__.get("_update_model_bit16_weights")
        stand_in = []
        for i, parts in enumerate(saved[1]):
            parts = list(parts)
            parts[dist.get_rank(group=opt.real_dp_process_group[i])] = opt.single_partition_of_fp32_groups[i]
            stand_in.append(parts)      # the "copy into the working partition" is then onto itself
        opt.bit16_groups_flat, opt.parallel_partitioned_bit16_groups = [], stand_in     # nothing to all-gather into
        opt._update_model_bit16_weights = lambda group_index: None
        try:
            return original(closure)
        finally:
            opt.bit16_groups_flat, opt.parallel_partitioned_bit16_groups = saved[0], saved[1]
            if saved[2] is None:
                del opt._update_model_bit16_weights
            else:
                opt._update_model_bit16_weights = saved[2]


def install_stage_parameter_shards(engine, mode: str, all_gather_single) -> StageParameterShards:
    """Free this stage's working parameters and gather them where they are used (see the module docstring):
    forward pre-hook (both modes), the optimizer step, checkpoint save and load. The caller frees them after the
    stage's last backward (``step``) or after each forward and backward (``micro-batch``). Kept as
    ``engine.mtds_zero3_params``."""
    import deepspeed.comm
    if not deepspeed.comm.has_all_gather_into_tensor():
        raise RuntimeError("ZeRO-3 with a pipeline needs all_gather_into_tensor in torch.distributed")
    shards = StageParameterShards(engine, mode, all_gather_single)
    opt = engine.optimizer
    original_step = opt.step
    opt.step = lambda closure=None: shards.step(original_step, closure)
    engine.module.register_forward_pre_hook(lambda module, args: shards.gather())

    save, load = engine.save_checkpoint, engine.load_checkpoint

    def save_checkpoint(*args, **kwargs):
        shards.gather()
        return save(*args, **kwargs)

    def load_checkpoint(*args, **kwargs):
        shards.gather()         # DeepSpeed copies the module's weights into the parameters
        try:
            return load(*args, **kwargs)
        finally:
            shards.whole, shards.pending = True, None
            shards.free()       # the loaded fp32 partitions are the next gather's source

    engine.save_checkpoint, engine.load_checkpoint = save_checkpoint, load_checkpoint
    object.__setattr__(engine, "mtds_zero3_params", shards)
    shards.free()
    return shards


def free_parameters(engine) -> None:
    """Release the stage's working parameters (no-op without ZeRO-3 on a pipeline)."""
    shards = engine.__dict__.get("mtds_zero3_params")
    if shards is not None:
        shards.free()


def gather_parameters(engine) -> None:
    shards = engine.__dict__.get("mtds_zero3_params")
    if shards is not None:
        shards.gather()


def prefetch_parameters(engine) -> None:
    """Before a receive that a pass of the ``micro-batch`` mode waits on: issue that pass's gather (no-op
    otherwise)."""
    shards = engine.__dict__.get("mtds_zero3_params")
    if shards is not None and shards.mode == "micro-batch":
        shards.prefetch()


def wait_for_prefetch(engine) -> None:
    """mtds's engines, at a pass after its receive, in the ``micro-batch`` mode: the parameters whole (the
    prefetched gather waited for, or gathered now without one; no-op otherwise)."""
    shards = engine.__dict__.get("mtds_zero3_params")
    if shards is not None and shards.mode == "micro-batch":
        shards.gather()


def parameters_received(engine) -> None:
    shards = engine.__dict__.get("mtds_zero3_params")
    if shards is not None:
        shards.received()


@contextlib.contextmanager
def gathered_per_pass(engine):
    """mtds's engines, around each forward and (input) backward: in the ``micro-batch`` mode the parameters are
    gathered for it (issued here, waited for by :func:`wait_for_prefetch` after the pass's receive) and freed
    after (no-op otherwise; ZB-H1's W needs no parameters)."""
    shards = engine.__dict__.get("mtds_zero3_params")
    if shards is None or shards.mode != "micro-batch":
        yield
        return
    shards.prefetch()
    try:
        yield
    finally:
        shards.free()
