"""Config loading, validation and command-line overrides (no training here)."""

import argparse
from pathlib import Path

import pytest

from triton_transformer.training.config import (
    Config,
    ConfigError,
    add_config_arguments,
    apply_overrides,
    check_resume_changes,
    config_from_dict,
    config_to_toml,
    load_config,
    parse_override,
)

ROOT = Path(__file__).resolve().parents[1]
ENWIK8 = ROOT / "configs" / "enwik8.toml"
TINY = ROOT / "configs" / "tiny.toml"


def write(tmp_path, text: str) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def parse(argv):
    parser = add_config_arguments(argparse.ArgumentParser())
    return parser.parse_args(argv).overrides


def test_enwik8_config_is_lucidrains_setup():
    c = load_config(ENWIK8)
    m, t, e = c.model, c.train, c.eval
    assert (m.num_tokens, m.dim, m.depth, m.heads, m.dim_head, m.max_seq_len) == (
        256,
        512,
        8,
        8,
        64,
        512,
    )
    assert m.causal and m.attn_dropout == m.ff_dropout == 0.1 and not m.use_triton
    assert (t.seq_len, t.batch_size, t.grad_accum_steps, t.lr, t.grad_clip) == (
        512,
        4,
        4,
        2e-4,
        0.5,
    )
    assert t.max_steps == 100_000 and 0 < t.warmup_steps < t.max_steps
    assert (e.eval_every, e.generate_every, e.generate_len) == (100, 500, 512)
    assert c.data.source == "enwik8"


def test_tiny_config_is_small():
    c = load_config(TINY)
    assert c.model.dim <= 128 and c.model.depth <= 2 and c.train.seq_len <= 128
    assert c.train.max_steps <= 1000 and c.data.source == "stdlib"  # no download needed


def test_defaults_and_toml_round_trip(tmp_path):
    c = apply_overrides(
        load_config(TINY), [("log.wandb_project", 'we"ird\\name'), ("train.lr", 1e-5)]
    )
    again = load_config(write(tmp_path, config_to_toml(c)))
    assert again == c
    assert isinstance(again.train.lr, float)


def test_unknown_key_and_section(tmp_path):
    with pytest.raises(ConfigError, match=r"model\.dimm"):
        load_config(write(tmp_path, "[model]\ndimm = 3\n"))
    with pytest.raises(ConfigError, match="unknown config section 'trian'"):
        load_config(write(tmp_path, "[trian]\nlr = 3\n"))
    with pytest.raises(ConfigError, match=r"train\.lrr"):
        apply_overrides(Config(), [("train.lrr", "1")])


def test_wrong_types(tmp_path):
    with pytest.raises(ConfigError, match=r"model\.dim: expected int, got str"):
        load_config(write(tmp_path, '[model]\ndim = "big"\n'))
    with pytest.raises(ConfigError, match=r"model\.causal: expected bool"):
        load_config(write(tmp_path, "[model]\ncausal = 1\n"))
    with pytest.raises(ConfigError, match=r"train\.batch_size: expected int, got float 2\.5"):
        load_config(write(tmp_path, "[train]\nbatch_size = 2.5\n"))
    with pytest.raises(ConfigError, match=r"train\.batch_size: expected int, got 'abc'"):
        apply_overrides(Config(), [("train.batch_size", "abc")])
    with pytest.raises(ConfigError, match=r"model\.use_triton: expected bool, got 'maybe'"):
        apply_overrides(Config(), [("model.use_triton", "maybe")])
    # an int is fine for a float field, and an integral float for an int field
    c = load_config(write(tmp_path, "[train]\nlr = 1\nmax_steps = 2e3\n"))
    assert c.train.lr == 1.0 and c.train.max_steps == 2000
    with pytest.raises(ConfigError, match=r"invalid TOML"):
        load_config(write(tmp_path, "[train\n"))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ([("train.seq_len", 1024)], "train.seq_len=1024 exceeds model.max_seq_len=512"),
        ([("train.batch_size", 0)], "train.batch_size=0 must be >= 1"),
        ([("train.max_steps", 10)], "train.warmup_steps=1000 exceeds train.max_steps=10"),
        ([("model.attn_dropout", 1.0)], r"model.attn_dropout=1.0 must be in \[0, 1\)"),
        ([("model.ff_dropout", -0.1)], r"model.ff_dropout=-0.1 must be in \[0, 1\)"),
        ([("train.lr", 0)], "train.lr=0.0 must be a positive number"),
        ([("model.num_tokens", 100)], "model.num_tokens=100 is smaller than the byte vocab"),
        ([("train.device", "tpu")], "train.device='tpu' must be"),
        ([("train.precision", "fp8")], "train.precision='fp8' must be"),
        ([("train.device", "cpu"), ("train.precision", "bf16")], "needs a CUDA device"),
        ([("eval.prime_len", 600)], "eval.prime_len=600 exceeds model.max_seq_len=512"),
        ([("model.causal", False)], "eval.generate_every needs a causal model"),
        ([("log.log_every", 0)], "log.log_every=0 must be >= 1"),
        ([("train.grad_accum_steps", -1)], "train.grad_accum_steps=-1 must be >= 1"),
        ([("model.pos_emb", "alibi")], "model.pos_emb='alibi' must be 'learned' or 'rope'"),
        ([("model.norm", "batchnorm")], "model.norm='batchnorm' must be 'layernorm' or"),
        ([("model.ff_act", "relu")], "model.ff_act='relu' must be 'relu2' or 'swiglu' or"),
        ([("model.rope_base", 0)], "model.rope_base=0.0 must be a positive number"),
        ([("model.qk_norm", "maybe")], "model.qk_norm: expected bool"),
        ([("model.kv_heads", 3)], "model.kv_heads=3 must divide model.heads=8"),
        ([("model.loss_chunk_rows", -1)], "model.loss_chunk_rows=-1 must be >= 0"),
        ([("model.num_tokens", -1)], "model.num_tokens=-1 must be >= 0"),
        ([("data.tokenizer", "bpe")], r"data.vocab_size=0 must be set to a size in \[256"),
        ([("data.tokenizer", "wordpiece")], "data.tokenizer='wordpiece' must be 'bytes', 'bpe'"),
        (
            [("data.tokenizer", "bpe"), ("data.vocab_size", 1000), ("model.num_tokens", 512)],
            "model.num_tokens=512 is smaller than data.vocab_size=1000; set model.num_tokens=0",
        ),
    ],
)
def test_impossible_values_fail_naming_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        apply_overrides(load_config(ENWIK8), overrides).validate()


