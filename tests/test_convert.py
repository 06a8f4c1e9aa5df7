"""mtds-convert: HF -> mtds checkpoint at (t, p) -> HF is bit-exact; from_pretrained loads the export;
bad inputs fail with one line and a non-zero exit status."""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from mtds.cli.convert import main as convert
from tests.test_hf_cases import hf_model, input_ids

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _save_hf(tmp_path, name, **kwargs):
    hf = hf_model(name)
    hf.save_pretrained(tmp_path / "hf", **kwargs)
    return hf, str(tmp_path / "hf")


def _weights(directory):
    files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))
    state = {}
    for f in files:
        state.update(load_file(os.path.join(directory, f)))
    return state


@pytest.mark.parametrize("name,tp,pp", [("gpt2", 2, 2), ("neox", 2, 2), ("llama", 2, 2), ("llama_tied", 2, 2),
                                        ("llama_bias", 2, 1), ("gpt2_gelu", 1, 1)])
def test_round_trip_is_bit_exact(tmp_path, name, tp, pp):
    _, hf_dir = _save_hf(tmp_path, name)
    convert(["hf-to-mtds", "--hf", hf_dir, "--tp", str(tp), "--pp", str(pp), "--out", str(tmp_path / "ck")])
    meta = json.loads((tmp_path / "ck" / "global_step0" / "mtds_meta.json").read_text())
    assert (meta["tp"], meta["pp"], meta["weights_only"]) == (tp, pp, True)
    convert(["mtds-to-hf", "--ckpt", str(tmp_path / "ck"), "--out", str(tmp_path / "back")])
    original, back = _weights(hf_dir), _weights(tmp_path / "back")
    assert sorted(original) == sorted(back)
    for key, tensor in original.items():
        assert torch.equal(back[key], tensor), key


def test_export_loads_with_from_pretrained_and_shards(tmp_path):
    from transformers import AutoModelForCausalLM
    hf, hf_dir = _save_hf(tmp_path, "neox", max_shard_size="40KB")      # sharded safetensors input
    assert os.path.isfile(os.path.join(hf_dir, "model.safetensors.index.json"))
    convert(["hf-to-mtds", "--hf", hf_dir, "--tp", "2", "--pp", "2", "--out", str(tmp_path / "ck")])
    convert(["mtds-to-hf", "--ckpt", str(tmp_path / "ck"), "--out", str(tmp_path / "back"),
             "--max-shard-size", "30KB"])
    assert os.path.isfile(tmp_path / "back" / "model.safetensors.index.json")   # streamed into several shards
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "back", attn_implementation="eager").eval()
    ids = input_ids()
    assert torch.equal(again(ids).logits, hf(ids).logits)


def test_bin_checkpoint_converts(tmp_path):
    hf = hf_model("gpt2")
    hf.config.save_pretrained(tmp_path / "hf")
    torch.save(hf.state_dict(), tmp_path / "hf" / "pytorch_model.bin")
    (tmp_path / "hf" / "notes.bin").write_bytes(b"not a checkpoint: must never be opened")
    convert(["hf-to-mtds", "--hf", str(tmp_path / "hf"), "--tp", "2", "--out", str(tmp_path / "ck")])
    convert(["mtds-to-hf", "--ckpt", str(tmp_path / "ck"), "--out", str(tmp_path / "back")])
    back = _weights(tmp_path / "back")
    for key, tensor in back.items():
        assert torch.equal(hf.state_dict()[key], tensor), key


def _subprocess_cli(*args):
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "mtds.cli.convert", *args], capture_output=True, text=True,
                          env=env, timeout=120)


class _Result:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def _cli(*args):
    """main() in this process (an interpreter start per case would dominate the test's time)."""
    import contextlib
    import io
    out, err, code = io.StringIO(), io.StringIO(), 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            convert(list(args))
        except SystemExit as exit_:
            code = exit_.code
        except BaseException:      # a traceback is a failure of the one-line contract
            import traceback
            traceback.print_exc()
            code = "Traceback"
    return _Result(code, out.getvalue(), err.getvalue())


