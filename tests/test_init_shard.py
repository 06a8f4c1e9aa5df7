"""Per-shard initialisation (mtds/tp/init_shard.py): every rank's shard holds exactly the values of
today's full-tensor fill (bit for bit, for every t), the generator ends in the same state, and no tensor
the size of the full weight is ever allocated."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mtds.tp import init_shard
from mtds.tp.init_shard import NormalInit, build_shard
from mtds.tp import shard_rows


def full_fill_then_slice(shape, dim, world, rank, init, segments=None, valid_rows=None):
    """The old path: fill the whole tensor (padding rows zero), keep this rank's slice."""
    full = torch.zeros(shape)
    init(full[:valid_rows if valid_rows is not None else shape[0]])
    return shard_rows(full, dim, world, rank, segments)


CASES = [
    # shape, dim, segments, valid_rows
    ((96, 40), 0, None, None),              # column parallel
    ((96, 40), 1, None, None),              # row parallel
    ((3 * 32, 24), 0, (32, 32, 32), None),  # fused q|k|v: each segment split separately
    ((64 + 32, 20), 0, (64, 32), None),     # GQA-like uneven segments
    ((136, 12), 0, None, 130),              # padded vocabulary: rows 130.. are zero and draw nothing
    ((40, 3), 0, None, None),               # 3-element rows: chunks of 16 rows
    ((8, 1), 0, None, None),                # fewer than 16 elements: the scalar path
    ((36, 1), 0, None, None),               # a last chunk of 4 elements joins the one before
]


@pytest.mark.parametrize("shape,dim,segments,valid", CASES)
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("chunk", [16, 100, 1 << 20])
def test_shard_equals_full_fill_and_generator_agrees(shape, dim, segments, valid, world, chunk):
    init = NormalInit(std=0.02)
    for rank in range(world):
        torch.manual_seed(7)
        want = full_fill_then_slice(shape, dim, world, rank, init, segments, valid)
        after_want = torch.randn(33)
        torch.manual_seed(7)
        got = build_shard(shape, dim, world, rank, init, segments, valid, chunk_elements=chunk)
        after_got = torch.randn(33)
        assert torch.equal(got, want), (shape, dim, world, rank, chunk)
        assert torch.equal(after_got, after_want), "the generator must end where the full fill leaves it"


class _LargestAllocation(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor):
            self.largest = max(self.largest, out.numel())
        return out


@pytest.mark.parametrize("dim", [0, 1])
def test_never_allocates_the_full_weight(dim):
    shape, world, chunk = (512, 256), 4, 4096      # full 131072 elements, shard 32768, chunk 4096
    with _LargestAllocation() as mode:
        build_shard(shape, dim, world, 1, NormalInit(0.02), chunk_elements=chunk)
    assert mode.largest <= shape[0] * shape[1] // world, mode.largest


def test_other_init_methods_still_fill_the_full_tensor():
    """A custom callable is not known to be chunkable: it sees the full tensor, as before."""
    seen = []
    build_shard((32, 8), 0, 2, 0, lambda t: seen.append(tuple(t.shape)) or t.fill_(1.0))
    assert seen == [(32, 8)]


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_tiny_model_is_unchanged(monkeypatch, family):
    """A whole model (every init path: embeddings, fused qkv, MLP, untied LM head) built chunk by chunk
    with tiny chunks equals the model built from full-tensor fills."""
    from mtds.model import GPTModel
    from mtds.model.config import ModelConfig

    extra = dict(num_kv_heads=2, activation="swiglu", normalization="rmsnorm", position_embedding="rotary",
                 qkv_bias=False, linear_bias=False) if family == "llama" else {}
    cfg = ModelConfig(vocab_size=101, hidden_size=32, num_layers=2, num_heads=4, max_position_embeddings=16,
                      tie_word_embeddings=False, **extra)
    monkeypatch.setattr(init_shard, "DEFAULT_CHUNK_ELEMENTS", 64)
    chunked = {k: v.clone() for k, v in GPTModel(cfg, seed=5).state_dict().items()}
    monkeypatch.setattr(init_shard, "NormalInit", type("NotChunkable", (), {}))   # every fill takes the full path
    full = GPTModel(cfg, seed=5).state_dict()
    assert chunked.keys() == full.keys()
    for name in full:
        assert torch.equal(chunked[name], full[name]), name
