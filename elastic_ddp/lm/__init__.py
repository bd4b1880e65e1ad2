"""A small byte-level language model and its corpus: what ``recipes/train.py`` and the benchmarks train.

Nothing else in the library depends on this package.
"""

from elastic_ddp.lm.corpus import ByteWindows, CorpusConfig, corpus_fingerprint, glob_match, load_corpus, stdlib_root
from elastic_ddp.lm.model import ByteGPT, ByteGPTConfig, optimizer_groups, warmup_cosine

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
