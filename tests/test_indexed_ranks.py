"""Two real ranks: local rank 0 builds the blend's indices while rank 1 waits on the file (no
collective), and the DP-sharded micro-batches at dp=2 are the dp=1 global batches, in order."""
import numpy as np
import torch

from lab.testing import spawn


def _write(tmp):
    from mtds.data.indexed import IndexedWriter
    prefixes = []
    for k, (lo, n) in enumerate(((0, 70), (20_000, 30))):
        prefixes.append(f"{tmp}/src{k}")
        rng = np.random.default_rng(k)
        with IndexedWriter(prefixes[-1], np.uint16) as w:
            for _ in range(n):
                length = int(rng.integers(1, 30))
                w.add_document(np.arange(lo, lo + length))
                lo += length
    return [(0.4, prefixes[0]), (0.6, prefixes[1])]


def _stream(blend, cache, dp_rank, dp_size, builder):
    from mtds.data import MicroBatchStream
    from mtds.data.indexed.blended_dataset import build_blended
    ds = build_blended(blend, seq_length=8, num_samples=96, seed=5, builder=builder, cache_dir=cache,
                       log=lambda _: None)
    return MicroBatchStream(ds, global_batch_size=16, micro_batch_size=2, dp_rank=dp_rank, dp_size=dp_size,
                            shuffle=False)


def _rank_body(blend, cache):
    import time

    import torch.distributed as dist
    rank = dist.get_rank()
    dist.barrier()        # pooled ranks take the body at different times: start the race together
    if rank == 0:
        time.sleep(1.0)   # rank 1 reaches the cache first and must wait for the file
    began = time.time()   # rank 0: the build starts, the file cannot exist before
    stream = _stream(blend, cache, rank, 2, builder=rank == 0)
    return began, time.time(), [next(stream)[0] for _ in range(3 * stream.micro_batches_per_step)]


def test_two_ranks_build_once_and_shard_like_one(tmp_path):
    blend = _write(str(tmp_path))
    cache = str(tmp_path / "cache")
    (build_began, _, r0), (_, ready1, r1) = spawn(_rank_body, 2, blend, cache, timeout=120)
    # one host, one clock: rank 1 had its stream only after rank 0 began building, so it waited for the
    # file (a wait measured from each rank's own start would depend on when the pool handed it the body)
    assert ready1 >= build_began, (ready1, build_began)
    one = _stream(blend, cache, 0, 1, builder=False)   # the cached indices: nothing is rebuilt
    per_step = 16 // 2 // 2   # micro-batches per rank per step
    for step in range(3):
        whole = torch.cat([next(one)[0] for _ in range(8)])
        sharded = torch.cat(r0[step * per_step:(step + 1) * per_step] + r1[step * per_step:(step + 1) * per_step])
        assert torch.equal(whole, sharded)
