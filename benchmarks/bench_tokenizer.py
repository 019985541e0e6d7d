"""Tokenization time of an enwik8-sized corpus: training the byte-level BPE and encoding the
corpus into the uint16 memmap cache (`training/tokenizer.py`), on this machine's CPUs.

Issue #22's target: a 100 MB corpus in under a minute on 2 cores. The corpus is `--source`
(default: the built-in stdlib corpus, whole) repeated or cut to `--mb` megabytes: repetition
adds no new words, so BPE training, which works on word counts, sees a corpus as varied as
the source, while encoding scales with the bytes.

    python3 benchmarks/bench_tokenizer.py [--source stdlib|PATH] [--mb 100] [--vocab 50304]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from triton_transformer.training.data import load_corpus
from triton_transformer.training.tokenizer import cached_tokens, train_bpe


def corpus_bytes(source: str, data_dir: Path, megabytes: float) -> tuple[np.ndarray, int]:
    """(`megabytes` of the source's bytes, repeated as needed; the source's own size)."""
    corpus = load_corpus(source, data_dir, download=False, fallback=False)
    parts = [np.asarray(corpus.train), np.asarray(corpus.valid), np.asarray(corpus.test)]
    data = np.concatenate(parts).astype(np.uint8, copy=False)
    want = int(megabytes * 1e6)
    reps = -(-want // len(data))
    return np.tile(data, reps)[:want], len(data)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", default="stdlib")
    ap.add_argument("--data-dir", type=Path, default=Path("data"))
    ap.add_argument("--mb", type=float, default=100.0)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--out", type=Path, default=None, help="write the result as JSON here")
    args = ap.parse_args()
    data, source_size = corpus_bytes(args.source, args.data_dir, args.mb)
    start = time.perf_counter()
    tokenizer = train_bpe(data, args.vocab, progress=False)
    trained = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        ids = cached_tokens(
            tokenizer, data, Path(tmp) / "tokens.bin", corpus_key="bench", progress=False
        )
        encoded = time.perf_counter()
        n_tokens = len(ids)
    result = {
        "source": args.source, "source_bytes": source_size, "bytes": len(data),
        "vocab": args.vocab, "cpus": os.cpu_count(), "train_s": trained - start,
        "encode_s": encoded - trained, "total_s": encoded - start, "tokens": n_tokens,
        "bytes_per_token": len(data) / max(1, n_tokens),
    }  # fmt: skip
    print(json.dumps(result))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
