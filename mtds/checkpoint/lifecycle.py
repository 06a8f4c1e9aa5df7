"""Save and resume training through DeepSpeed's checkpointing, plus what DeepSpeed does not keep:
the data-stream position, the RNG streams and a description of model and layout.

DeepSpeed writes the files (per-layer model states for pipelines, ZeRO optimizer partitions) into a
staging folder ``DIR/global_stepN.partial``; mtds's extra state rides in ``client_state``; each rank
adds a manifest with its RNG streams, and rank 0 ``mtds_meta.json`` (model config, layout, tokenizer)
and the completion marker, then renames the folder (mtds.checkpoint.complete / store: complete or absent).
Every file a load touches is unpickled with ``weights_only=True`` and an allow-list (mtds.safety).

``--load DIR`` takes the newest complete checkpoint, then one of three paths:
  * same (t, p) and an optimizer state DeepSpeed can read as is -> DeepSpeed's own load;
  * another layout (or another d under ZeRO-1/2) -> DeepSpeed universal checkpointing: rank 0
    converts the checkpoint once (``global_stepN_universal``), every rank loads its new shards of
    weights, Adam moments and step; the loss scaler, LR schedule, data position and RNG come along.
    Where DeepSpeed stops (ZeRO-0 checkpoints and engines) mtds.checkpoint.reshard_zero0 does the same job;
    mixture-of-experts checkpoints are converted by mtds.checkpoint.reshard_experts (ZeRO-1/2, fp32 or bf16; fp32 ZeRO-0);
  * weights-only checkpoints (``mtds-convert hf-to-mtds``) -> module weights only, step 0.
"""
from __future__ import annotations

import glob
import hashlib
import os
import shutil

import torch
import torch.distributed as dist

from mtds.deepspeed_compat.checkpointing import loading_universal, refresh_master_weights, wrap_checkpoint_engine
from mtds.model.config import ModelConfig
from mtds.parallel.layout import ParallelGroups
from mtds.checkpoint.complete import (STAGING_SUFFIX, IncompleteCheckpoint, Marker, newest_listed, rank_manifest, share,
                                   verify_contents)
from mtds.checkpoint.errors import CheckpointFormatError
from mtds.checkpoint.expert_layout import reshard_problem
from mtds.checkpoint.meta import CheckpointMeta
from mtds.checkpoint.commit import commit, prune, write_manifest
from mtds.checkpoint.universal import ensure_universal, universal_dir, universal_info
from mtds.checkpoint.reshard_zero0 import PARAM_NAMES_KEY, load_universal_into_zero0
from mtds.checkpoint.scheduler_groups import scheduler_fits_groups
from mtds.checkpoint.durable import DurableCheckpointEngine
from mtds.safety.leader import leader_first
from mtds.checkpoint.safe_load import safe_load, verify_loadable