def _assert_one_line_error(proc, *fragments):
    assert proc.returncode != 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_bad_inputs_give_one_line_errors(tmp_path):
    _, hf_dir = _save_hf(tmp_path, "llama")          # 4 heads, 2 kv heads
    # The real console entry point once; the other cases call main() in-process.
    _assert_one_line_error(_subprocess_cli("hf-to-mtds", "--hf", str(tmp_path / "nope"), "--out",
                                           str(tmp_path / "o1")), "does not exist")
    _assert_one_line_error(_cli("hf-to-mtds", "--hf", hf_dir, "--tp", "4", "--out", str(tmp_path / "o2")),
                           "key/value heads")
    _assert_one_line_error(_cli("hf-to-mtds", "--hf", hf_dir, "--tp", "3", "--out", str(tmp_path / "o3")),
                           "attention heads")
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 64}))
    _assert_one_line_error(_cli("hf-to-mtds", "--hf", str(bert), "--out", str(tmp_path / "o4")), "bert")
    empty = tmp_path / "noweights"
    empty.mkdir()
    (empty / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    _assert_one_line_error(_cli("hf-to-mtds", "--hf", str(empty), "--out", str(tmp_path / "o5")), "no HF weights")

    ck = tmp_path / "ck"
    assert _cli("hf-to-mtds", "--hf", hf_dir, "--tp", "2", "--pp", "2", "--out", str(ck)).returncode == 0
    os.remove(ck / "global_step0" / "layer_02-model_01-model_states.pt")        # partial checkpoint
    _assert_one_line_error(_cli("mtds-to-hf", "--ckpt", str(ck), "--out", str(tmp_path / "o6")),
                           "layer_02-model_01")
    assert not (tmp_path / "o6").exists()                                       # nothing written
    _assert_one_line_error(_cli("mtds-to-hf", "--ckpt", str(tmp_path / "o0"), "--out", str(tmp_path / "o7")),
                           "does not exist")
    _assert_one_line_error(_cli("mtds-to-hf", "--ckpt", hf_dir, "--out", str(tmp_path / "o8")),
                           "not an mtds checkpoint")


def _zero3_train_and_gather(root):
    """Train 3 steps under ZeRO-3 at (1,1,2) with a checkpoint at the end; return the live weights
    (every partition gathered) by mtds parameter name."""
    import deepspeed
    from mtds.training import run
    from tests.test_reshard import MODEL
    from tests.training_helpers import ds_config, train_config
    engines = []
    run(train_config(model=MODEL, steps=3, save=os.path.join(root, "z3"), save_interval=3,
                     deepspeed_config=ds_config(zero=3)),
        on_engine_ready=(lambda engine, groups: engines.append(engine),))
    params = list(engines[0].module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return {name: p.detach().clone() for name, p in engines[0].module.named_parameters()}


def _eval(argv):
    from mtds.eval import build_parser, run
    return run(build_parser().parse_args(argv))


def test_zero3_checkpoint_exports_and_evaluates(tmp_path):
    """A ZeRO-3 checkpoint (weights only in the optimizer's fp32 partitions, d = 2) exports through
    mtds-convert mtds-to-hf with the live model's weights bit for bit, and mtds-eval on the checkpoint
    gives the exported model's HF loss (1e-5)."""
    from transformers import AutoModelForCausalLM
    from mtds.hf.registry import layers_to_hf_state
    from mtds.checkpoint.names import parse
    from lab.testing import spawn
    from tests.test_reshard import MODEL
    live = spawn(_zero3_train_and_gather, 2, str(tmp_path), timeout=300)[0]
    layers = {}
    for name, tensor in live.items():
        layer, inner = parse(MODEL, name)
        layers.setdefault(layer, {})[inner] = tensor
    expected = layers_to_hf_state(MODEL, layers)
    assert _cli("mtds-to-hf", "--ckpt", str(tmp_path / "z3"), "--out", str(tmp_path / "hf")).returncode == 0
    exported = _weights(tmp_path / "hf")
    assert sorted(exported) == sorted(expected)
    for key, tensor in expected.items():
        assert torch.equal(exported[key], tensor), key

    g = torch.Generator().manual_seed(5)
    rows = [torch.randint(0, MODEL.vocab_size, (n,), generator=g).tolist() for n in (7, 33, 16)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"input_ids": r}) + "\n" for r in rows))
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", attn_implementation="eager").eval()
    with torch.no_grad():
        total = sum(hf(torch.tensor([r]), labels=torch.tensor([r])).loss.item() * (len(r) - 1) for r in rows)
    ref = total / sum(len(r) - 1 for r in rows)
    # mtds.eval's run of these flags on one warm pooled rank (its command line and exit path, launched, are
    # tests/test_eval.py's test_eval_cli_under_torchrun; an interpreter of its own here added only start-up)
    result = spawn(_eval, 1, ["--ckpt", str(tmp_path / "z3"), "--data", str(tmp_path / "rows.jsonl")],
                   timeout=300)[0]
    assert abs(result["loss"] - ref) < 1e-5 and result["tokens"] == sum(len(r) - 1 for r in rows), (result, ref)
