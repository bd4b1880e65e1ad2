"""The byte-level language model of recipes/lm/: ByteGPT's shapes, tying and per-sample dropout,
its optimizer groups and schedule, a loss that falls on CPU, and the corpus -- read the same way from
local folders and fsspec URLs, the same bytes in every process, cut into next-byte windows."""

from __future__ import annotations

import math
import re
import subprocess
import sys
import uuid
from pathlib import Path

import fsspec
import pytest
import torch
import torch.nn.functional as F
from lm import (
    ByteGPT,
    ByteGPTConfig,
    ByteWindows,
    CorpusConfig,
    corpus_fingerprint,
    glob_match,
    load_corpus,
    optimizer_groups,
    warmup_cosine,
)
from pydantic import Field, ValidationError

from elastic_ddp.config import Config, load_config
from elastic_ddp.data import DataCursor, ElasticSampler, StepBatches, sample_seeds

RECIPES = Path(__file__).resolve().parents[2] / "recipes"

TINY = dict(block_size=16, n_layer=2, n_head=2, n_embd=32)


pytestmark = pytest.mark.usefixtures("one_thread")


def make_model(dropout: float = 0.0, seed: int = 0) -> ByteGPT:
    torch.manual_seed(seed)
    return ByteGPT(ByteGPTConfig(dropout=dropout, **TINY))


def tokens(batch: int, time: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (batch, time), generator=torch.Generator().manual_seed(seed))


# --- ByteGPT ---------------------------------------------------------------------------------


def test_forward_shapes_tying_and_length_check():
    model = make_model()
    assert model(tokens(3)).shape == (3, 16, 256)
    assert model(tokens(2, time=5)).shape == (2, 5, 256)
    assert model.lm_head.weight is model.wte.weight
    with pytest.raises(ValueError, match="block_size \\(16\\); got \\(1, 17\\)"):
        model(tokens(1, time=17))


def test_same_seed_same_init_another_seed_other_weights():
    a, b, c = make_model(seed=3), make_model(seed=3), make_model(seed=4)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.wte.weight, c.wte.weight)


def test_config_refuses_a_width_that_heads_do_not_divide_naming_both():
    with pytest.raises(ValidationError, match=r"model.n_embd \(30\) must be a multiple of model.n_head \(4\)"):
        ByteGPTConfig(n_embd=30, n_head=4)


def test_every_model_field_and_the_corpus_fields_are_part_of_the_run_identity():
    class Settings(Config):
        model: ByteGPTConfig = Field(default_factory=ByteGPTConfig)
        data: CorpusConfig = Field(default_factory=CorpusConfig)

    identity = load_config(["--model.n_layer=3", "--data.max_bytes=1000"], Settings).identity()
    assert {key for key in identity if key.startswith("model.")} == {f"model.{f}" for f in ByteGPTConfig.model_fields}
    assert identity["model.n_layer"] == 3
    assert {key for key in identity if key.startswith("data.")} == {"data.path", "data.glob", "data.max_bytes"}
    assert identity["data.max_bytes"] == 1000


def test_model_output_of_a_sample_does_not_depend_on_its_batch():
    model = make_model(dropout=0.2).train()
    x = tokens(8)
    seeds = sample_seeds(1, step=7, global_indices=range(40, 48))
    full = model(x, seeds)
    for b in (0, 5):
        torch.testing.assert_close(model(x[b : b + 1], seeds[b : b + 1])[0], full[b], rtol=1e-5, atol=1e-5)
    order = [3, 0, 7, 1, 6, 2, 5, 4]
    torch.testing.assert_close(model(x[order], [seeds[i] for i in order]), full[order], rtol=1e-5, atol=1e-5)
    other_step = model(x, sample_seeds(1, step=8, global_indices=range(40, 48)))
    assert not torch.allclose(other_step, full, atol=1e-3)
    with pytest.raises(ValueError, match="needs the micro-batch's sample_seeds"):
        model(x)


def test_dropout_in_eval_mode_computes_what_the_same_weights_without_dropout_compute():
    with_dropout, without = make_model(dropout=0.5), make_model(dropout=0.0)
    with_dropout.eval()
    without.train()  # p = 0: training mode changes nothing
    torch.testing.assert_close(with_dropout(tokens(2)), without(tokens(2)))


def test_optimizer_groups_decay_matrices_only_and_hold_tied_weights_once():
    model = make_model()
    decay, no_decay = optimizer_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    grouped = [id(p) for p in decay["params"] + no_decay["params"]]
    assert len(grouped) == len(set(grouped)) == len(list(model.parameters()))
    assert sum(p is model.wte.weight for p in decay["params"]) == 1  # tied to lm_head: listed once