UNIVERSAL_CHECKPOINT_INFO = "universal_checkpoint_info"   # deepspeed.checkpoint.constants


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded; the message names the directory and what to do."""


def tag_for(step: int) -> str:
    return f"global_step{step}"


def _zero_stage(engine) -> int:
    return int(engine.zero_optimization_stage()) if engine.zero_optimization() else 0


def _precision(engine) -> str:
    return "bf16" if engine.bfloat16_enabled() else "fp16" if engine.fp16_enabled() else "fp32"


def _default_tokenizer(tokenizer: str | None) -> str | None:
    if tokenizer is not None:
        return os.path.abspath(tokenizer) if os.path.isdir(tokenizer) else tokenizer
    from mtds.data import SHIPPED_TOKENIZER
    return str(SHIPPED_TOKENIZER)


def _durable(engine) -> DurableCheckpointEngine:
    """Route the engine's file writes through fsync + a record of what this rank wrote, and its loads
    through the safe loader (installed once per engine)."""
    return wrap_checkpoint_engine(engine, DurableCheckpointEngine)


def rng_state(tracker=None) -> dict:
    return {"cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
            "tracker": tracker.get_states() if tracker is not None else None}


def set_rng_state(rng: dict, tracker=None) -> None:
    torch.set_rng_state(rng["cpu"])
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    if tracker is not None and rng.get("tracker"):
        tracker.set_states(rng["tracker"])


def save(engine, directory: str, step: int, extra: dict, groups: ParallelGroups, *,
         model_cfg: ModelConfig | None = None, tokenizer: str | None = None, rng_tracker=None,
         keep_last: int = 0) -> str:
    """Save ``DIR/global_stepN`` so that it is complete or absent (see mtds.checkpoint.complete), then
    move ``latest`` and prune to the newest ``keep_last`` complete checkpoints (0: keep all)."""
    tag, staging_dir = _begin(directory, step)
    durable = _durable(engine)
    durable.written.clear()
    engine.save_checkpoint(directory, tag=tag + STAGING_SUFFIX, client_state=client_state(engine, step, extra, groups,
                                                                                          model_cfg),
                           save_latest=False)
    staging_abs = os.path.abspath(staging_dir)
    files = {os.path.relpath(path, staging_abs): info for path, info in durable.written.items()}
    write_manifest(staging_dir, dist.get_rank(), files, rng_state(rng_tracker))
    dist.barrier()                  # every rank's files and manifest are on disk
    error = [None]
    if dist.get_rank() == 0:
        error[0] = commit_on_rank0(engine, directory, step, groups, model_cfg=model_cfg, tokenizer=tokenizer,
                                   keep_last=keep_last)
    dist.broadcast_object_list(error, src=0)
    if error[0]:
        raise CheckpointError(error[0])
    return os.path.join(directory, tag)


def _begin(directory: str, step: int) -> tuple[str, str]:
    """(tag, staging folder) of a new save; rank 0 clears a staging folder a crashed save left, then a barrier."""
    tag = tag_for(step)
    staging_dir = os.path.join(directory, tag + STAGING_SUFFIX)
    if dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
        shutil.rmtree(staging_dir, ignore_errors=True)     # left by a save that crashed: never complete
    dist.barrier()
    return tag, staging_dir


def client_state(engine, step: int, extra: dict, groups: ParallelGroups, model_cfg: ModelConfig | None) -> dict:
    """What mtds adds to DeepSpeed's files (``client_state``)."""
    layout = groups.layout
    state = {
        "mtds_step": step,
        "mtds_layout": {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp, "cp": layout.cp, "ep": layout.ep},
        "mtds_rng": rng_state(),     # fallback when resuming at another layout (rank files do not map)
        # Without ZeRO the Adam state is keyed by position: the names let us reshard it (zero0.py).
        PARAM_NAMES_KEY: [name for name, p in engine.module.named_parameters() if p.requires_grad],
        **extra,
    }
    if model_cfg is not None and layout.ep == 1:
        # DeepSpeed's ds_to_universal reads these patterns from the checkpoint to merge TP slices. (Its MoE save
        # reserves the key; MoE checkpoints are converted by mtds: mtds.checkpoint.reshard_experts.)
        state[UNIVERSAL_CHECKPOINT_INFO] = universal_info(model_cfg, layout.tp)
    return state


def capture(engine, directory: str, step: int, extra: dict, groups: ParallelGroups, snapshot, *,
            model_cfg: ModelConfig | None = None, rng_tracker=None):
    """--async-save's half of :func:`save` on the training thread: the staging folder, then DeepSpeed's save with
    every file's state copied to host memory by ``snapshot(state)`` instead of written; returns (tag, staging folder, [(path, host
    state)], this rank's RNG states) for :mod:`mtds.checkpoint.async_save` to write."""
    tag, staging_dir = _begin(directory, step)
    durable = _durable(engine)
    durable.written.clear()
    durable.captured, durable.snapshot = [], snapshot
    try:
        engine.save_checkpoint(directory, tag=tag + STAGING_SUFFIX,
                               client_state=client_state(engine, step, extra, groups, model_cfg), save_latest=False)
        files = durable.captured
    finally:
        durable.captured = None
    return tag, staging_dir, files, rng_state(rng_tracker)


