"""Token-level training in process (CPU, PyTorch ops, tiny models): a BPE run keeps its
tokenizer in the run directory and the checkpoint, resumes with it from the token cache, and
the model's block options are recorded in the checkpoint and rebuilt from it."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from helpers import tiny_config

from triton_transformer.training.checkpoint import CheckpointError, load_checkpoint, load_model
from triton_transformer.training.config import ConfigError, load_config
from triton_transformer.training.tokenizer import (
    TOKENIZER_NAME,
    load_tokenizer,
    run_tokenizer,
    train_bpe,
)
from triton_transformer.training.trainer import Trainer, train

pytest.importorskip("tokenizers")


def test_bpe_run_keeps_its_tokenizer_and_resumes(tmp_path, corpus_file):
    data_dir = tmp_path / "data"
    run_dir = tmp_path / "run"
    overrides = dict(
        data__tokenizer="bpe",
        data__vocab_size=290,  # the fox corpus has pairs for 39 merges, this needs 34
        data__data_dir=str(data_dir),
        eval__eval_every=6,
        eval__generate_every=6,
        log__checkpoint_every=6,
    )
    config = tiny_config(run_dir, corpus_file, **overrides)
    assert config.model.num_tokens == 0  # follows the tokenizer
    result = train(config)
    assert not result.interrupted and result.step == 12
    assert result.losses[12] < result.losses[1]
    # bits per byte < nats per token / ln 2: a token holds more than one byte
    assert result.final_val_bpb < result.final_val_loss / np.log(2)

    saved = load_tokenizer(run_dir / TOKENIZER_NAME)
    n = saved.vocab_size
    assert n == 290
    ckpt = load_checkpoint(run_dir)
    assert ckpt["num_tokens"] == n  # the number it used
    assert ckpt["config"]["model"]["num_tokens"] == 0  # the config's "the tokenizer's"
    assert run_tokenizer(ckpt, run_dir).fingerprint == saved.fingerprint
    model, _ = load_model(run_dir)
    assert model.num_tokens == n
    # the tokenizer trained on the corpus and its token caches sit beside the data
    assert len(list((data_dir / "tokens").glob("*.tokenizer.json"))) == 1
    assert len(list((data_dir / "tokens").glob("*.tokens"))) == 2

    # resume for 4 more steps: the checkpoint's tokenizer, the cached tokens (no rebuild)
    more = tiny_config(run_dir, corpus_file, train__max_steps=16, **overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no TokenCacheWarning
        resumed = train(more, resume=run_dir)
    assert resumed.step == 16


def test_vocab_smaller_than_the_tokenizer_is_refused(tmp_path, corpus_file):
    """A tokenizer.json of 300 tokens with model.num_tokens=280: one ConfigError, no files."""
    text = np.frombuffer(corpus_file.read_bytes(), np.uint8)
    path = tmp_path / "tok.json"
    path.write_text(train_bpe(text, 300, progress=False).to_json())
    config = tiny_config(
        tmp_path / "run",
        corpus_file,
        data__tokenizer=str(path),
        data__data_dir=str(tmp_path / "data"),
        model__num_tokens=280,
    )
    with pytest.raises(ConfigError, match=r"model.num_tokens=280 is smaller than the bpe"):
        Trainer(config)
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())


MODERN = dict(
    model__pos_emb="rope",
    model__norm="rmsnorm",
    model__ff_act="swiglu",
    model__qk_norm=True,
    model__rope_base=500.0,
)


def test_model_options_round_trip_through_the_checkpoint(tmp_path, corpus_file, corpus):
    run_dir = tmp_path / "run"
    config = tiny_config(run_dir, corpus_file, train__max_steps=3, **MODERN)
    trainer = Trainer(config, corpus=corpus)
    try:
        trainer.fit()
        ours = trainer.model.eval()
        x = torch.randint(0, 256, (2, 16))
        with torch.no_grad():
            expected = ours(x)
    finally:
        trainer.close()
    model, saved = load_model(run_dir)
    m = saved.model
    assert (m.pos_emb, m.norm, m.ff_act, m.qk_norm, m.rope_base) == (
        "rope",
        "rmsnorm",
        "swiglu",
        True,
        500.0,
    )
    assert model.options == ours.options
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected)
    # a resume that changes the block is refused, naming the option
    other = tiny_config(
        run_dir, corpus_file, train__max_steps=4, **{**MODERN, "model__norm": "layernorm"}
    )
    with pytest.raises((CheckpointError, ConfigError), match=r"model\.norm=layernorm"):
        Trainer(other, resume=run_dir, corpus=corpus)


def test_llama_preset_builds(tmp_path):
    """configs/llama-small.toml's block at a tiny width: the options reach Transformer."""
    from triton_transformer.training.distributed import DistInfo
    from triton_transformer.training.setup import build_model

    c = load_config(
        "configs/llama-small.toml",
        [("model.dim", 32), ("model.depth", 1), ("model.heads", 2), ("model.dim_head", 16),
         ("data.vocab_size", 300), ("model.max_seq_len", 32), ("train.seq_len", 32),
         ("eval.prime_len", 8)],
    )  # fmt: skip
    c.model.num_tokens = 300  # what the trainer resolves from the tokenizer
    model, _, _ = build_model(
        c.model, compile=False, device=torch.device("cpu"), dist=DistInfo(), cuda_graph=False
    )
    assert model.options["pos_emb"] == "rope" and model.options["ff_act"] == "swiglu"
    assert model(torch.randint(0, 300, (1, 8))).shape == (1, 8, 300)
