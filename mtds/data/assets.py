"""Locations of the corpus and tokenizer shipped inside the package."""
import os

_ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")

# One .txt file per work; each file is one document (see corpus/README.md).
SHIPPED_CORPUS = os.path.join(_ASSETS, "corpus")
# Byte-level BPE, 8192 tokens, trained by scripts/train_tokenizer.py on SHIPPED_CORPUS.
SHIPPED_TOKENIZER = os.path.join(_ASSETS, "tokenizer")