def commit_on_rank0(engine, directory: str, step: int, groups: ParallelGroups, *, model_cfg: ModelConfig | None,
                    tokenizer: str | None, keep_last: int) -> str | None:
    """Rank 0, once every rank's files and manifest are durable: meta, marker, rename, ``latest``, prune. The
    error line, or None."""
    layout, tag = groups.layout, tag_for(step)
    staging_dir = os.path.join(directory, tag + STAGING_SUFFIX)
    try:
        meta = None if model_cfg is None else CheckpointMeta(
            # dp: DeepSpeed's data-parallel ranks, d·c (ZeRO partitions, rank files); c itself is not
            # recorded: nothing saved depends on how a sequence was split
            model=model_cfg.to_dict(), tp=layout.tp, pp=layout.pp, dp=layout.dp_cp, ep=layout.ep, step=step,
            zero_stage=_zero_stage(engine), precision=_precision(engine), tokenizer=_default_tokenizer(tokenizer),
            pipeline=layout.pp > 1, module_order=_module_order(engine))
        commit(directory, tag, staging_dir, Marker(step=step, world_size=dist.get_world_size()), meta)
        if keep_last:
            prune(directory, keep_last)
    except OSError as err:
        return f"could not save checkpoint {tag} in {directory!r}: {err}"
    return None


def _one_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _choose(directory: str, log, device) -> tuple[str, str, CheckpointMeta | None]:
    """The newest complete checkpoint. Rank 0 finds the newest that passes the cheap checks (marker,
    meta, rank manifests, file sizes: a few small files per saving rank); then every rank verifies its
    share of the bytes (CRC-32 and the safe unpickler; ``share`` balances bytes, so each rank reads
    about total/world) and the ranks agree on the outcome. A corrupt candidate is skipped and the next
    older one tried; one that would run code ends the load."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rejected: dict[str, str] = {}
    while True:
        proposal = [None, [], None, None]     # tag folder, skipped lines, its files, error
        if rank == 0:
            try:
                proposal = [*newest_listed(directory, rejected), None]
            except ValueError as err:       # CheckpointFormatError, IncompleteCheckpoint
                proposal = [None, [], None, _one_line(err)]
        dist.broadcast_object_list(proposal, src=0)
        tag_dir, skipped, files, error = proposal
        if error:
            raise CheckpointError(error)
        problem = None
        try:
            verify_contents(tag_dir, share(files, rank, world))
        except IncompleteCheckpoint as err:
            problem = [str(err), False]
        except ValueError as err:           # UnsafeCheckpointError: the file would run code
            problem = [_one_line(err), True]
        problem = _first_problem(problem, device)
        if problem is None:
            break
        reason, unsafe = problem
        if unsafe:
            raise CheckpointError(reason)
        rejected[tag_dir] = reason
    for line in skipped:
        log(f"checkpoint: {line}")
    root, tag = os.path.split(os.path.normpath(tag_dir))
    try:
        return root, tag, CheckpointMeta.load(tag_dir)
    except CheckpointFormatError:
        return root, tag, None          # saved without model_cfg: DeepSpeed's own checks only


def _first_problem(problem, device):
    """The problem of the lowest rank that found one (every rank gets it), or None if none did."""
    rank, world = dist.get_rank(), dist.get_world_size()
    first_bad = torch.tensor([rank if problem is not None else world], dtype=torch.int64, device=device)
    dist.all_reduce(first_bad, op=dist.ReduceOp.MIN)
    if int(first_bad) == world:
        return None
    found = [problem]
    dist.broadcast_object_list(found, src=int(first_bad))
    return found[0]


def _check_model(meta: CheckpointMeta, model_cfg: ModelConfig | None, directory: str) -> None:
    if model_cfg is None:
        return
    from mtds.checkpoint.reshard_load import check_same_model
    try:
        check_same_model(model_cfg, meta.model_config, directory)
    except ValueError as err:
        raise CheckpointError(f"checkpoint {directory!r} is of a different model: {_one_line(err)}") from None


def _module_order(engine) -> str:
    """How the pipeline module orders its parameters (rank files are positional): see CheckpointMeta."""
    module = engine.module
    if hasattr(module, "phase_bounds"):
        order = "dualpipev"
    else:
        chunks = getattr(module, "num_chunks", None)
        order = "" if chunks is None else f"chunks{chunks}"
    return order + _partition_tag(getattr(module, "explicit_parts", None))


def _partition_tag(parts) -> str:
    """Another pipeline layout holds other layers on each rank, so its rank files do not map either:
    "+layout<blocks per stage>" unless the partition is the uniform one (what checkpoints written
    before --pipeline-layout hold, which keep loading without resharding)."""
    if not parts:
        return ""
    from mtds.parallel.pipeline_layout import uniform_layout
    blocks = [b - a for a, b in zip(parts, parts[1:])]
    blocks[0] -= 1                  # the embedding
    blocks[-1] -= 2                 # final norm and head
    if blocks == list(uniform_layout(sum(blocks), len(blocks)).blocks):
        return ""
    return "+layout" + "-".join(map(str, blocks))


def _check_expert_layout(meta: CheckpointMeta, engine, groups: ParallelGroups, tag_dir: str) -> None:
    """Mixture-of-experts checkpoints reshard between ZeRO-1/2 runs of one precision (fp32, bf16), at any t, p, d
    and E, and from or into fp32 ZeRO-0 at p = 1 (mtds.checkpoint.expert_layout): the ZeRO stage and precision are
    an engine's."""
    problem = None
    if meta.model_config.num_experts and _needs_reshard(meta, engine, groups):
        problem = reshard_problem(meta, groups.layout, _zero_stage(engine), _precision(engine), tag_dir)
    if problem:
        raise CheckpointError(problem)