def test_warmup_cosine_rises_linearly_then_decays_to_the_floor_at_max_steps():
    factor = warmup_cosine(warmup_steps=4, max_steps=24, min_ratio=0.1)
    assert [factor(step) for step in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert factor(4) == pytest.approx(1.0)
    assert factor(14) == pytest.approx(0.1 + 0.5 * 0.9)  # half way through the decay
    assert factor(24) == pytest.approx(0.1) and factor(1000) == pytest.approx(0.1)
    decay = [factor(step) for step in range(4, 25)]
    assert decay == sorted(decay, reverse=True)
    no_warmup = warmup_cosine(warmup_steps=0, max_steps=10, min_ratio=0.0)
    assert no_warmup(0) == 1.0 and no_warmup(5) == pytest.approx(0.5) and no_warmup(10) == pytest.approx(0.0)


def test_warmup_cosine_resumed_scheduler_follows_the_uninterrupted_curve():
    def optimizer():
        return torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)

    schedule = warmup_cosine(3, 20, 0.05)
    straight_opt = optimizer()
    straight = torch.optim.lr_scheduler.LambdaLR(straight_opt, schedule)
    lrs = []
    for _ in range(20):
        lrs.append(straight_opt.param_groups[0]["lr"])
        straight_opt.step()
        straight.step()

    first_opt = optimizer()
    first = torch.optim.lr_scheduler.LambdaLR(first_opt, schedule)
    for _ in range(8):
        first_opt.step()
        first.step()
    resumed_opt = optimizer()
    resumed = torch.optim.lr_scheduler.LambdaLR(resumed_opt, schedule)
    resumed_opt.load_state_dict(first_opt.state_dict())  # as a checkpoint restores both
    resumed.load_state_dict(first.state_dict())
    tail = []
    for _ in range(12):
        tail.append(resumed_opt.param_groups[0]["lr"])
        resumed_opt.step()
        resumed.step()
    assert tail == pytest.approx(lrs[8:], rel=1e-12)
    assert lrs[0] == pytest.approx(2.0 / 3) and lrs[-1] > 2.0 * 0.05


def test_loss_falls_within_50_cpu_steps():
    text = b"elastic training resumes where it stopped; no sample twice, none skipped.\n" * 60
    windows = ByteWindows(torch.frombuffer(bytearray(text), dtype=torch.uint8), TINY["block_size"])
    sampler = ElasticSampler(len(windows), global_batch_size=16, seed=0)
    model = make_model(dropout=0.1).train()
    optimizer = torch.optim.AdamW(optimizer_groups(model, 0.1), lr=3e-3)
    losses = []
    batches = StepBatches(windows, sampler, DataCursor(), rank=0, world_size=1, num_steps=50, micro_batch_size=8)
    for batch in batches:
        step_loss = 0.0
        for mb in batch.micro_batches:
            x, y = mb.data
            loss = F.cross_entropy(model(x, mb.sample_seeds).flatten(0, 1), y.flatten())
            (loss * mb.weight).backward()
            step_loss += loss.item() * mb.weight
        optimizer.step()
        optimizer.zero_grad()
        losses.append(step_loss)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert first > 5.0 and last < 0.6 * first, (first, last)
    assert math.isfinite(last)


# --- ByteWindows -----------------------------------------------------------------------------


def test_byte_windows_are_a_dataset_of_shifted_next_byte_pairs():
    corpus = torch.arange(23, dtype=torch.uint8)
    windows = ByteWindows(corpus, 5)
    assert isinstance(windows, torch.utils.data.Dataset)
    assert len(windows) == 4  # (23 - 1) // 5: the 5th window would need byte 25
    x, y = windows[2]
    assert x.dtype == torch.int64 and x.tolist() == [10, 11, 12, 13, 14]
    assert y.tolist() == [11, 12, 13, 14, 15]
    with pytest.raises(IndexError, match=r"Sample index 4 is outside 0..3"):
        windows[4]
    with pytest.raises(IndexError, match=r"Sample index -1 is outside 0..3"):
        windows[-1]


def test_byte_windows_refuse_a_corpus_they_cannot_cut():
    with pytest.raises(ValueError, match="shorter than one sample"):
        ByteWindows(torch.arange(5, dtype=torch.uint8), 5)
    with pytest.raises(ValueError, match="1-D uint8 tensor, not torch.int64"):
        ByteWindows(torch.arange(50), 5)
    with pytest.raises(ValueError, match=r"block_size \(0\) must be positive"):
        ByteWindows(torch.arange(50, dtype=torch.uint8), 0)


def test_byte_windows_batch_through_the_step_loader():
    corpus = torch.arange(200, dtype=torch.uint8)
    windows = ByteWindows(corpus, 8)
    sampler = ElasticSampler(len(windows), global_batch_size=4, seed=0)
    (batch,) = StepBatches(windows, sampler, DataCursor(), rank=0, world_size=1, num_steps=1)
    (mb,) = batch.micro_batches
    x, y = mb.data
    assert x.shape == y.shape == (4, 8)
    assert x[:, 0].tolist() == [8 * i for i in mb.indices]
    assert torch.equal(y[:, :-1], x[:, 1:])


