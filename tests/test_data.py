"""Tests for triton_transformer.training.data: corpus discovery, download, splits and batching.

Downloads go to a local HTTP server on 127.0.0.1 serving a small fake enwik8 (1000 bytes,
passed as `expected_size` / `enwik8_size`), so nothing touches the network.
"""

from __future__ import annotations

import gzip
import http.server
import io
import os
import socket
import sys
import sysconfig
import threading
import types
import urllib.request
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

from triton_transformer.training import data as D

SIZE = 1000  # the fake enwik8's size; its split is proportional: 900 / 50 / 50


def fake_enwik8(size: int = SIZE) -> bytes:
    return np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()


def zip_bytes(member: bytes, name: str = "enwik8") -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr(name, member)
    return buf.getvalue()


def listing(path) -> list[str]:
    """Every entry of a directory, hidden (temporary) files included."""
    return sorted(p.name for p in path.iterdir()) if path.exists() else []


@pytest.fixture
def server():
    """A local HTTP server: `routes[path] = (status, body, content_length)`; yields (url, routes).

    `content_length` may exceed len(body) to simulate a connection cut mid-transfer.
    """
    routes: dict[str, tuple[int, bytes, int]] = {}
    hits: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            hits.append(self.path)
            status, body, length = routes.get(self.path, (404, b"not found", 9))
            self.send_response(status)
            self.send_header("Content-Length", str(length))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    yield types.SimpleNamespace(url=url, routes=routes, hits=hits)
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/enwik8.zip"  # nothing listens: connection refused


def load_fake_enwik8(data_dir, **kwargs) -> D.Corpus:
    kwargs = {"download": False, "fallback": False, "enwik8_size": SIZE, **kwargs}
    return D.load_corpus("enwik8", data_dir, **kwargs)


def joined(corpus: D.Corpus) -> bytes:
    parts = [corpus.train, corpus.valid] + ([corpus.test] if corpus.test is not None else [])
    return b"".join(np.asarray(p).tobytes() for p in parts)


# --------------------------------------------------------------------------------------------
# Download


def test_download_success_then_load(server, tmp_path):
    payload = fake_enwik8()
    server.routes["/enwik8.zip"] = (200, zip_bytes(payload), len(zip_bytes(payload)))
    url = server.url + "/enwik8.zip"
    path = D.download_enwik8(tmp_path, url=url, expected_size=SIZE, timeout=5, progress=True)

    assert path == tmp_path / "enwik8.zip"
    assert listing(tmp_path) == ["enwik8.zip"]  # no temporary file left
    with zipfile.ZipFile(path) as zf:
        assert zf.read("enwik8") == payload

    corpus = load_fake_enwik8(tmp_path)
    assert corpus.name == "enwik8"
    assert (len(corpus.train), len(corpus.valid), len(corpus.test)) == (900, 50, 50)
    assert joined(corpus) == payload
    assert corpus.train.dtype == np.uint8 and isinstance(corpus.train, np.memmap)
    assert listing(tmp_path) == ["enwik8", "enwik8.zip"]  # decompressed once into a raw cache

    # A valid archive is kept: no second request.
    assert D.download_enwik8(tmp_path, url=url, expected_size=SIZE, progress=False) == path
    assert server.hits == ["/enwik8.zip"]


