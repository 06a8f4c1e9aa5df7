"""Decide quickly whether the HuggingFace Hub can be used.

Offline, huggingface_hub retries a failed request for about a minute before it
gives up; a data loader should instead fail at once with a useful message.
"""
import os
import socket
from urllib.parse import urlparse


def hub_offline() -> bool:
    """True when the user asked HF libraries to stay offline."""
    flags = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE")
    return any(os.environ.get(f, "").strip().lower() in ("1", "true", "yes", "on") for f in flags)


def hub_reachable(timeout: float = 3.0) -> bool:
    """One TCP connect to the hub endpoint: cheap, bounded by `timeout`."""
    if hub_offline():
        return False
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    url = urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        with socket.create_connection((url.hostname, port), timeout=timeout):
            return True
    except OSError:
        return False