def test_all_problems_reported_at_once():
    bad = apply_overrides(Config(), [("train.batch_size", 0), ("model.dim", 0)])
    with pytest.raises(ConfigError) as err:
        bad.validate()
    assert "train.batch_size" in str(err.value) and "model.dim" in str(err.value)
    # one complete line per problem (train.py prints each as one error line)
    assert str(err.value).splitlines() == [
        "invalid config: model.dim=0 must be >= 1",
        "invalid config: train.batch_size=0 must be >= 1",
    ]


def test_max_steps_notes_the_warmup_it_shortens():
    notes = []
    c = load_config(ENWIK8, parse(["--max-steps", "500"]), notes)
    assert c.train.warmup_steps == 5
    assert notes == [
        "note: --max-steps 500 is shorter than the warmup: train.warmup_steps 1000 -> 5 "
        "(the same 1% of the run); set --train.warmup_steps to choose another"
    ]
    for argv in (["--max-steps", "5000"], ["--max-steps", "500", "--train.warmup_steps", "7"]):
        notes = []
        load_config(ENWIK8, parse(argv), notes)
        assert notes == [], argv  # nothing changed unasked


def test_resume_may_change_only_what_it_can_apply():
    saved = load_config(TINY)
    ok = apply_overrides(
        saved,
        [("train.max_steps", 900), ("log.log_every", 3), ("eval.eval_every", 7),
         ("log.run_dir", "elsewhere"), ("model.use_triton", True), ("train.lr", 3e-3)],
    )  # fmt: skip
    check_resume_changes(saved, ok, "run")  # train.lr=3e-3 is the saved value: no change
    bad = apply_overrides(saved, [("train.lr", 1e6), ("model.depth", 3), ("train.seed", 1)])
    with pytest.raises(ConfigError) as err:
        check_resume_changes(saved, bad, "run")
    msg = str(err.value)
    assert "\n" not in msg
    assert "model.depth=3 (checkpoint: 2)" in msg
    assert "train.lr=1000000.0 (checkpoint: 0.003)" in msg
    assert "train.seed=1 (checkpoint: 42)" in msg and "train.max_steps" in msg  # what may change


def test_programmatic_wrong_type_is_caught():
    c = Config()
    c.train.lr = "fast"
    with pytest.raises(ConfigError, match=r"train\.lr: expected float"):
        c.validate()


def test_parse_override_syntax():
    assert parse_override("train.lr=3e-4") == ("train.lr", "3e-4")
    assert parse_override("data.source=a=b") == ("data.source", "a=b")
    for bad in ("train.lr", "lr=3", "=3", "train.=3", ".lr=3", "a.b.c=1"):
        with pytest.raises(ConfigError, match="bad override"):
            parse_override(bad)