def test_load_corpus_downloads_when_missing(server, tmp_path):
    payload = fake_enwik8()
    server.routes["/e.zip"] = (200, zip_bytes(payload), len(zip_bytes(payload)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning on success
        corpus = D.load_corpus(
            "enwik8", tmp_path, enwik8_url=server.url + "/e.zip", enwik8_size=SIZE, progress=False
        )
    assert corpus.name == "enwik8" and joined(corpus) == payload


def _bad_archives():
    good = zip_bytes(fake_enwik8())
    cut = good[: len(good) // 2]
    return {
        "truncated": ((200, cut, len(cut)), "not a valid zip"),
        "connection cut": ((200, cut, len(good)), f"closed after {len(cut):,} of {len(good):,}"),
        "wrong size": ((200, zip_bytes(fake_enwik8(SIZE - 1)), None), "holds 999 bytes"),
        "no member": ((200, zip_bytes(fake_enwik8(), "other"), None), "no 'enwik8' member"),
        "not found": ((404, b"nope", 4), "HTTP 404"),
    }


@pytest.mark.parametrize("case", list(_bad_archives()))
def test_download_failure_leaves_nothing(server, tmp_path, case):
    (status, body, length), message = _bad_archives()[case]
    server.routes["/enwik8.zip"] = (status, body, len(body) if length is None else length)
    data_dir = tmp_path / "data"
    with pytest.raises(D.DownloadError, match=message) as info:
        D.download_enwik8(data_dir, url=server.url + "/enwik8.zip", expected_size=SIZE, timeout=5)
    assert "could not download enwik8 from http://127.0.0.1" in str(info.value)
    assert "place enwik8.zip in" in str(info.value)
    assert listing(data_dir) == []  # neither the archive nor a temporary file


def test_download_replaces_invalid_existing_archive(server, tmp_path):
    payload = fake_enwik8()
    (tmp_path / "enwik8.zip").write_bytes(b"garbage")
    server.routes["/enwik8.zip"] = (200, zip_bytes(payload), len(zip_bytes(payload)))
    D.download_enwik8(tmp_path, url=server.url + "/enwik8.zip", expected_size=SIZE)
    with zipfile.ZipFile(tmp_path / "enwik8.zip") as zf:
        assert zf.read("enwik8") == payload


def test_interrupted_download_leaves_nothing(server, tmp_path, monkeypatch):
    body = zip_bytes(fake_enwik8())
    server.routes["/enwik8.zip"] = (200, body, len(body))
    real_urlopen = urllib.request.urlopen

    class Interrupted:  # the real response, but Ctrl-C arrives during the second read
        def __init__(self, resp):
            self.resp, self.reads = resp, 0

        def read(self, n):
            self.reads += 1
            if self.reads > 1:
                raise KeyboardInterrupt
            return self.resp.read(100)

        def __getattr__(self, name):
            return getattr(self.resp, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.resp.close()

    fake_urlopen = lambda *args, **kwargs: Interrupted(real_urlopen(*args, **kwargs))
    monkeypatch.setattr(urllib.request, "urlopen", fake_urlopen)
    with pytest.raises(KeyboardInterrupt):
        D.download_enwik8(tmp_path, url=server.url + "/enwik8.zip", expected_size=SIZE)
    assert listing(tmp_path) == []


def test_no_network_falls_back_to_stdlib(tmp_path, closed_port_url):
    with pytest.warns(D.FallbackCorpusWarning, match="FALLING BACK") as record:
        corpus = D.load_corpus("enwik8", tmp_path, enwik8_url=closed_port_url, progress=False)
    assert "Connection refused" in str(record[0].message) or "refused" in str(record[0].message)
    assert corpus.name == "stdlib" and "FALLBACK" in corpus.description
    assert len(corpus.train) > 0
    assert not any(name.startswith(("enwik8", ".enwik8")) for name in listing(tmp_path))


def test_no_network_without_fallback_raises(tmp_path, closed_port_url):
    with pytest.raises(D.DownloadError, match=r"could not download enwik8 from .*pass --data FILE"):
        D.load_corpus("enwik8", tmp_path, enwik8_url=closed_port_url, fallback=False)
    assert listing(tmp_path) == []


def test_missing_enwik8_without_download(tmp_path):
    with pytest.raises(FileNotFoundError, match="enwik8 not found"):
        D.load_corpus("enwik8", tmp_path, download=False, fallback=False)
    with pytest.warns(D.FallbackCorpusWarning, match="download=False"):
        assert D.load_corpus("enwik8", tmp_path, download=False).name == "stdlib"


# --------------------------------------------------------------------------------------------
# Local files


@pytest.mark.parametrize("kind", ["gz", "zip", "raw"])
def test_local_enwik8_discovery(tmp_path, kind):
    payload = fake_enwik8()
    if kind == "gz":
        (tmp_path / "enwik8.gz").write_bytes(gzip.compress(payload))
    elif kind == "zip":
        (tmp_path / "enwik8.zip").write_bytes(zip_bytes(payload))
    else:
        (tmp_path / "enwik8").write_bytes(payload)
    corpus = load_fake_enwik8(tmp_path)
    assert joined(corpus) == payload
    assert (len(corpus.train), len(corpus.valid), len(corpus.test)) == (900, 50, 50)
    assert "enwik8" in listing(tmp_path) and not any(n.startswith(".") for n in listing(tmp_path))

    # Later loads use the raw cache, even once the archive is gone.
    for name in ("enwik8.gz", "enwik8.zip"):
        (tmp_path / name).unlink(missing_ok=True)
    assert joined(load_fake_enwik8(tmp_path)) == payload


def test_enwik8_archive_as_data_path(tmp_path):
    payload = fake_enwik8()
    (tmp_path / "enwik8.gz").write_bytes(gzip.compress(payload))
    corpus = D.load_corpus(str(tmp_path / "enwik8.gz"), enwik8_size=SIZE)
    assert corpus.name == "enwik8" and joined(corpus) == payload


@pytest.mark.parametrize("case", ["gz wrong size", "gz truncated", "zip truncated"])
def test_bad_local_archive(tmp_path, case):
    payload = fake_enwik8()
    if case == "gz wrong size":
        name, body, message = "enwik8.gz", gzip.compress(payload + b"extra"), "to 1,005 bytes"
    elif case == "gz truncated":
        name, body, message = "enwik8.gz", gzip.compress(payload)[:-20], "not a valid enwik8"
    else:
        name, body, message = "enwik8.zip", zip_bytes(payload)[:300], "not a valid enwik8"
    (tmp_path / name).write_bytes(body)
    with pytest.raises(ValueError, match=message):
        load_fake_enwik8(tmp_path)
    assert listing(tmp_path) == [name]  # no raw cache, no temporary file


def test_wrong_size_raw_enwik8(tmp_path):
    (tmp_path / "enwik8").write_bytes(fake_enwik8(10))
    with pytest.raises(ValueError, match="holds 10 bytes but enwik8 has 1,000"):
        load_fake_enwik8(tmp_path)


def test_file_corpus_split(tmp_path):
    payload = fake_enwik8(2000)
    path = tmp_path / "corpus.txt"
    path.write_bytes(payload)
    corpus = D.load_corpus(str(path))
    assert corpus.name == "corpus.txt"
    assert bytes(corpus.train) == payload[:1800]
    assert bytes(corpus.valid) == payload[1800:1900]
    assert bytes(corpus.test) == payload[1900:]
    assert isinstance(corpus.valid, np.memmap)

    corpus = D.load_corpus(str(path), split=(0.75, 0.25, 0.0))
    assert corpus.test is None
    assert bytes(corpus.train) == payload[:1500] and bytes(corpus.valid) == payload[1500:]


def test_file_corpus_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="'enwik8', 'stdlib'"):
        D.load_corpus(str(tmp_path / "missing.txt"))
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        D.load_corpus(str(tmp_path / "empty.txt"))
    (tmp_path / "tiny.txt").write_bytes(b"abc")
    with pytest.raises(ValueError, match="too few"):
        D.load_corpus(str(tmp_path / "tiny.txt"))
    (tmp_path / "other.gz").write_bytes(gzip.compress(b"hello"))
    with pytest.raises(ValueError, match="compressed"):
        D.load_corpus(str(tmp_path / "other.gz"))
    for bad in [(0.9, 0.1), (0.5, 0.2, 0.2), (1.0, 0.0, 0.0), (1.1, -0.05, -0.05)]:
        with pytest.raises(ValueError, match="split"):
            D.load_corpus(str(tmp_path / "tiny.txt"), split=bad)


# --------------------------------------------------------------------------------------------
# Built-in stdlib corpus


def test_stdlib_corpus_deterministic(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # asked for explicitly: no fallback warning
        first = D.load_corpus("stdlib", tmp_path / "a")
    again = D.load_corpus("stdlib", tmp_path / "a")  # from the cache
    rebuilt = D.load_corpus("stdlib", tmp_path / "b")  # built afresh
    assert first.name == "stdlib" and len(first.train) > 1_000_000
    assert joined(first) == joined(again) == joined(rebuilt)
    assert b"def " in bytes(first.valid)

    root = sysconfig.get_paths()["stdlib"]
    files = D.stdlib_source_files()
    rel = [f.relative_to(root).as_posix() for f in files]
    assert rel == sorted(rel) and len(rel) > 100
    assert all(f.suffix == ".py" for f in files)
    assert not any({"site-packages", "test", "tests"} & set(r.split("/")) for r in rel)
    assert "os.py" in rel and "json/decoder.py" in rel
    assert first.description.startswith("stdlib: the Python")


# --------------------------------------------------------------------------------------------
# Hugging Face


@pytest.fixture(autouse=True)
def _hub_never_online(monkeypatch):
    """No test may reach the real hub: it 'answers' unless a test points HF_ENDPOINT at a
    closed local port and asks for the real probe."""
    monkeypatch.setattr(D, "hf_hub_reachable", lambda timeout=2.0: None)


def test_hf_needs_datasets(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(ImportError, match="pip install datasets"):
        D.load_corpus("hf:wikitext:wikitext-2-raw-v1", tmp_path)
    with pytest.raises(ValueError, match="hf:NAME"):
        D.load_corpus("hf:", tmp_path)


class FakeBatchedSplit:
    """Mimics datasets.Dataset: column_names and .iter(batch_size) yielding dicts of lists."""

    def __init__(self, texts):
        self.texts, self.column_names = texts, ["text"]

    def iter(self, batch_size):
        for i in range(0, len(self.texts), batch_size):
            yield {"text": self.texts[i : i + batch_size]}


def test_hf_conversion_and_cache(tmp_path, monkeypatch):
    train = [" = Title = \n", "", "héllo wörld 🙂", "ünïcode\n"] * 300  # > one 1024-row batch
    dataset = {
        "train": FakeBatchedSplit(train),
        "validation": [{"text": "valid one"}, {"text": "valid two\n"}],
        "test": [{"text": "t"}],
    }
    calls = []

    def load_dataset(name, config):
        calls.append((name, config))
        return dataset

    fake = types.SimpleNamespace(load_dataset=load_dataset)
    monkeypatch.setattr(D, "_import_datasets", lambda: fake)
    corpus = D.load_corpus("hf:wikitext:wikitext-2-raw-v1", tmp_path)
    assert calls == [("wikitext", "wikitext-2-raw-v1")]
    expected_train = "".join(t if t.endswith("\n") else t + "\n" for t in train).encode()
    assert bytes(corpus.train) == expected_train
    assert bytes(corpus.valid) == b"valid one\nvalid two\n"
    assert bytes(corpus.test) == b"t\n"
    assert corpus.name == "hf:wikitext:wikitext-2-raw-v1"

    again = D.load_corpus("hf:wikitext:wikitext-2-raw-v1", tmp_path)  # from the cache
    assert len(calls) == 1 and joined(again) == joined(corpus)
    assert not any(n.startswith(".") for n in listing(tmp_path))


def test_hf_without_validation_split(tmp_path, monkeypatch):
    rows = [{"text": f"story {i}"} for i in range(100)]
    fake = types.SimpleNamespace(load_dataset=lambda name, config: {"train": rows})
    monkeypatch.setattr(D, "_import_datasets", lambda: fake)
    corpus = D.load_corpus("hf:someone/stories", tmp_path)
    text = "".join(f"story {i}\n" for i in range(100)).encode()
    assert joined(corpus) == text and len(corpus.valid) == round(len(text) * 0.05)


def test_hf_offline_is_detected_before_load_dataset(tmp_path, monkeypatch, closed_port_url):
    """A hub that refuses connections: the probe says so at once, and load_dataset only runs
    in offline mode (the local cache), failing with a message instead of minutes of retries."""
    monkeypatch.undo()  # the real probe, against 127.0.0.1 only
    monkeypatch.setenv("HF_ENDPOINT", closed_port_url.rsplit("/", 1)[0])
    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(name, "0")  # restored after the test, whatever the loader sets
    assert "unreachable" in D.hf_hub_reachable(timeout=2.0)

    seen = []

    def load_dataset(name, config):
        seen.append(os.environ.get("HF_HUB_OFFLINE"))
        raise FileNotFoundError("not in the cache")

    fake = types.SimpleNamespace(load_dataset=load_dataset)
    monkeypatch.setattr(D, "_import_datasets", lambda: fake)
    with pytest.raises(ConnectionError, match="not in the local Hugging Face cache"):
        D.load_corpus("hf:wikitext", tmp_path)
    assert seen == ["1"]  # called once, offline
    assert listing(tmp_path) == []


def test_hf_texts_to_file_missing_column(tmp_path):
    with pytest.raises(ValueError, match="no 'text' column"):
        D.hf_texts_to_file([{"content": "x"}], tmp_path / "out.bin")
    split = FakeBatchedSplit(["x"])
    split.column_names = ["content"]
    with pytest.raises(ValueError, match="no 'text' column"):
        D.hf_texts_to_file(split, tmp_path / "out.bin")
    assert listing(tmp_path) == []


# --------------------------------------------------------------------------------------------
# Batches


def windows_data(n: int) -> np.ndarray:
    """Bytes whose (value pair) identifies the position: windows can be located in the data."""
    return (np.arange(n) % 251).astype(np.uint8)


def test_random_batch_shape_range_and_windows():
    data = np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8)
    g = torch.Generator().manual_seed(1)
    batch = D.random_batch(data, 8, 64, g)
    assert batch.shape == (8, 65) and batch.dtype == torch.int64
    assert batch.min() >= 0 and batch.max() <= 255
    for row in batch.numpy():  # each row is a contiguous window of the data
        hits = [s for s in range(len(data) - 64) if (data[s : s + 65] == row).all()]
        assert hits


def test_random_batch_reaches_both_ends():
    data = windows_data(20)
    g = torch.Generator().manual_seed(0)
    firsts = set(D.random_batch(data, 64, 16, g)[:, 0].tolist())
    assert firsts == {0, 1, 2, 3}  # every valid start (0 .. n - seq_len - 1), none past the end


def test_random_batch_deterministic():
    data = np.random.default_rng(0).integers(0, 256, 3000, dtype=np.uint8)
    g = torch.Generator().manual_seed(1234)
    state = g.get_state()
    a, b = D.random_batch(data, 4, 32, g), D.random_batch(data, 4, 32, g)
    assert not torch.equal(a, b)  # the generator advances
    g.set_state(state)
    assert torch.equal(D.random_batch(data, 4, 32, g), a)  # same state -> same batch
    assert torch.equal(D.random_batch(data, 4, 32, g), b)
    g2 = torch.Generator().manual_seed(1234)
    assert torch.equal(D.random_batch(data, 4, 32, g2), a)


@pytest.mark.parametrize(
    ("n", "batch_size", "seq_len"), [(1000, 4, 16), (1001, 4, 10), (17, 3, 16), (500, 100, 7)]
)
def test_eval_batches_cover_split_once(n, batch_size, seq_len):
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
    batches = list(D.eval_batches(data, batch_size, seq_len))
    n_windows = (n - 1) // seq_len
    n_batches = -(-n_windows // batch_size)
    assert len(batches) == D.num_eval_batches(data, batch_size, seq_len) == n_batches
    assert all(b.shape == (batch_size, seq_len + 1) for b in batches[:-1])
    assert batches[-1].shape[1] == seq_len + 1 and 1 <= batches[-1].shape[0] <= batch_size
    assert all(b.dtype == torch.int64 for b in batches)
    rows = torch.cat(batches).numpy()
    assert len(rows) == n_windows
    # Windows in order, stride seq_len: inputs and labels each tile the data exactly once.
    assert (rows[:, :-1].reshape(-1) == data[: n_windows * seq_len]).all()
    assert (rows[:, 1:].reshape(-1) == data[1 : n_windows * seq_len + 1]).all()
    assert n - 1 - n_windows * seq_len < seq_len  # only a tail shorter than a window is left


@pytest.mark.parametrize(
    ("n", "seq_len", "max_bytes"), [(1000, 16, 0), (1000, 16, 160), (5001, 7, 50)]
)
def test_eval_window_starts(n, seq_len, max_bytes):
    starts = D.eval_window_starts(n, seq_len, max_bytes)
    n_windows = (n - 1) // seq_len
    k = n_windows if max_bytes == 0 else max_bytes // seq_len
    assert len(starts) == k and len(set(starts.tolist())) == k
    assert (starts % seq_len == 0).all() and (starts + seq_len + 1 <= n).all()
    assert (np.diff(starts) > 0).all()
    if max_bytes:  # spread over the split, not its start
        assert starts[-1] >= (n_windows - n_windows // k - 1) * seq_len
    data = windows_data(n)
    rows = D.windows_at(data, starts, seq_len)
    assert rows.shape == (k, seq_len + 1) and rows.dtype == torch.int64
    assert (rows[1, :].numpy() == data[starts[1] : starts[1] + seq_len + 1]).all()
    # a budget larger than the split is the whole split; too small still scores a window
    assert len(D.eval_window_starts(n, seq_len, 10 * n)) == n_windows
    assert len(D.eval_window_starts(n, seq_len, 1)) == 1


def test_eval_batches_max_batches():
    data = windows_data(1000)
    full = list(D.eval_batches(data, 4, 16))
    first = list(D.eval_batches(data, 4, 16, max_batches=3))
    assert len(first) == D.num_eval_batches(data, 4, 16, max_batches=3) == 3
    assert all(torch.equal(a, b) for a, b in zip(first, full[:3], strict=True))
    assert D.num_eval_batches(1000, 4, 16, max_batches=10_000) == len(full)


def test_small_corpus_errors():
    data = np.zeros(10, dtype=np.uint8)
    g = torch.Generator().manual_seed(0)
    for call in (
        lambda: D.random_batch(data, 2, 10, g),
        lambda: D.eval_batches(data, 2, 10),  # raises at the call, not at the first batch
    ):
        with pytest.raises(ValueError, match=r"seq_len=10 .* holds only 10 bytes"):
            call()
    assert D.random_batch(data, 2, 9, g).shape == (2, 10)  # exactly one window fits
    with pytest.raises(ValueError, match="batch_size"):
        D.random_batch(data, 0, 4, g)
    with pytest.raises(ValueError, match="1-D"):
        D.random_batch(data.reshape(2, 5), 1, 2, g)


# --------------------------------------------------------------------------------------------
# Text


def test_encode_decode_roundtrip():
    text = "héllo\twörld 🙂\nnext line"
    tokens = D.encode_text(text)
    assert tokens.dtype == torch.int64 and tokens.shape == (len(text.encode()),)
    assert D.decode_tokens(tokens) == text
    assert D.decode_tokens(tokens.numpy()) == text
    assert D.decode_tokens(tokens.tolist()) == text
    assert D.encode_text("").shape == (0,) and D.decode_tokens([]) == ""


def test_decode_replaces_bad_bytes_and_controls():
    assert D.decode_tokens(torch.tensor([104, 0xFF, 105])) == "h\ufffdi"  # invalid UTF-8
    assert D.decode_tokens(list(b"a\x00b\x1bc\x7f")) == "a\ufffdb\ufffdc\ufffd"
    assert D.decode_tokens(list(b"a\r\nb\tc")) == "a\nb\tc"
    assert D.decode_tokens(list("\u0085".encode())) == "\ufffd"  # a C1 control
    with pytest.raises(ValueError, match=r"\[0, 255\]"):
        D.decode_tokens([1, 256])
    with pytest.raises(ValueError, match="1-D"):
        D.decode_tokens(torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(TypeError, match="integers"):
        D.decode_tokens(np.array([1.5]))


def test_download_of_a_forged_enwik8_is_refused(server, tmp_path):
    """A zip whose member has enwik8's exact size and a correct CRC, but is not enwik8: the
    published SHA-256 of the archive refuses it (size and CRC alone would accept it)."""
    buf = io.BytesIO()
    with (
        zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as zf,
        zf.open("enwik8", "w", force_zip64=False) as member,
    ):
        chunk = b"\0" * (1 << 20)
        for _ in range(D.ENWIK8_SIZE // len(chunk)):
            member.write(chunk)
        member.write(b"\0" * (D.ENWIK8_SIZE % len(chunk)))
    forged = buf.getvalue()
    server.routes["/enwik8.zip"] = (200, forged, len(forged))
    with pytest.raises(D.DownloadError, match=r"published enwik8\.zip"):
        D.download_enwik8(tmp_path, url=server.url + "/enwik8.zip", progress=False)
    assert listing(tmp_path) == []
    # the check itself: the right size but other bytes
    fake = tmp_path / "same_size.zip"
    with fake.open("wb") as f:
        f.truncate(36_445_475)
    with pytest.raises(ValueError, match="SHA-256"):
        D._check_sha256(fake, D.ENWIK8_ZIP_SHA256, 36_445_475)


def test_every_source_records_its_origin_and_tokenizes_offline(tmp_path, monkeypatch):
    """enwik8, a local file, hf:NAME and the built-in corpus: each split knows its file and
    byte range (the token caches' key), and a BPE's token cache of each round-trips."""
    pytest.importorskip("tokenizers")
    from triton_transformer.training.tokenizer import tokenize_corpus, train_bpe

    (tmp_path / "enwik8").write_bytes(fake_enwik8())
    local = tmp_path / "local.txt"
    local.write_text("a local corpus, line by line\n" * 100)
    rows = [{"text": f"story {i}: é"} for i in range(200)]
    fake = types.SimpleNamespace(
        load_dataset=lambda name, config: {"train": rows, "validation": rows[:20]}
    )
    monkeypatch.setattr(D, "_import_datasets", lambda: fake)
    corpora = {
        "enwik8": load_fake_enwik8(tmp_path),
        "local": D.load_corpus(str(local), tmp_path),
        "hf": D.load_corpus("hf:someone/stories", tmp_path),
    }
    stdlib = D.load_corpus("stdlib", tmp_path)
    path, start, end = stdlib.origins["valid"]
    assert path.endswith(".bin") and end - start == len(stdlib.valid)
    bpe = train_bpe(np.frombuffer(local.read_bytes() * 2, np.uint8), 280, progress=False)
    for name, corpus in corpora.items():
        for split in ("train", "valid", "test"):
            data = getattr(corpus, split)
            if data is None:
                continue
            path, start, end = corpus.origins[split]
            assert os.path.isfile(path) and end - start == len(data), name
            assert Path(path).read_bytes()[start:end] == data.tobytes(), name
        tokens = tokenize_corpus(corpus, bpe, tmp_path / "tokens", progress=False)
        assert bpe.decode(np.asarray(tokens.valid)) == corpus.valid.tobytes(), name
