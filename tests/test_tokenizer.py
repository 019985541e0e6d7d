"""Tokenizers (bytes and byte-level BPE) and the token cache: exact round trips for any bytes,
the cache built once and reused, rebuilt when stale, truncated or another tokenizer's, and the
bits-per-byte arithmetic. CPU only, small inputs (a BPE of a few hundred tokens trains in a
fraction of a second)."""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("tokenizers")

from triton_transformer.training import tokenizer as tokmod
from triton_transformer.training.data import load_corpus
from triton_transformer.training.evaluation import evaluate_loss
from triton_transformer.training.tokenizer import (
    CACHE_HEADER,
    BPETokenizer,
    ByteTokenizer,
    TokenCacheWarning,
    bits_per_byte,
    cached_tokens,
    corpus_key,
    load_tokenizer,
    read_cache_header,
    resolve_tokenizer,
    split_tokens,
    tokenize_corpus,
    train_bpe,
)

TEXT = (
    "def tokenize(text):\n    return [t for t in text.split() if t]  # ok\n"
    "Ünïcödé — 日本語のテキスト, emoji 🙂🚀, tabs\tand\r\nCRLF lines.\n"
) * 60


@pytest.fixture(scope="module")
def bpe() -> BPETokenizer:
    return train_bpe(np.frombuffer(TEXT.encode(), np.uint8), 320, progress=False)


def samples() -> list[bytes]:
    rng = np.random.default_rng(0)
    return [
        b"",
        b"a",
        rng.integers(0, 256, 4096, dtype=np.uint8).tobytes(),  # random bytes
        TEXT.encode("utf-8"),  # valid UTF-8, multi-byte characters
        "naïve café 🙂\n".encode() * 3,
        b"\xff\xfe\x80 lone continuation, \xc3( bad pair, \xed\xa0\x80 surrogate, \xf0\x28\x8c",
        b"ok" + b"\xe6\x97" + b"end",  # a character cut short
        b"\x00\x01\x02\x7f\n\t\r",  # control bytes
    ]


@pytest.mark.parametrize("kind", ["bytes", "bpe"])
def test_round_trip_is_exact_for_any_bytes(kind, bpe):
    tok = ByteTokenizer() if kind == "bytes" else bpe
    for data in samples():
        ids = tok.encode(data)
        assert ids.dtype == np.int64 and ids.ndim == 1
        assert len(ids) == 0 or 0 <= ids.min() <= ids.max() < tok.vocab_size
        assert tok.decode(ids) == data
        assert tok.decode(torch.from_numpy(ids)) == data  # tensors too
        assert tok.encode(np.frombuffer(data, np.uint8)).tolist() == ids.tolist()
    assert ByteTokenizer().encode(b"\x00\xff").tolist() == [0, 255]


def test_bpe_compresses_and_knows_token_lengths(bpe):
    data = TEXT.encode()
    ids = bpe.encode(data)
    assert bpe.vocab_size == 320 and len(ids) < len(data) / 2  # merges were learned
    lengths = bpe.token_bytes()
    assert lengths.shape == (320,) and lengths.min() >= 1
    assert lengths[ids].sum() == len(data)  # every byte belongs to exactly one token
    assert ByteTokenizer().token_bytes().tolist() == [1] * 256
    assert bpe.dtype == np.uint16
    # a tokenizer.json round trip is the same tokenizer
    again = BPETokenizer.from_str(bpe.to_json())
    assert again.fingerprint == bpe.fingerprint and again.encode(data).tolist() == ids.tolist()


def test_text_shows_bad_ids_and_bytes_as_replacement(bpe):
    ids = bpe.encode("héllo\n".encode())
    assert bpe.text(ids) == "héllo\n"
    assert bpe.text(np.append(ids, [bpe.vocab_size + 3])) == "héllo\n\ufffd"  # padded vocab
    assert ByteTokenizer().text([104, 0xFF, 105]) == "h\ufffdi"


