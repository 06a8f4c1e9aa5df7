"""Load a HuggingFace tokenizer and make sure it is usable for LM training.

Any `AutoTokenizer` name or path works; None means the tokenizer shipped with
the project. A loaded tokenizer is probed before use, because some
transformers versions return a broken, empty tokenizer for a hub name they
could not download instead of raising.
"""
import hashlib
import os

from mtds.data.assets import SHIPPED_TOKENIZER
from mtds.data.errors import DataError
from mtds.data.hub import hub_offline, hub_reachable

_PROBE = "To be, or not to be: that is the question."


def load_tokenizer(name_or_path=None):
    """Return a validated tokenizer with an EOS token. Raises DataError."""
    from transformers import AutoTokenizer

    source = SHIPPED_TOKENIZER if name_or_path is None else str(name_or_path)
    local = os.path.isdir(os.path.expanduser(source))
    try:
        if local:
            tok = AutoTokenizer.from_pretrained(os.path.expanduser(source), local_files_only=True)
        else:
            tok = _load_from_hub(AutoTokenizer, source)
    except DataError:
        raise
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError...
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DataError(f"could not load tokenizer {source!r}: {first_line}") from exc
    validate_tokenizer(tok, source)
    return tok


def _load_from_hub(auto_cls, name):
    # A copy already in the local HF cache needs no network at all.
    try:
        return auto_cls.from_pretrained(name, local_files_only=True)
    except Exception:
        pass
    if hub_offline() or not hub_reachable():
        raise DataError(
            f"tokenizer {name!r} is not a local directory and the HuggingFace Hub could not "
            f"be reached (offline?); pass a local tokenizer directory, or omit it for the "
            f"shipped one")
    return auto_cls.from_pretrained(name)


def validate_tokenizer(tok, source="tokenizer") -> None:
    """Refuse tokenizers that cannot encode text or have no EOS to join documents."""
    if len(tok) < 2:
        raise DataError(f"tokenizer {source!r} is empty ({len(tok)} tokens); it was probably "
                        f"not downloaded — pass a local tokenizer directory")
    try:
        ids = tok(_PROBE, add_special_tokens=False)["input_ids"]
    except Exception as exc:
        raise DataError(f"tokenizer {source!r} cannot encode text: {exc}") from exc
    unk = tok.unk_token_id
    if not ids or (unk is not None and all(i == unk for i in ids)):
        raise DataError(f"tokenizer {source!r} is broken: it encodes plain English text to "
                        f"{ids!r}; pass a working tokenizer directory")
    if tok.eos_token_id is None:
        raise DataError(f"tokenizer {source!r} has no EOS token, which is needed to separate "
                        f"documents; choose a tokenizer with eos_token set")


def check_vocab(tok, model_vocab_size: int) -> None:
    """Every id the tokenizer can emit must index the model's embedding table."""
    needed = len(tok)  # base vocab plus added tokens: the largest id + 1
    if model_vocab_size < needed:
        raise DataError(
            f"the model's vocab_size {model_vocab_size} does not cover the tokenizer's "
            f"{needed} tokens; set the model vocab_size to at least {needed} or use a "
            f"matching tokenizer")


def tokenizer_fingerprint(tok) -> str:
    """A hash that changes whenever the tokenizer would produce different ids."""
    h = hashlib.sha256(type(tok).__name__.encode())
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:  # slow (python) tokenizer: its vocabulary is the best stable summary
        for token, idx in sorted(tok.get_vocab().items()):
            h.update(f"{token}\0{idx}\n".encode())
    h.update(f"eos={tok.eos_token_id}".encode())
    return h.hexdigest()[:16]