# --- corpus ----------------------------------------------------------------------------------


def test_glob_double_star_spans_zero_or_more_folders():
    assert glob_match("a.py", "**/*.py") and glob_match("x/y/a.py", "**/*.py")
    assert not glob_match("x/a.txt", "**/*.py")
    assert glob_match("src/a.py", "src/*.py") and not glob_match("src/x/a.py", "src/*.py")


def test_default_corpus_is_the_stdlib_without_installed_packages():
    corpus = load_corpus(CorpusConfig(max_bytes=300_000))
    assert corpus.dtype == torch.uint8 and corpus.shape == (300_000,)
    text = bytes(corpus[:100_000].tolist()).decode("utf-8", errors="replace")
    assert "import" in text and "def " in text
    assert torch.equal(corpus, load_corpus(CorpusConfig(max_bytes=300_000)))


_SUBPROCESS = f"""
import sys
sys.path.insert(0, {str(RECIPES)!r})
from lm import CorpusConfig, corpus_fingerprint, load_corpus
print(corpus_fingerprint(load_corpus(CorpusConfig(max_bytes=300_000))))
"""


def test_default_corpus_has_the_same_fingerprint_in_another_process():
    out = subprocess.run(
        [sys.executable, "-c", _SUBPROCESS], capture_output=True, text=True, check=True, timeout=120
    )
    here = corpus_fingerprint(load_corpus(CorpusConfig(max_bytes=300_000)))
    assert re.fullmatch(r"[0-9a-f]{16}", here)
    assert out.stdout.strip() == here
    assert corpus_fingerprint(load_corpus(CorpusConfig(max_bytes=299_999))) != here


def test_local_folder_reads_matching_files_in_sorted_relative_order(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "b" / "z.py").write_bytes(b"BZ")
    (tmp_path / "a.py").write_bytes(b"A")
    (tmp_path / "c.txt").write_bytes(b"C")
    (tmp_path / "__pycache__" / "x.py").write_bytes(b"X")
    assert bytes(load_corpus(CorpusConfig(path=str(tmp_path))).tolist()) == b"ABZ"
    assert bytes(load_corpus(CorpusConfig(path=str(tmp_path), glob="*.txt")).tolist()) == b"C"
    assert bytes(load_corpus(CorpusConfig(path=str(tmp_path), max_bytes=2)).tolist()) == b"AB"
    assert bytes(load_corpus(CorpusConfig(path=str(tmp_path / "b" / "z.py"))).tolist()) == b"BZ"


def test_fsspec_url_reads_the_same_way():
    root = f"memory://corpus-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    fs.pipe({f"{root}/b/z.py": b"BZ", f"{root}/a.py": b"A", f"{root}/c.txt": b"C"})
    try:
        corpus = load_corpus(CorpusConfig(path=root))
        assert bytes(corpus.tolist()) == b"ABZ"
        assert bytes(load_corpus(CorpusConfig(path=f"{root}/c.txt")).tolist()) == b"C"
        assert bytes(load_corpus(CorpusConfig(path=root, max_bytes=2)).tolist()) == b"AB"
        expected = torch.frombuffer(bytearray(b"ABZ"), dtype=torch.uint8)
        assert corpus_fingerprint(corpus) == corpus_fingerprint(expected)
        with pytest.raises(FileNotFoundError, match="memory://nowhere"):
            load_corpus(CorpusConfig(path="memory://nowhere/at-all"))
        with pytest.raises(FileNotFoundError, match=r"No text found in data.path .*\*\.rs"):
            load_corpus(CorpusConfig(path=root, glob="**/*.rs"))
    finally:
        fs.rm(root, recursive=True)


def test_missing_or_empty_paths_are_named_in_the_error(tmp_path):
    missing = tmp_path / "no-such-dir"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        load_corpus(CorpusConfig(path=str(missing)))
    (tmp_path / "notes.txt").write_bytes(b"hello")
    with pytest.raises(FileNotFoundError, match=rf"{re.escape(str(tmp_path))}.*\*\*/\*\.py"):
        load_corpus(CorpusConfig(path=str(tmp_path)))


def test_the_fingerprint_is_a_function_of_the_bytes_only(tmp_path):
    # A resumed job re-reads its corpus and compares fingerprints: same bytes, same name; one byte less, another.
    data = bytes(range(256)) * 4
    (tmp_path / "a.py").write_bytes(data)
    corpus = load_corpus(CorpusConfig(path=str(tmp_path)))
    assert corpus_fingerprint(corpus) == corpus_fingerprint(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    assert corpus_fingerprint(corpus[:-1]) != corpus_fingerprint(corpus)
    assert len(ByteWindows(corpus, 16)) == (len(data) - 1) // 16