def test_bad_tokenizers_are_refused(tmp_path):
    with pytest.raises(ValueError, match="vocab_size >= 256"):
        train_bpe(np.frombuffer(b"abc", np.uint8), 100, progress=False)
    with pytest.raises(FileNotFoundError, match="tokenizer file"):
        load_tokenizer(tmp_path / "missing.json")
    (tmp_path / "junk.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"not a valid tokenizer\.json"):
        load_tokenizer(tmp_path / "junk.json")
    tk = tokmod.import_tokenizers()
    word = tk.Tokenizer(tk.models.WordLevel({"hello": 0, "[UNK]": 1}, unk_token="[UNK]"))
    (tmp_path / "word.json").write_text(word.to_str())
    with pytest.raises(ValueError, match="byte-level"):
        load_tokenizer(tmp_path / "word.json")


def test_missing_tokenizers_package_is_one_line(monkeypatch):
    def fail(name):
        raise ImportError(name)

    monkeypatch.setattr(tokmod.importlib, "import_module", fail)
    with pytest.raises(ImportError, match="pip install tokenizers"):
        tokmod.import_tokenizers()


# --------------------------------------------------------------------------- the cache


@pytest.fixture
def text_corpus(tmp_path) -> tuple[Path, Path]:
    path = tmp_path / "corpus.txt"
    path.write_bytes(TEXT.encode() + b"\xff\xfe tail \xc3")
    return path, tmp_path / "data"


def test_cache_is_built_once_then_reused(text_corpus, bpe, monkeypatch):
    path, data_dir = text_corpus
    corpus = load_corpus(str(path), data_dir=data_dir)
    tokens = tokenize_corpus(corpus, bpe, data_dir / "tokens", progress=False)
    assert isinstance(tokens.train, np.memmap) and tokens.train.dtype == np.uint16
    assert tokens.test is None  # training reads train and valid only
    assert bpe.decode(np.asarray(tokens.train)) == bytes(corpus.train)
    assert bpe.decode(np.asarray(tokens.valid)) == bytes(corpus.valid)
    files = sorted((data_dir / "tokens").glob("*.tokens"))
    assert len(files) == 2 and not list((data_dir / "tokens").glob(".*.part"))  # no temp left
    header = read_cache_header(files[0])
    assert header["tokenizer"] == bpe.fingerprint and header["dtype"] == "uint16"
    assert files[0].stat().st_size == CACHE_HEADER + 2 * header["count"]

    stamps = {f: f.stat().st_mtime_ns for f in files}
    monkeypatch.setattr(BPETokenizer, "encode", lambda *a: pytest.fail("re-tokenized"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = tokenize_corpus(corpus, bpe, data_dir / "tokens", progress=False)
    assert np.array_equal(again.train, tokens.train)
    assert {f: f.stat().st_mtime_ns for f in files} == stamps


def test_stale_cache_is_rebuilt(text_corpus, bpe):
    path, data_dir = text_corpus
    corpus = load_corpus(str(path), data_dir=data_dir)
    first = split_tokens(corpus, "valid", bpe, data_dir / "tokens", progress=False)
    # the file changes (same size, new content and mtime): the cache's key no longer matches
    path.write_bytes(path.read_bytes()[::-1])
    os.utime(path, ns=(1, 1))
    corpus = load_corpus(str(path), data_dir=data_dir)
    with pytest.warns(TokenCacheWarning, match="stale"):
        second = split_tokens(corpus, "valid", bpe, data_dir / "tokens", progress=False)
    assert bpe.decode(np.asarray(second)) == bytes(corpus.valid) != bpe.decode(np.asarray(first))


def test_truncated_cache_is_rebuilt_never_read(text_corpus, bpe):
    path, data_dir = text_corpus
    corpus = load_corpus(str(path), data_dir=data_dir)
    split_tokens(corpus, "train", bpe, data_dir / "tokens", progress=False)
    (cache,) = (data_dir / "tokens").glob("*.train.*.tokens")
    size = cache.stat().st_size
    with cache.open("r+b") as f:
        f.truncate(size - 6)  # a crash mid-copy
    with pytest.warns(TokenCacheWarning, match="truncated"):
        ids = split_tokens(corpus, "train", bpe, data_dir / "tokens", progress=False)
    assert cache.stat().st_size == size and bpe.decode(np.asarray(ids)) == bytes(corpus.train)


def test_another_tokenizers_cache_is_refused_and_rebuilt(text_corpus, bpe, tmp_path):
    path, data_dir = text_corpus
    corpus = load_corpus(str(path), data_dir=data_dir)
    other = train_bpe(np.frombuffer(b"zzz yyy xxx " * 50, np.uint8), 270, progress=False)
    target = tmp_path / "valid.tokens"
    key = corpus_key(corpus, "valid")
    cached_tokens(other, corpus.valid, target, corpus_key=key, progress=False)
    # the other tokenizer's cache sits where this one's goes (a copied or renamed file)
    with pytest.warns(TokenCacheWarning, match=f"another tokenizer \\({other.fingerprint}"):
        ids = cached_tokens(bpe, corpus.valid, target, corpus_key=key, progress=False)
    assert read_cache_header(target)["tokenizer"] == bpe.fingerprint
    assert bpe.decode(np.asarray(ids)) == bytes(corpus.valid)
    # and a file that is not a cache at all
    target.write_bytes(b"garbage")
    with pytest.warns(TokenCacheWarning, match="not a token cache"):
        cached_tokens(bpe, corpus.valid, target, corpus_key=key, progress=False)


def test_cache_block_boundaries_keep_exact_bytes(tmp_path, bpe, monkeypatch):
    """Blocks cut at newlines, or mid-character when a block has none: still exact."""
    monkeypatch.setattr(tokmod, "_BLOCK", 7)
    monkeypatch.setattr(tokmod, "_CHUNK", 5)
    data = np.frombuffer("日本語テキスト🙂🙂🙂 ab\ncd\n".encode() * 5 + b"\xff", np.uint8)
    ids = cached_tokens(bpe, data, tmp_path / "x.tokens", corpus_key="k", progress=False)
    assert bpe.decode(np.asarray(ids)) == data.tobytes()


def test_sources_without_files_are_keyed_by_content(corpus, tmp_path):
    """The built-in / in-memory corpora: a corpus in memory is keyed by a hash of its bytes,
    a file-backed one by path, size, mtime and byte range."""
    assert corpus_key(corpus, "train").startswith("file:")
    mem = type(corpus)("mem", np.array(corpus.train), np.array(corpus.valid), None, "in memory")
    key = corpus_key(mem, "train")
    assert key.startswith("content:") and key == corpus_key(mem, "train")
    mem.train = mem.train.copy()
    mem.train[0] ^= 1
    assert corpus_key(mem, "train") != key


def test_trained_bpe_is_kept_beside_the_data(text_corpus, monkeypatch):
    path, data_dir = text_corpus
    corpus = load_corpus(str(path), data_dir=data_dir)
    first = resolve_tokenizer("bpe", 300, corpus, data_dir / "tokens", progress=False)
    assert len(list((data_dir / "tokens").glob("*.bpe300.*.tokenizer.json"))) == 1
    monkeypatch.setattr(tokmod, "train_bpe", lambda *a, **k: pytest.fail("trained again"))
    again = resolve_tokenizer("bpe", 300, corpus, data_dir / "tokens", progress=False)
    assert again.fingerprint == first.fingerprint
    assert resolve_tokenizer("bytes", 0, corpus, data_dir / "tokens").kind == "bytes"
    saved = data_dir / "mine.json"
    saved.write_text(first.to_json())
    assert resolve_tokenizer(str(saved), 0, corpus, data_dir).fingerprint == first.fingerprint


# --------------------------------------------------------------------------- bits per byte


class _ConstantLoss(torch.nn.Module):
    """A "model" whose mean loss over any batch is `value` (nats per token)."""

    def __init__(self, value: float) -> None:
        super().__init__()
        self.value = value

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return torch.tensor(self.value, dtype=torch.float64)


def test_bits_per_byte_arithmetic():
    # 3 tokens of 2, 1 and 4 bytes at 1.5 nats each: 4.5 nats over 7 bytes
    assert bits_per_byte(4.5, 7) == pytest.approx(4.5 / math.log(2) / 7)
    # windows of 2 labels over ids [0, 1, 2, 0, 2]; token bytes (1, 2, 3)
    data = np.array([0, 1, 2, 0, 2], dtype=np.uint16)
    out = evaluate_loss(
        _ConstantLoss(1.5),
        data,
        seq_len=2,
        max_bytes=0,
        batch_size=1,
        device=torch.device("cpu"),
        autocast=_null,
        token_bytes=np.array([1, 2, 3]),
    )
    # windows [0, 1, 2] and [2, 0, 2]: labels 1, 2, 0, 2 -> 2 + 3 + 1 + 3 = 9 bytes
    assert out["tokens"] == 4 and out["bytes"] == 9
    assert out["val_loss"] == pytest.approx(1.5)
    assert out["val_bpb"] == pytest.approx(1.5 * 4 / math.log(2) / 9)
    # bytes: one byte per token, bits per byte = loss / ln 2 as before
    out = evaluate_loss(
        _ConstantLoss(1.5),
        data,
        seq_len=2,
        max_bytes=0,
        batch_size=1,
        device=torch.device("cpu"),
        autocast=_null,
    )
    assert out["bytes"] == out["tokens"] == 4 and out["val_bpb"] == 1.5 / math.log(2)


def _null():
    import contextlib

    return contextlib.nullcontext()