def _needs_reshard(meta: CheckpointMeta, engine, groups: ParallelGroups) -> bool:
    layout = groups.layout
    if (meta.tp, meta.pp, meta.ep) != (layout.tp, layout.pp, layout.ep) or meta.zero_stage != _zero_stage(engine):
        return True
    if meta.module_order != _module_order(engine):     # another schedule / v: same weights, other order
        return True
    # ZeRO-1/2 partition the optimizer state over d: another d needs re-partitioning; at E > 1 so does ZeRO-0's
    # (each data rank's files are its EP shard's, and only the resharding path is checked at another d)
    return (meta.zero_stage > 0 or max(meta.ep, layout.ep) > 1) and meta.dp != layout.dp_cp


def load(engine, directory: str, groups: ParallelGroups, *, model_cfg: ModelConfig | None = None,
         rng_tracker=None, log=print) -> tuple[int, dict]:
    """Resume ``engine`` from the newest complete checkpoint in ``directory`` (or that tag folder) at any
    layout; return (step, client_state). Skipped incomplete checkpoints are reported through ``log``."""
    if not os.path.isdir(directory):
        raise CheckpointError(f"checkpoint directory {directory!r} does not exist: check --load")
    _durable(engine)
    directory, tag, meta = _choose(directory, log, engine.device)
    if meta is not None:
        _check_model(meta, model_cfg, directory)
    if meta is not None and meta.weights_only:
        return _load_weights_only(engine, directory, tag, meta, groups, model_cfg)
    if meta is not None:
        _check_expert_layout(meta, engine, groups, os.path.join(directory, tag))
    same_layout = meta is None or not _needs_reshard(meta, engine, groups)
    if same_layout:
        path, state = _deepspeed_load(engine, directory, tag)
    else:
        path, state = _load_resharded(engine, directory, tag, meta, groups, log)
    step = int(state.get("mtds_step", engine.global_steps))
    own = rank_manifest(os.path.join(directory, tag), dist.get_rank())
    rng = safe_load(own)["rng"] if os.path.isfile(own) else None
    if rng is not None and not tracker_fits(rng, rng_tracker):
        restart_foreign_streams(rng, rng_tracker, step, groups.tp_rank, log)
    elif same_layout and meta is not None and meta.dp == groups.layout.dp_cp and rng is not None:
        set_rng_state(rng, rng_tracker)     # this very rank's streams: exact resume
    else:
        if state.get("mtds_rng"):
            set_rng_state(state["mtds_rng"])
        if rng_tracker is not None:
            reseed_tracker(rng_tracker, step, groups.tp_rank)
    return step, state


def tracker_fits(rng: dict, tracker) -> bool:
    """Whether a rank's saved tracker states can be set on ``tracker`` (same device type; none saved fits)."""
    return tracker is None or not rng.get("tracker") or tracker.accepts(rng["tracker"])


def restart_foreign_streams(rng: dict, tracker, step: int, tp_rank: int, log=print) -> None:
    """A checkpoint saved on another device type (CPU resumed on GPUs, or back): its tracker states are
    another generator's and cannot be set here (``torch.cuda.set_rng_state`` of a CPU state fails at the
    first dropout outside a keyed layer); the default generator's CPU state is restored, and the tracker's
    streams restart from a seed, deterministically, as after a layout change."""
    set_rng_state({**rng, "tracker": None})
    reseed_tracker(tracker, step, tp_rank)
    log(f"checkpoint: its dropout RNG states are another device type's (saved on "
        f"{'CPU' if tracker.device_type == 'cuda' else 'GPU'}): dropout streams restart from a seed")


