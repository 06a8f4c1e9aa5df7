"""benchmarks/bench_peers.py needs nothing of the peers at import or when they are absent: each missing
piece is a reason the peer's rows are skipped with, never an import error (the peers are not part of mtds)."""
import sys

from benchmarks.peer_runner import peer_missing


def test_a_missing_peer_is_a_reason_to_skip(tmp_path, monkeypatch):
    monkeypatch.setenv("MTDS_PEERS_DIR", str(tmp_path / "nowhere"))
    assert "bench_peer.py not found" in peer_missing("megatron")
    (tmp_path / "bench_peer.py").write_text("")
    monkeypatch.setenv("MTDS_PEERS_DIR", str(tmp_path))
    monkeypatch.setenv("PEERS_PYTHON", str(tmp_path / "no-python"))
    assert "no peers' python" in peer_missing("torchtitan")
    monkeypatch.setenv("PEERS_PYTHON", sys.executable)      # a python without the peer installed
    assert peer_missing("torchtitan") == f"torchtitan is not installed in {sys.executable}"


def test_bench_peers_imports_without_the_peers():
    """In a fresh interpreter: the suite's own process may have imported megatron-core (the data oracle)."""
    import os
    import subprocess
    code = ("import sys, benchmarks.bench_peers as bench; "
            "assert bench.model_flops_per_step('gpt2', 1) > 0; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torchtitan', 'megatron')))")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def test_run_peer_puts_the_shape_on_the_peers_command_line(monkeypatch):
    """bench_host.py's Megatron-core side runs at its tiny shape only if run_peer hands the shape to
    bench_peer.py; without one the command line is the peer work's, as before. No process is started."""
    import json
    import subprocess

    import pytest

    from benchmarks import peer_runner
    from benchmarks.workloads import Shape

    seen = []

    def fake_run(cmd, env, **kwargs):
        seen.append(json.loads(env["MTDS_PEER_ARGS"]))
        return subprocess.CompletedProcess(cmd, 0, stdout='{"median_step_s": 0.5}\n', stderr="")

    monkeypatch.setattr(peer_runner.subprocess, "run", fake_run)
    shape = Shape(layers=8, hidden=64, heads=4, vocab=8192, seq=64, micro_batch=1).as_dict()
    assert set(shape) == set(peer_runner.SHAPE_OPTIONS)        # a new Shape field needs its peer option
    assert peer_runner.run_peer("megatron", "gpt2", 1, 1, 1, 6, 2, shape=shape) == {"median_step_s": 0.5}
    peer_runner.run_peer("megatron", "gpt2", 1, 1, 1, 6, 2)
    with_shape, default = (list(zip(args[::2], args[1::2])) for args in seen)   # (--option, value) pairs
    flags = {f"--{name.replace('_', '-')}": str(value) for name, value in shape.items()}
    assert {flag: value for flag, value in with_shape if flag in flags} == flags
    assert [pair for pair in with_shape if pair[0] not in flags] == default   # nothing else changed
    assert not set(flags) & {flag for flag, _ in default}
    with pytest.raises(ValueError, match="ffn"):
        peer_runner.run_peer("megatron", "gpt2", 1, 1, 1, 6, 2, shape={"ffn": 768})
    assert len(seen) == 2
