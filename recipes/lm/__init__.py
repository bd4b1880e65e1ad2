"""The model and corpus of ``recipes/train.py``: a small byte-level language model, its corpus,
the LR schedule. Beside the recipe, not in the library (the benchmarks and tests import it too).

Imported as the top-level package ``lm``: a script's own directory is ``sys.path[0]`` (``python
recipes/train.py``, torchrun), and whatever imports it otherwise puts ``recipes/`` there first.
"""

from .corpus import ByteWindows, CorpusConfig, corpus_fingerprint, glob_match, load_corpus, stdlib_root
from .model import ByteGPT, ByteGPTConfig, optimizer_groups, warmup_cosine

__all__ = [
    "ByteGPT",
    "ByteGPTConfig",
    "ByteWindows",
    "CorpusConfig",
    "corpus_fingerprint",
    "glob_match",
    "load_corpus",
    "optimizer_groups",
    "stdlib_root",
    "warmup_cosine",
]