def reseed_tracker(tracker, step: int, tp_rank: int) -> None:
    """After a layout change the saved per-TP-rank dropout streams do not map onto the new ranks: every
    stream restarts from a seed derived from its saved-at-start state, the step and the new TP rank, so
    the resumed run is deterministic (though not the continuation of any saved stream)."""
    device = "cuda" if tracker.device_type == "cuda" else "cpu"
    states = {}
    for name, state in tracker.get_states().items():
        digest = hashlib.sha256(state.cpu().numpy().tobytes() + f"{step}/{tp_rank}".encode()).digest()
        states[name] = torch.Generator(device=device).manual_seed(int.from_bytes(digest[:8], "little") >> 1).get_state()
    tracker.set_states(states)


def _deepspeed_load(engine, directory: str, tag: str, **kwargs) -> tuple[str, dict]:
    try:
        path, state = engine.load_checkpoint(directory, tag=tag, **{"load_optimizer_states": True,
                                                                     "load_lr_scheduler_states": True, **kwargs})
    except Exception as err:  # DeepSpeed raises many kinds; the user needs to know which file is bad
        raise CheckpointError(f"cannot load checkpoint from {directory!r} ({type(err).__name__}: {_one_line(err)}); "
                              f"it may be partial or corrupt, or saved with a different model") from None
    if path is None or state is None:
        raise CheckpointError(f"no loadable checkpoint in {directory!r}: DeepSpeed found none for tag {tag!r}")
    return path, state


