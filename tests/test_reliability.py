"""Checkpoints that are complete or absent, exact resume, and loads that never run a file's code.

One launch of 4 gloo ranks trains with dropout at (t,p,d) = (2,2,1) ZeRO-1 and (2,1,2) ZeRO-0, saves,
resumes from a mid-run checkpoint and compares every later loss and grad norm bit for bit; it also
loads a checkpoint whose pickle would run ``os.system``. The saved folders then serve the in-process
checks of what --load does with incomplete or corrupt checkpoints.
"""
import os
import pathlib
import shutil

import pytest
import torch

from mtds.checkpoint.complete import MARKER, find_complete, rank_manifest
from mtds.checkpoint.safe_load import UnsafeCheckpointError, safe_load
from lab.testing import spawn
from tests.training_helpers import TINY, ds_config, train_config

DROPOUT = TINY.__class__(**{**TINY.__dict__, "hidden_dropout": 0.1, "attention_dropout": 0.1})


class _Evil:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def plant_code(tag_dir: str, name: str, marker: str) -> None:
    """Replace ``name`` in a complete checkpoint with a pickle that runs a shell command, and fix the
    manifest (size, CRC) so only the unpickler can tell."""
    from mtds.checkpoint.commit import describe_files, write_manifest
    path = os.path.join(tag_dir, name)
    state = safe_load(path)
    state["payload"] = _Evil(marker)
    torch.save(state, path)
    for rank in range(64):
        manifest = rank_manifest(tag_dir, rank)
        if not os.path.isfile(manifest):
            break
        content = safe_load(manifest)
        if name in content["files"]:
            content["files"].update(describe_files(tag_dir, [name]))
            write_manifest(tag_dir, rank, content["files"], content["rng"])


def _worker(root):
    import torch.distributed as dist

    from mtds.training import run
    from mtds.checkpoint.lifecycle import CheckpointError
    pipe = dict(tp=2, pp=2, model=DROPOUT, steps=6)
    plain = dict(tp=2, pp=1, model=DROPOUT, steps=6, deepspeed_config=ds_config(zero=0))
    full = run(train_config(**pipe, save=f"{root}/pipe", save_interval=3))
    resumed = run(train_config(**pipe, load=f"{root}/pipe/global_step3"))
    full_dp = run(train_config(**plain, save=f"{root}/dp", save_interval=2, keep_last=2))
    resumed_dp = run(train_config(**plain, load=f"{root}/dp"))       # newest complete: global_step6 -> nothing
    resumed_dp4 = run(train_config(**plain, load=f"{root}/dp/global_step4"))
    if dist.get_rank() == 0:
        shutil.copytree(f"{root}/pipe", f"{root}/evil")
        plant_code(f"{root}/evil/global_step6", "mp_rank_01_model_states.pt", f"{root}/PWNED")
    dist.barrier()
    try:
        run(train_config(**pipe, load=f"{root}/evil"))
        refused = None
    except (CheckpointError, ValueError) as err:
        refused = str(err)
    if dist.get_rank() == 0:
        shutil.copytree(f"{root}/pipe", f"{root}/corrupt")
        _flip_byte(pathlib.Path(f"{root}/corrupt/global_step6") / _verified_by(3, f"{root}/corrupt/global_step6"))
    dist.barrier()
    after_corruption = run(train_config(**pipe, load=f"{root}/corrupt"))
    return full, resumed, full_dp, resumed_dp, resumed_dp4, refused, after_corruption


def _verified_by(rank: int, tag_dir: str, world: int = 4) -> str:
    """The largest file whose bytes ``rank`` verifies when ``world`` ranks load ``tag_dir``."""
    from mtds.checkpoint.complete import list_files, share
    mine = share(list_files(tag_dir)[1], rank, world)
    return max(mine, key=lambda name: mine[name][0])


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("reliab"))
    return root, spawn(_worker, 4, root, timeout=400)


def test_resume_is_bit_exact_with_dropout_at_t2_p2_and_d2(saved):
    _, results = saved
    for rank, (full, resumed, full_dp, resumed_dp, resumed_dp4, *_) in enumerate(results):
        assert resumed.losses == full.losses[3:], (rank, resumed.losses, full.losses)
        assert resumed.grad_norms == full.grad_norms[3:], rank
        assert resumed_dp4.losses == full_dp.losses[4:] and resumed_dp4.grad_norms == full_dp.grad_norms[4:], rank
        assert resumed_dp.losses == []            # resumed at step 6 of 6: nothing left to do
    assert len(set(full.losses)) == 6


