"""Packed documents (--reset-position-ids, --reset-attention-mask) against HF, fp32, one process.

A batch of documents packed back to back, each ended by EOD: with both resets, the logits and the loss
of every document equal HF's run on that document alone; with one reset, HF's run given the positions
(and for the mask alone, the document) that reset implies. GPT-2 (learned positions) and Llama
(rotary, GQA). The multi-rank case (TP, pipeline, sequence parallelism) is in tests/test_parity.py.
"""
import pytest
import torch

from mtds.hf import load_hf_into_model, model_config_from_hf
from mtds.model import GPTModel
from mtds.model.documents import DocumentMasking, document_mask, document_positions, segment_ids
from tests.test_hf_cases import VOCAB, hf_model

EOD = 1   # hf_config's eos_token_id
TOL = 1e-5


def packed_batch() -> torch.Tensor:
    """Two rows of 24 tokens: documents of 1..9 tokens each ended by EOD, the last one cut off; the
    second row starts with an EOD (a one-token document) and has two EODs in a row."""
    g = torch.Generator().manual_seed(3)
    rows = []
    for lengths in ([5, 9, 3, 9], [1, 6, 1, 4, 8, 6]):
        row = []
        for n in lengths:
            row += torch.randint(2, VOCAB, (n - 1,), generator=g).tolist() + [EOD]
        rows.append(row[:24])
    return torch.tensor(rows)


def spans(row: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each document in a row, the EOD included in the document it ends."""
    ends = [i + 1 for i, t in enumerate(row.tolist()) if t == EOD]
    starts = [0] + ends
    return [(a, b) for a, b in zip(starts, ends + [len(row)]) if b > a]


def megatron_reference(ids: torch.Tensor):
    """Megatron's get_ltor_masks_and_position_ids, written as its loops: per EOD at i, rows i+1..
    lose columns ..i, and positions i+1.. restart at 0."""
    b, s = ids.shape
    mask = torch.ones(b, s, s, dtype=torch.bool).tril()
    positions = torch.arange(s).repeat(b, 1)
    for r in range(b):
        prev = 0
        for i in range(s):
            if ids[r, i] == EOD:
                mask[r, i + 1:, :i + 1] = False
                positions[r, i + 1:] -= i + 1 - prev
                prev = i + 1
    return mask[:, None], positions


def test_segments_positions_and_mask_are_megatrons():
    ids = packed_batch()
    mask, positions = megatron_reference(ids)
    segments = segment_ids(ids, EOD)
    assert torch.equal(document_positions(segments), positions)
    assert torch.equal(document_mask(segments), mask)


def ours(name: str, reset_position_ids: bool, reset_attention_mask: bool):
    hf = hf_model(name)
    docs = DocumentMasking(EOD, reset_position_ids=reset_position_ids, reset_attention_mask=reset_attention_mask)
    model = GPTModel(model_config_from_hf(hf.config), seed=5, documents=docs).eval()
    load_hf_into_model(model, hf.state_dict())
    return hf, model


# mistral_window: a window of 8 inside documents of up to 9 tokens, the two masks combined
@pytest.mark.parametrize("name", ["gpt2", "llama", "mistral_window"])
@torch.no_grad()
def test_each_packed_document_matches_hf_alone(name):
    hf, model = ours(name, True, True)
    ids = packed_batch()
    logits = model.full_logits(ids)
    checked = 0
    for r in range(ids.shape[0]):
        for a, b in spans(ids[r]):
            doc = ids[r:r + 1, a:b]
            want = hf(doc).logits[0]
            err = float((logits[r, a:b] - want).abs().max())
            assert err < TOL, (name, r, a, b, err)
            if b - a > 1:
                # the loss of this document alone: labels only on its own next tokens
                labels = torch.full_like(ids, -100)
                labels[r, a:b - 1] = ids[r, a + 1:b]
                loss = float(model(ids, labels))
                assert abs(loss - float(hf(doc, labels=doc).loss)) < TOL, (name, r, a, b)
                checked += 1
    assert checked == 8


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@torch.no_grad()
def test_one_reset_alone_matches_hf_given_its_positions(name):
    ids = packed_batch()
    mask, positions = megatron_reference(ids)
    # positions reset, attention across documents: HF on whole rows with those positions
    hf, model = ours(name, True, False)
    want = hf(ids, position_ids=positions).logits
    assert float((model.full_logits(ids) - want).abs().max()) < TOL, name
    assert float((hf(ids).logits - want).abs().max()) > 1e-2     # the positions did change something
    # mask only: each document alone, at the positions it has in the row
    hf, model = ours(name, False, True)
    logits = model.full_logits(ids)
    for r in range(ids.shape[0]):
        for a, b in spans(ids[r]):
            want = hf(ids[r:r + 1, a:b], position_ids=torch.arange(a, b)[None]).logits[0]
            assert float((logits[r, a:b] - want).abs().max()) < TOL, (name, r, a, b)


def test_a_block_without_the_document_ids_refuses_to_run():
    """A block (a later pipeline stage) whose input lost the ids says so, in one line."""
    hf, model = ours("gpt2", True, True)
    with pytest.raises(RuntimeError, match="packed-document ids did not arrive"):
        model.layers[1](torch.zeros(1, 4, hf.config.n_embd))


def test_recomputation_keeps_the_document_ids():
    """Full (whole blocks, the ids among the checkpointed inputs) and selective (the attention core)
    recomputation give the same loss and gradients as none, with both resets on."""
    from types import SimpleNamespace

    from mtds.pipe.module import SequentialGPT
    cfg = model_config_from_hf(hf_model("llama").config)
    docs = DocumentMasking(EOD, reset_position_ids=True, reset_attention_mask=True)
    ids = packed_batch()
    labels = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    results = []
    for extra in ({}, {"recompute_interval": 1}, {"recompute_attention": True}):
        model = SequentialGPT(cfg, SimpleNamespace(tp_group=None, ep_group=None), seed=5, rng_tracker=None, documents=docs, **extra)
        loss = model.train()(ids, labels)
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    for loss, grads in results[1:]:
        assert torch.equal(loss, results[0][0])
        assert all(torch.allclose(g, g0, atol=1e-7) for g, g0 in zip(grads, results[0][1]))
