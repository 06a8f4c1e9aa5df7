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
