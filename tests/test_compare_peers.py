"""The peers as schemes of `python -m compare run`: Megatron-core (megatron:tp=T,pp=P) and torchtitan
(torchtitan:tp=T,fsdp=F), run in their own interpreter (`make peers`), never imported by mtds.

Always: the scheme specs and their refusals, and the one line a missing peer gets (how to install it).
Where the peers are installed: one small real run of each on this host, on the samples mtds trains on,
checked for equal work (the same parameter count as mtds's model of the config, a first-step loss where the
peer's initialisation puts it, Megatron-core's loss falling) and for the version and shims its table names. Where they
are not (CI), these skip, saying why.
"""
import json
import math
import os

import pytest

from compare.peer_launch import peer_missing
from compare.schemes import parse_scheme

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_peer_scheme_specs():
    m = parse_scheme("megatron:tp=2,pp=2")
    assert (m.kind, m.tp, m.pp, m.name, m.peer, m.zero_stage) == ("megatron", 2, 2, "megatron-t2p2", True, 1)
    assert m.data_parallel(8) == 2
    t = parse_scheme("torchtitan:tp=2,fsdp=2")
    assert (t.kind, t.tp, t.fsdp, t.name, t.zero_stage) == ("torchtitan", 2, 2, "torchtitan-t2f2", 3)
    assert t.data_parallel(4) == 2
    with pytest.raises(ValueError, match="tp x fsdp = 4 must equal the 8 ranks"):
        t.data_parallel(8)
    assert not parse_scheme("ptdp:tp=2").peer
    for bad, why in (("torchtitan:pp=2", "pipeline schedules are not wired"),
                     ("megatron:fsdp=2", "fsdp= is torchtitan's"),
                     ("megatron:tp=2,sp=1", "not wired for them"),
                     ("ptdp:fsdp=2", "fsdp= is the FSDP degree of torchtitan"),
                     ("megatron:grad_reduce=all-reduce", "grad_reduce="),
                     ("torchtitan:fsdp=0", "positive FSDP degree"),
                     ("deepspeed-moe", "megatron\\[:tp=T,pp=P\\] or torchtitan")):
        with pytest.raises(ValueError, match=why):
            parse_scheme(bad)


def test_torchtitan_trains_a_llama():
    from compare.schemes import for_run
    assert for_run(parse_scheme("torchtitan:tp=2"), "gpt2-tiny").model == "llama-tiny"
    assert for_run(parse_scheme("torchtitan:tp=2"), os.path.join(REPO, "compare", "llama_tiny.json")).model == ""
    assert for_run(parse_scheme("megatron:tp=2"), "gpt2-tiny").model == ""


def test_a_missing_peer_is_one_line_saying_how_to_get_it(tmp_path, monkeypatch, capsys):
    import sys

    from compare.cli import main
    monkeypatch.setenv("PEERS_PYTHON", str(tmp_path / "no-python"))
    why = peer_missing("megatron")
    assert why.startswith("megatron: no peers' interpreter at") and "make peers" in why and "\n" not in why
    monkeypatch.setenv("PEERS_PYTHON", sys.executable)        # an interpreter without the peer
    assert peer_missing("torchtitan") == (f"torchtitan: torchtitan is not installed in {sys.executable}: install "
                                          f"the peers with `make peers` (their own venv under $PEERS_WORK), or set "
                                          f"PEERS_PYTHON")
    # refused before anything starts, with that line
    assert main(["run", "--schemes", "ptdp:tp=2", "torchtitan:tp=2", "--nproc", "2", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {peer_missing('torchtitan')}"]
    assert not os.listdir(tmp_path)


TINY_GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 8192, "n_positions": 32,
             "activation_function": "gelu_new", "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
             "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True}
TINY_LLAMA = {"model_type": "llama", "vocab_size": 8192, "hidden_size": 64, "intermediate_size": 176,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
              "max_position_embeddings": 32, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}


def _mtds_parameters(config_path: str) -> int:
    import torch

    from mtds.hf.resolve import resolve_model_config
    from mtds.model import GPTModel
    with torch.device("meta"):
        return sum(p.numel() for p in GPTModel(resolve_model_config(config_path)).parameters())


@pytest.mark.parametrize("spec,config", [("megatron:tp=2", TINY_GPT2), ("torchtitan:fsdp=2", TINY_LLAMA)])
def test_a_peer_scheme_runs_the_same_job(spec, config, tmp_path):
    scheme = parse_scheme(spec)
    why = peer_missing(scheme.kind)
    if why:
        pytest.skip(why)
    from compare.peer_launch import launch_peer
    from compare.table import markdown, summarise
    model = tmp_path / "config.json"
    model.write_text(json.dumps(config))
    launched = launch_peer(scheme, nproc=2, model=str(model), steps=3, seq_length=32, out_dir=str(tmp_path / "run"),
                           global_batch=4, micro_batch=2, timeout=300)
    row = summarise(launched)
    assert row["parameters"] == _mtds_parameters(str(model))           # equal work: the same model size
    name = {"megatron": "megatron-core 0.19.2", "torchtitan": "torchtitan 0.3.0"}[scheme.kind]
    assert row["framework"] == name and row["patches"]
    # First-step loss, before any update: Megatron-core initialises as mtds does (normal, std 0.02), so its
    # logits are ~0 and the loss ln V; torchtitan's output projection has std dim^-1/2 on unit-RMS hidden
    # states, logits of std <= 1, so E[loss] <= ln V + 1/2.
    first, ln_v = row["losses"][0], math.log(config["vocab_size"])
    if scheme.kind == "megatron":
        assert abs(first - ln_v) < 0.02 * ln_v, row["losses"]
    else:
        assert ln_v - 0.02 * ln_v < first < ln_v + 0.5, row["losses"]
    # torchtitan's larger initial logits take more than 3 steps to come down (they do by step 8; measured)
    assert row["losses"][-1] < first or scheme.kind == "torchtitan", row["losses"]
    assert all(math.isfinite(x) for x in row["losses"])
    assert row["tokens_per_s"] > 0 and 0 < row["cpu_s_per_step"] < 60      # the peer's CPU per step, as mtds's
    text = markdown([row], {"nproc": 2, "model": "tiny", "steps": 3, "seq_length": 32})
    assert name in text and row["patches"][0] in text