def test_command_line_overrides_in_order():
    overrides = parse(
        [
            "--set",
            "train.lr=3e-4",
            "--train.lr",
            "1e-3",
            "--model.depth=3",
            "--train.max-steps",
            "50",
            "--use-triton",
            "--max-steps",
            "70",
            "--device",
            "cpu",
            "--data",
            "stdlib",
            "--compile",
            "--wandb",
            "--out-dir",
            "o",
            "--run-dir",
            "r",
            "--set",
            "model.causal=false",
            "--set",
            "eval.generate_every=0",
        ]
    )
    c = apply_overrides(load_config(ENWIK8), overrides).validate()
    assert c.train.lr == 1e-3  # the later flag wins
    assert c.model.depth == 3 and c.train.max_steps == 70 and c.model.use_triton
    assert c.train.device == "cpu" and c.data.source == "stdlib" and c.train.compile
    assert c.log.wandb and c.log.out_dir == "o" and c.log.run_dir == "r"
    assert c.model.causal is False
    # --max-steps shrinks a warmup that no longer fits, keeping its fraction of the run
    assert c.train.warmup_steps == 70  # 1000 > 50 steps before: capped at the 70 steps
    c = apply_overrides(load_config(ENWIK8), parse(["--max-steps", "500"]))
    assert c.train.warmup_steps == 5  # 1% of the run, as in the config
    c = apply_overrides(load_config(ENWIK8), parse(["--max-steps", "5000"]))
    assert c.train.warmup_steps == 1000  # fits: unchanged
    c = apply_overrides(
        load_config(ENWIK8), parse(["--max-steps", "500", "--train.warmup_steps", "7"])
    )
    assert c.train.warmup_steps == 7
    # the plain field does not: warmup > steps is an error
    with pytest.raises(ConfigError, match=r"train\.warmup_steps=1000 exceeds train\.max_steps=70"):
        apply_overrides(load_config(ENWIK8), parse(["--train.max_steps", "70"])).validate()
    # load_config applies overrides too, and does not mutate its base
    base = load_config(ENWIK8)
    assert load_config(ENWIK8, [("train.lr", "5e-4")]).train.lr == 5e-4
    assert apply_overrides(base, [("model.dim", 8)]).model.dim == 8 and base.model.dim == 512


def test_bad_override_on_command_line_exits(capsys):
    with pytest.raises(SystemExit):
        parse(["--set", "train.lr"])
    assert "bad override 'train.lr'" in capsys.readouterr().err


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.toml")


def test_config_from_dict_rejects_non_tables():
    with pytest.raises(ConfigError, match=r"\[model\] must be a table"):
        config_from_dict({"model": 3})


def test_legacy_eval_batches_keeps_its_byte_budget():
    """Configs and checkpoints from before eval.max_bytes had eval.eval_batches (batches of
    train.batch_size windows): they still load, with the same number of bytes scored."""
    config = config_from_dict(
        {"train": {"batch_size": 8, "seq_len": 64}, "eval": {"eval_batches": 5}}
    )
    assert config.eval.max_bytes == 5 * 8 * 64
    explicit = config_from_dict({"eval": {"eval_batches": 5, "max_bytes": 100}})
    assert explicit.eval.max_bytes == 100
    with pytest.raises(ConfigError, match=r"eval\.max_bytes"):
        config_from_dict({"eval": {"max_bytes": -1}}).validate()


def test_model_options_and_tokenizer_keys(tmp_path):
    """The block options are [model] keys passed to Transformer (kv_heads only when set),
    the tokenizer keys [data] ones; both survive the TOML round trip of a run's config."""
    c = load_config(
        ROOT / "configs" / "llama-small.toml", [("model.kv_heads", 2), ("model.rope_base", 5e5)]
    )
    m = c.model
    assert (m.pos_emb, m.norm, m.ff_act, m.qk_norm, m.kv_heads) == (
        "rope",
        "rmsnorm",
        "swiglu",
        True,
        2,
    )
    kwargs = m.transformer_kwargs()
    assert kwargs["kv_heads"] == 2 and kwargs["rope_base"] == 5e5 and kwargs["num_tokens"] == 0
    assert "kv_heads" not in Config().model.transformer_kwargs()  # default: one per head
    # the fused loss's rows per chunk: 0 (the default) leaves the model's own choice
    assert "loss_chunk_rows" not in Config().model.transformer_kwargs()
    chunked = load_config(ROOT / "configs" / "gpt2-small.toml", [("model.loss_chunk_rows", 1024)])
    assert chunked.model.transformer_kwargs()["loss_chunk_rows"] == 1024
    assert (c.data.tokenizer, c.data.vocab_size) == ("bpe", 8192)
    (tmp_path / "c.toml").write_text(config_to_toml(c))
    assert load_config(tmp_path / "c.toml") == c
    # a preset's vocabulary follows its tokenizer; the byte presets keep theirs
    gpt2 = load_config(ROOT / "configs" / "gpt2-small.toml")
    assert (gpt2.model.dim, gpt2.model.depth, gpt2.model.heads, gpt2.train.seq_len) == (
        768,
        12,
        12,
        1024,
    )
    assert (gpt2.model.num_tokens, gpt2.data.tokenizer, gpt2.data.vocab_size) == (0, "bpe", 50304)
    t = gpt2.train
    assert t.batch_size * t.grad_accum_steps * t.seq_len == 524_288  # 0.5M tokens per step
    assert (t.lr, t.lr * t.min_lr_ratio, t.weight_decay, t.beta1, t.beta2) == pytest.approx(
        (6e-4, 6e-5, 0.1, 0.9, 0.95)
    )
    assert load_config(ROOT / "configs" / "gpt2-small-cpu.toml").data.vocab_size == 512
    # old configs and checkpoints without the new keys: the classic block, bytes
    old = config_from_dict({"model": {"num_tokens": 256}, "data": {"source": "stdlib"}})
    assert (old.model.pos_emb, old.model.norm, old.model.ff_act, old.data.tokenizer) == (
        "learned",
        "layernorm",
        "relu2",
        "bytes",
    )