def test_keep_last_prunes_only_older_complete_checkpoints(saved):
    root, _ = saved
    assert sorted(n for n in os.listdir(f"{root}/dp") if n.startswith("global_step")) == \
        ["global_step4", "global_step6"]
    assert open(f"{root}/dp/latest").read() == "global_step6"


def test_a_checkpoint_that_would_run_code_is_refused(saved):
    root, results = saved
    refused = results[0][5]
    assert refused is not None and "\n" not in refused, refused
    assert "refusing to load" in refused and "system" in refused and "mp_rank_01_model_states.pt" in refused
    assert not os.path.exists(f"{root}/PWNED")
    with pytest.raises(UnsafeCheckpointError):
        find_complete(f"{root}/evil")
    assert not os.path.exists(f"{root}/PWNED")


def test_each_rank_verifies_its_share_and_a_corrupt_file_anywhere_is_skipped(saved):
    """A byte flipped in a file only rank 3 reads for verification: the four ranks agree to skip that
    checkpoint and resume from the older one (DeepSpeed would have loaded the damaged tensor)."""
    _, results = saved
    for rank, result in enumerate(results):
        full, after = result[0], result[6]
        assert after.losses == full.losses[3:] and after.grad_norms == full.grad_norms[3:], (rank, after.losses)


def test_verification_work_is_split_once_over_the_ranks():
    from mtds.checkpoint.complete import share
    files = {f"f{i}": (size, i) for i, size in enumerate([7, 100, 3, 3, 50, 49, 1, 20, 20, 0])}
    parts = [share(files, r, 3) for r in range(3)]
    assert sorted(n for part in parts for n in part) == sorted(files)          # each file exactly once
    loads = [sum(size for size, _ in part.values()) for part in parts]
    assert max(loads) <= sum(loads) / 3 + 100 and min(loads) > 0, loads
    assert parts == [share(files, r, 3) for r in range(3)]                       # deterministic


def _copy(saved, tmp_path):
    root, _ = saved
    shutil.copytree(f"{root}/pipe", tmp_path / "ck")
    return tmp_path / "ck"


@pytest.mark.parametrize("damage, reason", [
    (lambda d: os.remove(d / MARKER), "missing completion marker"),
    (lambda d: os.remove(d / "mtds_rank_00002.pt"), "missing rank file mtds_rank_00002.pt"),
    (lambda d: os.remove(d / "layer_03-model_01-model_states.pt"), "missing file layer_03-model_01-model_states.pt"),
    (lambda d: os.truncate(d / "zero_pp_rank_0_mp_rank_03_optim_states.pt", 1000), "truncated"),
    (lambda d: _flip_byte(d / "layer_04-model_00-model_states.pt"), "CRC-32"),
    (lambda d: os.remove(d / "mtds_meta.json"), "missing mtds_meta.json"),
])
def test_load_skips_an_incomplete_or_corrupt_checkpoint_and_says_why(saved, tmp_path, damage, reason):
    ck = _copy(saved, tmp_path)
    damage(ck / "global_step6")
    tag_dir, skipped = find_complete(str(ck))
    assert os.path.basename(tag_dir) == "global_step3"
    assert len(skipped) == 1 and skipped[0].startswith("skipped global_step6: ") and reason in skipped[0], skipped


def _flip_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_crash_windows_of_a_save_never_lose_a_complete_checkpoint(saved, tmp_path):
    ck = _copy(saved, tmp_path)
    # crashed while DeepSpeed wrote its files: only a staging folder, never a candidate
    shutil.copytree(ck / "global_step6", ck / "global_step9.partial")
    os.remove(ck / "global_step9.partial" / MARKER)
    assert find_complete(str(ck)) == (str(ck / "global_step6"), [])
    # crashed while replacing a checkpoint of the same step: the old one is still found
    os.rename(ck / "global_step6", ck / "global_step6.replaced")
    assert find_complete(str(ck))[0] == str(ck / "global_step6.replaced")
    # a tag folder that is incomplete is refused, with the reason
    os.remove(ck / "global_step3" / MARKER)
    with pytest.raises(ValueError, match="missing completion marker"):
        find_complete(str(ck / "global_step3"))
