"""Keeping a running job alive and honest: signals (signals.py), NaN/inf checks (numerics.py), start-up that
never hangs silently (startup.py), hang detection (heartbeat.py, store.py), one rank doing long work first
(leader.py). Safe loading and durable writes belong to checkpoints: :mod:`mtds.checkpoint`."""