def _convert_then_verify(directory: str, tag: str, device, log) -> None:
    """Rank 0 converts the checkpoint to universal once (DeepSpeed's converter; mtds.checkpoint.reshard_zero0 for
    ZeRO-0) while the other ranks wait on the rendezvous store -- not in a collective, whose timeout a
    large conversion would outlast. Then rank 0 lists the universal files, every rank verifies a
    byte-balanced share of them with the safe unpickler (DeepSpeed's universal loader uses a plain
    torch.load), and the ranks agree."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def convert() -> None:
        try:
            ensure_universal(directory, tag)
        except ValueError as err:       # CheckpointFormatError
            raise CheckpointError(_one_line(err)) from None

    leader_first(convert, leader=rank == 0, scope="universal", error=CheckpointError, rank=rank,
                 waiting_for=f"rank 0 to convert {tag} in {directory} to a universal checkpoint",
                 failure=f"rank 0 could not convert {tag} in {directory} to a universal checkpoint",
                 log=lambda line: log(f"checkpoint: {line}"))
    # Rank 0 lists the folder once (a stat per file) and hands the listing out, as _choose does: every
    # rank walking a shared filesystem would be world x files metadata requests.
    listing = [None]
    if rank == 0:
        universal = universal_dir(directory, tag)
        listing[0] = {path: (os.path.getsize(path), None)
                      for path in glob.glob(os.path.join(universal, "**", "*.pt"), recursive=True)}
    dist.broadcast_object_list(listing, src=0)
    files = listing[0]
    problem = None
    try:
        verify_loadable(sorted(share(files, rank, world)))
    except ValueError as err:           # UnsafeCheckpointError, UnreadableFileError
        problem = _one_line(err)
    problem = _first_problem(problem, device)
    if problem is not None:
        raise CheckpointError(problem)


def _load_resharded(engine, directory: str, tag: str, meta: CheckpointMeta, groups: ParallelGroups, log):
    """Another layout: a universal checkpoint (converted once by rank 0; ZeRO-0 checkpoints by
    mtds.checkpoint.reshard_zero0 in DeepSpeed's format), loaded by DeepSpeed into ZeRO-1/2 engines and by us into
    ZeRO-0 ones (DeepSpeed cannot)."""
    target_zero = _zero_stage(engine)
    if target_zero == 0 and _precision(engine) != "fp32":
        raise CheckpointError(f"resharding into a {_precision(engine)} run without ZeRO is not supported: use "
                              f"ZeRO-1 (any layout) or resume at tp={meta.tp} pp={meta.pp}")
    _convert_then_verify(directory, tag, engine.device, log)
    universal = universal_dir(directory, tag)
    if target_zero == 0:
        return _load_universal_zero0(engine, universal, os.path.join(directory, tag), meta, groups)
    if meta.model_config.num_experts:
        _check_expert_slicing(groups, engine.device)
    with loading_universal(engine), scheduler_fits_groups(engine):     # MoE: E > 1 has one param group more
        return _deepspeed_load(engine, directory, os.path.basename(universal))


def _check_expert_slicing(groups: ParallelGroups, device) -> None:
    """DeepSpeed's universal load slices each rank's experts by its own notion of the EP rank (its largest expert
    group): it must be the shard mtds placed on this rank, or the rank would train another shard's experts."""
    from mtds.deepspeed_compat.expert_universal import universal_ep_rank
    theirs, mine = universal_ep_rank(), (groups.ep_rank, groups.layout.ep)
    problem = None if theirs == mine else (
        f"DeepSpeed's universal load would give this rank the experts of EP shard {theirs[0]} of {theirs[1]}, but it "
        f"holds shard {mine[0]} of {mine[1]}: its expert groups are not this run's; start a new process")
    problem = _first_problem(problem, device)
    if problem is not None:
        raise CheckpointError(problem)


# Keys of an engine file that are DeepSpeed's, not client_state.
_ENGINE_KEYS = ("module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
                "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
                "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config",
                "ds_version", "checkpoint_parallel_dimensions")


def _load_universal_zero0(engine, universal: str, tag_dir: str, meta: CheckpointMeta, groups: ParallelGroups):
    """What DeepSpeed's load would do, for an engine without ZeRO: weights and Adam state from the
    universal folder, step/scheduler/client state from the saved engine file (identical on all ranks)."""
    try:
        load_universal_into_zero0(engine, universal, meta.model_config, groups.layout.tp, groups.tp_rank,
                                  groups.layout.ep, groups.ep_rank)
    except CheckpointFormatError as err:
        raise CheckpointError(str(err)) from None
    state = safe_load(os.path.join(tag_dir, "mp_rank_00_model_states.pt"))
    if engine.lr_scheduler is not None and state.get("lr_scheduler") is not None:
        with scheduler_fits_groups(engine):     # an MoE run at E > 1 has one param group more (dense, experts)
            engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
        # A scheduler sets the optimizer's lr only when it steps: the next step must use the saved lr.
        for group, lr in zip(engine.optimizer.param_groups, engine.lr_scheduler.get_last_lr()):
            group["lr"] = lr
    engine.global_steps = state["global_steps"]
    engine.global_samples = state.get("global_samples", engine.global_steps * engine.train_batch_size())
    engine.skipped_steps = state["skipped_steps"]
    return universal, {k: v for k, v in state.items() if k not in _ENGINE_KEYS}


def _load_weights_only(engine, directory: str, tag: str, meta: CheckpointMeta, groups: ParallelGroups,
                       model_cfg: ModelConfig | None) -> tuple[int, dict]:
    layout = groups.layout
    # at E > 1 DeepSpeed's MoE load would look for per-expert files: the logical tensors, sliced per rank, instead
    if (meta.tp, meta.pp) == (layout.tp, layout.pp) and _zero_stage(engine) < 3 and layout.ep == 1:
        _deepspeed_load(engine, directory, tag, load_optimizer_states=False, load_lr_scheduler_states=False,
                        load_module_only=True)
        return 0, {}
    if model_cfg is None or _zero_stage(engine) == 3:
        raise CheckpointError(f"{directory!r} holds weights for tp={meta.tp} pp={meta.pp}; convert again with "
                              f"mtds-convert hf-to-mtds --tp {layout.tp} --pp {layout.pp}")
    # Another layout: every rank reads its layers from the logical tensors, then the optimizer's
    # fp32 master copy (ZeRO-1/2, bf16) is refreshed from the new module weights.
    from mtds.checkpoint.reshard_load import load_checkpoint_into_stages
    load_checkpoint_into_stages(engine.module, os.path.join(directory, tag), model_cfg, groups.tp_group)
    refresh_master_weights(engine)
    return 0, {}
