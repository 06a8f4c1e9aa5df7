"""HF <-> mtds weight tables are exact permutations; checkpoints load from every on-disk layout; export works."""
import json

import pytest
import torch

from mtds.hf.resolve import resolve_model_config
from mtds.hf import (UnsupportedHFConfig, hf_config_from_model_config, hf_state_to_layers, layers_to_hf_state,
                     load_hf_into_model, model_config_from_hf, model_to_hf_state, save_hf_checkpoint)
from mtds.model import GPTModel
from tests.test_hf_cases import hf_model, input_ids

NAMES = ["gpt2", "gpt2_gelu", "neox", "neox_seq", "llama", "llama_tied", "llama_bias"]
# transformers 5 calls NeoX's head lm_head in memory; checkpoints on disk (and our export) say embed_out.
RENAMED = {"lm_head.weight": "embed_out.weight"}


def _canonical_hf_state(name, hf):
    state = hf.state_dict()
    if hf.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)   # tied copy: not a separate tensor on disk either
    if name.startswith("neox"):
        state = {RENAMED.get(k, k): v for k, v in state.items()}
    return state


@pytest.mark.parametrize("name", NAMES)
def test_state_round_trip_is_bit_exact(name):
    hf = hf_model(name)
    cfg = model_config_from_hf(hf.config)
    state = _canonical_hf_state(name, hf)
    seen = []

    def get(key):
        seen.append(key)
        return state[key]

    layers = hf_state_to_layers(cfg, get)
    first_index, first = next(layers)           # lazy: only layer 0's tensors have been read
    assert first_index == 0 and all(k in ("transformer.wte.weight", "transformer.wpe.weight",
                                          "gpt_neox.embed_in.weight", "model.embed_tokens.weight") for k in seen)
    back = layers_to_hf_state(cfg, [(first_index, first), *layers])
    assert sorted(back) == sorted(state)
    for key, tensor in state.items():
        assert torch.equal(back[key], tensor), key


def _logits(model, ids):
    with torch.no_grad():
        return model.full_logits(ids)


@pytest.mark.parametrize("layout", ["safetensors", "sharded", "bin"])
def test_load_from_checkpoint_dirs(tmp_path, layout):
    hf = hf_model("llama")
    if layout == "bin":
        hf.config.save_pretrained(tmp_path)
        torch.save(hf.state_dict(), tmp_path / "pytorch_model.bin")
    else:
        hf.save_pretrained(tmp_path, max_shard_size="40KB" if layout == "sharded" else "1GB")
    if layout == "sharded":
        assert (tmp_path / "model.safetensors.index.json").exists()
    cfg = resolve_model_config(str(tmp_path))           # directory holding config.json
    assert cfg == model_config_from_hf(hf.config)
    model = GPTModel(cfg).eval()
    load_hf_into_model(model, str(tmp_path))
    ids = input_ids()
    assert (_logits(model, ids) - hf(ids).logits.detach()).abs().max() < 1e-5


def test_gpt2_checkpoint_without_base_prefix_loads():
    hf = hf_model("gpt2")   # old hub GPT-2 checkpoints store "h.0.attn..." without "transformer."
    state = {k.removeprefix("transformer."): v for k, v in hf.state_dict().items()}
    model = GPTModel(model_config_from_hf(hf.config)).eval()
    load_hf_into_model(model, state)
    ids = input_ids()
    assert (_logits(model, ids) - hf(ids).logits.detach()).abs().max() < 1e-5


def test_unexpected_and_missing_tensors_are_refused():
    hf = hf_model("llama")
    cfg = model_config_from_hf(hf.config)
    extra = {**hf.state_dict(), "model.layers.0.self_attn.q_norm.weight": torch.ones(16)}
    with pytest.raises(UnsupportedHFConfig, match="q_norm"):
        load_hf_into_model(GPTModel(cfg), extra)
    missing = {k: v for k, v in hf.state_dict().items() if "down_proj" not in k}
    with pytest.raises(KeyError, match="down_proj"):
        load_hf_into_model(GPTModel(cfg), missing)


@pytest.mark.parametrize("source", ["gpt2-tiny", "neox", "llama"])
def test_export_to_transformers(tmp_path, source):
    import transformers as T
    if source == "gpt2-tiny":   # our own init, exported
        cfg = resolve_model_config("gpt2-tiny", num_layers=2, vocab_size=250, max_position_embeddings=32)
        model = GPTModel(cfg, seed=5).eval()
    else:                       # imported, then exported again
        hf = hf_model(source)
        cfg = model_config_from_hf(hf.config)
        model = GPTModel(cfg).eval()
        load_hf_into_model(model, hf.state_dict())
    hf_cfg = hf_config_from_model_config(cfg)
    assert model_config_from_hf(hf_cfg) == cfg            # config survives the round trip
    save_hf_checkpoint(cfg, model_to_hf_state(model), str(tmp_path))
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == cfg.architecture
    back = T.AutoModelForCausalLM.from_pretrained(str(tmp_path), attn_implementation="eager").float().eval()
    ids = input_ids()
    assert (_logits(model, ids) - back(ids).logits.detach()).abs().max() < 1e-5


def test_load_only_one_pipeline_stage_layers():
    """A pipeline stage loads just its global layers and reads no other tensor."""
    from mtds.hf import load_hf_into_modules
    from mtds.model import FinalNorm, LMHead, TransformerLayer
    hf = hf_model("llama")
    cfg = model_config_from_hf(hf.config)
    state = hf.state_dict()
    read = []

    class Tracking(dict):
        def __getitem__(self, key):
            read.append(key)
            return super().__getitem__(key)

    stage = {2: TransformerLayer(cfg, 2), 3: FinalNorm(cfg), 4: LMHead(cfg)}
    load_hf_into_modules(cfg, stage, Tracking(state))
    assert read and all(k.startswith("model.layers.1.") or k in ("model.norm.weight", "lm_head.weight") for k in read)
    full = GPTModel(cfg)
    load_hf_into_model(full, state)
    for index, module in stage.items():
        for (n1, p1), (n2, p2) in zip(module.named_parameters(), full.global_layers()[index].named_parameters(),
                                      strict=True):
            assert n1 == n2 and torch.equal(p1, p2), (index, n1)
