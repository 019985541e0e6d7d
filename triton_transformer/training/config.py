"""Typed training configuration: dataclasses loaded from TOML, with command-line overrides.

A config has five sections, each a dataclass of scalars (int, float, bool, str):

    [model]  the Transformer's constructor arguments
    [data]   which corpus to train on
    [train]  optimisation: steps, batch, schedule, device, precision
    [eval]   validation and text samples
    [log]    run directory, logging cadence, checkpoints, Weights & Biases

`load_config(path, overrides)` reads a TOML file, applies "section.key=value" overrides and
validates the result; every problem (unknown key, wrong type, impossible combination) is a
`ConfigError` whose message names the field, raised before any training starts.

`add_config_arguments(parser)` adds a flag for every field (`--train.lr 3e-4`), a generic
`--set train.lr=3e-4` and a few convenience flags (`--use-triton`, `--max-steps`, ...); all of
them land, in command-line order, in `args.overrides` for `apply_overrides`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    try:
        import tomli as tomllib
    except ImportError:
        tomllib = None

__all__ = [
    "Config",
    "ConfigError",
    "DataConfig",
    "EvalConfig",
    "FitWarmup",
    "LogConfig",
    "ModelConfig",
    "TrainConfig",
    "add_config_arguments",
    "apply_overrides",
    "check_resume_changes",
    "config_from_dict",
    "config_to_toml",
    "load_config",
    "parse_override",
]

BYTE_VOCAB = 256  # the byte tokenizer's vocabulary (data.tokenizer = "bytes")
POS_EMBS = ("learned", "rope")
NORMS = ("layernorm", "rmsnorm")
FF_ACTS = ("relu2", "swiglu", "gelu")
MAX_VOCAB = 1 << 32  # token caches hold uint32 ids at most


class ConfigError(ValueError):
    """An invalid configuration; the message names the offending field(s)."""


@dataclass
class ModelConfig:
    """Arguments of `triton_transformer.transformer.Transformer` (same names).

    num_tokens: the vocabulary; 0 follows the tokenizer's (256 for bytes). A run records
    the number it used. The block options (pos_emb, norm, ff_act, qk_norm, rope_base) default
    to the classic model: learned positions, LayerNorm, relu² MLP.
    """

    num_tokens: int = 0
    dim: int = 512
    depth: int = 8
    heads: int = 8
    dim_head: int = 64
    max_seq_len: int = 512
    causal: bool = True
    attn_dropout: float = 0.1
    ff_dropout: float = 0.1
    ff_mult: int = 4
    use_triton: bool = False
    attn_impl: str = "flash"  # "flash" (fused kernel) or "naive" (bmm -> softmax -> bmm)
    pos_emb: str = "learned"  # "learned" (a position table) or "rope" (rotary q and k)
    norm: str = "layernorm"  # "layernorm" (bias-free) or "rmsnorm"
    ff_act: str = "relu2"  # the MLP: "relu2", "swiglu" or "gelu"
    qk_norm: bool = False  # RMSNorm of q and k over the head dimension
    rope_base: float = 10000.0  # the rotary embedding's base (pos_emb = "rope")
    # key/value heads: 0 = heads (multi-head); 1 multi-query; a divisor of heads: grouped-query
    kv_heads: int = 0
    # rows per chunk of the fused loss (`Transformer`'s loss_chunk_rows): fewer hold less
    # memory and run slower; 0 = the default (at most 512 MiB of logits per chunk)
    loss_chunk_rows: int = 0

    def transformer_kwargs(self) -> dict[str, Any]:
        """The `Transformer` keyword arguments of this section (kv_heads 0: left out, i.e.
        one key/value head per query head; loss_chunk_rows 0: left out, the default)."""
        kwargs = dataclasses.asdict(self)
        for name in ("kv_heads", "loss_chunk_rows"):
            if not kwargs[name]:
                del kwargs[name]
        return kwargs


@dataclass
class DataConfig:
    """Corpus for `triton_transformer.training.data.load_corpus`.

    source: "enwik8", "stdlib", "hf:NAME[:CONFIG]" or a path to a local file.
    tokenizer: "bytes" (every byte a token, vocabulary 256), "bpe" (a byte-level BPE of
        vocab_size tokens trained on the training split with Hugging Face `tokenizers`) or
        the path of a byte-level BPE's tokenizer.json. A run keeps its tokenizer (its
        tokenizer.json and checkpoint): sample, eval and --resume use that one.
    vocab_size: the BPE's size, the 256 bytes included (data.tokenizer = "bpe" only).
    shard_global_batch: with several processes (torchrun), every rank draws the same global
        batch of world_size * batch_size windows and trains on its own rows, instead of
        drawing its own windows: N processes then see exactly the batches of one process
        with N times the batch size (reproducible across world sizes).
    """

    source: str = "enwik8"
    data_dir: str = "data"
    download: bool = True
    fallback: bool = True  # fall back to the built-in stdlib corpus (with a warning)
    shard_global_batch: bool = False
    tokenizer: str = "bytes"  # "bytes", "bpe" or the path of a tokenizer.json
    vocab_size: int = 0  # tokens of a "bpe" tokenizer (the 256 bytes included)


@dataclass
class TrainConfig:
    """Optimisation. One step = grad_accum_steps micro-batches of batch_size x seq_len tokens
    on each process: under torchrun the global batch is batch_size x grad_accum_steps x
    world_size sequences."""

    seed: int = 42
    max_steps: int = 100_000
    batch_size: int = 4
    grad_accum_steps: int = 4
    seq_len: int = 512
    lr: float = 2e-4
    min_lr_ratio: float = 0.1  # cosine decay ends at lr * min_lr_ratio
    warmup_steps: int = 1000
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 0.5  # max global grad norm; 0 turns clipping off
    device: str = "auto"  # "auto" (cuda if available), "cpu", "cuda", "cuda:N"
    precision: str = "auto"  # "auto" (bf16 autocast on GPU, fp32 on CPU), "bf16", "fp32"
    compile: bool = False  # torch.compile the model
    # run each optimizer step as one CUDA graph replay: "auto" (on for CUDA), "true", "false"
    # (TOML booleans work too). Eager steps of a Triton-path model still replay its residual
    # blocks as graphs of their own (`Transformer.cuda_graphs`).
    cuda_graph: str = "auto"
    cuda_graph_warmup: int = 3  # eager steps before the capture (11 under DDP, at least)
    # multi-process runs: how long a collective waits for the other ranks before failing
    # (a hung rank then stops the job instead of blocking it forever)
    dist_timeout_s: float = 600.0


@dataclass
class EvalConfig:
    """Validation (loss, bits per byte) and text samples; an interval of 0 turns it off.

    The validation set is a function of the data and these fields only (never of the batch
    size or the number of processes): the split cut into consecutive train.seq_len windows,
    of which every `eval_every` steps at most max_bytes // seq_len are scored, spread evenly
    over the whole split. With `full_at_end` the run's last step also scores every window.
    """

    eval_every: int = 100
    max_bytes: int = 131_072  # labels scored per periodic validation; 0: the whole split
    full_at_end: bool = True  # after the last step, score the whole validation split
    generate_every: int = 500
    prime_len: int = 128  # prompt taken from the validation split
    generate_len: int = 512
    temperature: float = 1.0
    filter_thres: float = 0.9  # top-k filter: keep the top (1 - filter_thres) of the vocab


@dataclass
class LogConfig:
    """Where the run goes and what it writes.

    The run directory is `run_dir` if set, else out_dir/<run_name>-<torch|triton>[-compile]-
    <timestamp>.
    """

    out_dir: str = "runs"
    run_dir: str = ""
    run_name: str = "run"
    log_every: int = 10
    checkpoint_every: int = 1000  # 0: only on Ctrl-C and at the end
    progress: bool = True  # tqdm progress bar
    wandb: bool = False
    wandb_project: str = "triton-transformer"


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def validate(self) -> Config:
        """Raise `ConfigError` listing every invalid field; returns self."""
        problems = _check(self)
        if problems:
            # one line per problem, each complete on its own (train.py prints each as one
            # "train.py: error: ..." line)
            raise ConfigError("\n".join(f"invalid config: {p}" for p in problems))
        return self


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(Config)}
_SCALARS = (bool, int, float, str)


def _field_types(section: str) -> dict[str, type]:
    # annotations are strings (from __future__ import annotations): map them back.
    names = {t.__name__: t for t in _SCALARS}
    return {f.name: names[f.type] for f in dataclasses.fields(SECTIONS[section])}


def _resolve_key(key: str) -> tuple[str, str, type]:
    """'train.lr' -> ('train', 'lr', float); ConfigError for unknown sections/fields."""
    section, dot, name = key.partition(".")
    if not dot or not section or not name:
        raise ConfigError(f"bad key '{key}': expected SECTION.FIELD, e.g. train.lr")
    if section not in SECTIONS:
        raise ConfigError(f"unknown config section '{section}' (valid: {', '.join(SECTIONS)})")
    types = _field_types(section)
    if name not in types:
        raise ConfigError(
            f"unknown config key '{section}.{name}' (valid keys of [{section}]: {', '.join(types)})"
        )
    return section, name, types[name]


# str fields that also take a TOML boolean, stored as "true" / "false"
_BOOL_OR_STR = {"train.cuda_graph"}


def _coerce(key: str, value: Any, typ: type) -> Any:
    """Check a TOML value against the field type (ints are accepted for float fields)."""
    if key in _BOOL_OR_STR and isinstance(value, bool):
        return str(value).lower()
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ is int and isinstance(value, float) and value.is_integer():
        return int(value)  # 1e5 steps
    if type(value) is not typ:
        raise ConfigError(f"{key}: expected {typ.__name__}, got {type(value).__name__} {value!r}")
    return value


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _parse_text(key: str, text: str, typ: type) -> Any:
    """Parse a command-line string into the field's type."""
    try:
        if typ is bool:
            low = text.strip().lower()
            if low in _TRUE | _FALSE:
                return low in _TRUE
            raise ValueError
        if typ is int:
            try:
                return int(text)
            except ValueError:
                val = float(text)  # "1e5"
                if not val.is_integer():
                    raise
                return int(val)
        if typ is float:
            return float(text)
    except ValueError:
        raise ConfigError(f"{key}: expected {typ.__name__}, got {text!r}") from None
    return text


def parse_override(text: str) -> tuple[str, str]:
    """'train.lr=3e-4' -> ('train.lr', '3e-4'); ConfigError for anything else."""
    key, eq, value = text.partition("=")
    key = key.strip()
    if not eq or not re.fullmatch(r"[A-Za-z_]\w*\.[A-Za-z_]\w*", key):
        raise ConfigError(
            f"bad override '{text}': expected SECTION.FIELD=VALUE, e.g. train.lr=3e-4"
        )
    return key, value


def config_from_dict(data: dict[str, Any]) -> Config:
    """Build (without validating) a Config from nested dicts; missing keys keep defaults."""
    if not isinstance(data, dict):
        raise ConfigError(f"config must be a table of sections, got {type(data).__name__}")
    config = Config()
    data = _upgrade_legacy_keys(data)
    for section, values in data.items():
        if section not in SECTIONS:
            raise ConfigError(f"unknown config section '{section}' (valid: {', '.join(SECTIONS)})")
        if not isinstance(values, dict):
            raise ConfigError(f"[{section}] must be a table, got {values!r}")
        for name, value in values.items():
            key = f"{section}.{name}"
            _, _, typ = _resolve_key(key)
            setattr(getattr(config, section), name, _coerce(key, value, typ))
    return config


def _upgrade_legacy_keys(data: dict[str, Any]) -> dict[str, Any]:
    """Configs (and checkpoints) from before eval.max_bytes had eval.eval_batches, a number
    of batches whose bytes depended on the batch size: keep the same byte budget."""
    ev = data.get("eval")
    if not isinstance(ev, dict) or "eval_batches" not in ev:
        return data
    ev = dict(ev)
    batches = ev.pop("eval_batches")
    if "max_bytes" not in ev and isinstance(batches, int):
        t = data.get("train") if isinstance(data.get("train"), dict) else {}
        batch = t.get("batch_size", TrainConfig.batch_size)
        seq = t.get("seq_len", TrainConfig.seq_len)
        if isinstance(batch, int) and isinstance(seq, int):
            ev["max_bytes"] = batches * batch * seq
    return {**data, "eval": ev}


def apply_overrides(
    config: Config, overrides: list[tuple[str, Any]] | None, notes: list[str] | None = None
) -> Config:
    """Return a copy of `config` with ("section.field", value) overrides applied in order.

    String values are parsed into the field's type ("3e-4" -> 3e-4, "true" -> True); other
    values are type-checked. The result is not validated (call `.validate()`).
    notes: if given, gets a line for every value changed that no override named (the warmup
    that `--max-steps` shortens), for the command line to show.
    """
    config = config_from_dict(config.to_dict())  # deep copy
    warmup_note = None
    for key, value in overrides or []:
        section, name, typ = _resolve_key(key)
        if isinstance(value, FitWarmup):
            warmup_note = _set_max_steps_fitting_warmup(config, key, value.value)
            continue
        if isinstance(value, str) and typ is not str:
            value = _parse_text(key, value, typ)
        setattr(getattr(config, section), name, _coerce(key, value, typ))
        if key == "train.warmup_steps":
            warmup_note = None  # set explicitly after --max-steps: nothing happened unasked
    if warmup_note and notes is not None:
        notes.append(warmup_note)
    return config


@dataclass(frozen=True)
class FitWarmup:
    """Override value for train.max_steps (what `--max-steps` sends) that also shortens the
    warmup, keeping its fraction of the run, when the config's warmup would not fit."""

    value: Any


def _set_max_steps_fitting_warmup(config: Config, key: str, value: Any) -> str | None:
    """Set train.max_steps; returns a note if the warmup was shortened to fit."""
    t = config.train
    old_steps, old_warmup = t.max_steps, t.warmup_steps
    t.max_steps = _coerce(
        key, _parse_text(key, value, int) if isinstance(value, str) else value, int
    )
    if t.warmup_steps > t.max_steps > 0 and old_steps > 0:
        t.warmup_steps = min(t.max_steps, round(t.warmup_steps * t.max_steps / old_steps))
        return (
            f"note: --max-steps {t.max_steps} is shorter than the warmup: train.warmup_steps "
            f"{old_warmup} -> {t.warmup_steps} (the same {100 * old_warmup / old_steps:.3g}% "
            "of the run); set --train.warmup_steps to choose another"
        )
    return None


def load_config(
    path: str | Path | None = None,
    overrides: list[tuple[str, Any]] | None = None,
    notes: list[str] | None = None,
) -> Config:
    """Read a TOML config (None: the defaults), apply overrides and validate (notes: see
    `apply_overrides`)."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if tomllib is None:  # pragma: no cover - Python 3.10 without tomli
            raise ConfigError("reading TOML configs on Python 3.10 needs `pip install tomli`")
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            with path.open("rb") as f:
                data = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: invalid TOML: {e}") from None
    return apply_overrides(config_from_dict(data), overrides, notes).validate()


# What a resumed run may change: how and where it runs, how long, what it logs and
# evaluates. Everything else (the model, the optimizer, the schedule, the data and its
# seed) lives in the checkpoint's state, which an override could not reach: the scheduler,
# for one, restores its base learning rate from the checkpoint, so train.lr would be
# recorded but never used.
RESUME_MAY_CHANGE = (
    "train.max_steps",
    "train.device",
    "train.precision",
    "train.compile",
    "train.cuda_graph",
    "train.cuda_graph_warmup",
    "train.dist_timeout_s",
    "model.use_triton",  # the same model and checkpoints, other kernels
    "model.attn_impl",
    "data.data_dir",  # where the same corpus is found
    "data.download",
    "eval.*",
    "log.*",
)


def _resume_may_change(key: str) -> bool:
    section = key.split(".", 1)[0]
    return key in RESUME_MAY_CHANGE or f"{section}.*" in RESUME_MAY_CHANGE


def check_resume_changes(saved: Config, resumed: Config, source: str | Path) -> None:
    """ConfigError naming every field that `resumed` changes from the checkpoint's `saved`
    config although a resume cannot apply it (see RESUME_MAY_CHANGE)."""
    old, new = saved.to_dict(), resumed.to_dict()
    diffs = [
        f"{section}.{name}={_toml_value(value)} (checkpoint: {_toml_value(old[section][name])})"
        for section, values in new.items()
        for name, value in values.items()
        if value != old[section][name] and not _resume_may_change(f"{section}.{name}")
    ]
    if diffs:
        raise ConfigError(
            f"--resume {source} continues its run's model, optimizer, schedule and data: "
            f"{', '.join(diffs)} cannot change; drop those overrides, or start a new run (a "
            f"resume may change only {', '.join(RESUME_MAY_CHANGE)})"
        )


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else str(value)  # inf / nan are TOML too
    if isinstance(value, int):
        return str(value)
    return json.dumps(value)  # JSON string escapes are valid TOML basic strings


def config_to_toml(config: Config) -> str:
    """Serialise to TOML text that `load_config` reads back to an equal Config."""
    lines = []
    for section, values in config.to_dict().items():
        lines.append(f"[{section}]")
        lines += [f"{name} = {_toml_value(v)}" for name, v in values.items()]
        lines.append("")
    return "\n".join(lines)


def _check(c: Config) -> list[str]:
    """Every problem with the config, as messages naming the field."""
    p: list[str] = []
    for section in SECTIONS:
        for name, typ in _field_types(section).items():
            val = getattr(getattr(c, section), name)
            ok = type(val) is typ or (typ is float and type(val) is int)
            if not ok:
                p.append(f"{section}.{name}: expected {typ.__name__}, got {val!r}")
    if p:
        return p  # the range checks below assume the right types
    m, t, e, lg = c.model, c.train, c.eval, c.log

    def positive(key: str, val: float) -> None:
        if not val >= 1:
            p.append(f"{key}={val} must be >= 1")

    def non_negative(key: str, val: float) -> None:
        if not val >= 0:
            p.append(f"{key}={val} must be >= 0")

    for name in ("dim", "depth", "heads", "dim_head", "max_seq_len", "ff_mult"):
        positive(f"model.{name}", getattr(m, name))
    d = c.data
    if m.num_tokens < 0:
        p.append(f"model.num_tokens={m.num_tokens} must be >= 0 (0: the tokenizer's vocabulary)")
    elif m.num_tokens and d.tokenizer == "bytes" and m.num_tokens < BYTE_VOCAB:
        p.append(f"model.num_tokens={m.num_tokens} is smaller than the byte vocabulary (256)")
    elif m.num_tokens and d.tokenizer == "bpe" and m.num_tokens < d.vocab_size:
        p.append(
            f"model.num_tokens={m.num_tokens} is smaller than data.vocab_size={d.vocab_size}; "
            "set model.num_tokens=0 to follow the tokenizer"
        )
    for name, allowed in (("pos_emb", POS_EMBS), ("norm", NORMS), ("ff_act", FF_ACTS)):
        val = getattr(m, name)
        if val not in allowed:
            p.append(f"model.{name}={val!r} must be {' or '.join(repr(a) for a in allowed)}")
    if not (math.isfinite(m.rope_base) and m.rope_base > 0):
        p.append(f"model.rope_base={m.rope_base} must be a positive number")
    if m.kv_heads < 0 or (m.kv_heads and m.heads >= 1 and m.heads % m.kv_heads):
        p.append(f"model.kv_heads={m.kv_heads} must divide model.heads={m.heads} (0: one per head)")
    if m.loss_chunk_rows < 0:
        p.append(f"model.loss_chunk_rows={m.loss_chunk_rows} must be >= 0 (0: the default)")
    for name in ("attn_dropout", "ff_dropout"):
        val = getattr(m, name)
        if not 0.0 <= val < 1.0:
            p.append(f"model.{name}={val} must be in [0, 1)")
    if m.attn_impl not in ("flash", "naive"):
        p.append(f"model.attn_impl={m.attn_impl!r} must be 'flash' or 'naive'")

    if not d.source.strip():
        p.append("data.source is empty")
    if not d.tokenizer.strip():
        p.append("data.tokenizer is empty (use 'bytes', 'bpe' or the path of a tokenizer.json)")
    elif d.tokenizer == "bpe" and not BYTE_VOCAB <= d.vocab_size <= MAX_VOCAB:
        p.append(
            f"data.vocab_size={d.vocab_size} must be set to a size in [256, 2**32] with "
            "data.tokenizer='bpe' (e.g. 50304 for GPT-2 small)"
        )
    elif d.tokenizer not in ("bytes", "bpe") and not d.tokenizer.endswith(".json"):
        p.append(
            f"data.tokenizer={d.tokenizer!r} must be 'bytes', 'bpe' or the path of a tokenizer.json"
        )

    for name in ("max_steps", "batch_size", "grad_accum_steps", "seq_len"):
        positive(f"train.{name}", getattr(t, name))
    if t.seq_len > m.max_seq_len:
        p.append(f"train.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
    if not (math.isfinite(t.lr) and t.lr > 0):
        p.append(f"train.lr={t.lr} must be a positive number")
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        p.append(f"train.min_lr_ratio={t.min_lr_ratio} must be in [0, 1]")
    non_negative("train.warmup_steps", t.warmup_steps)
    if t.cuda_graph.lower() not in ("auto", *_TRUE, *_FALSE):
        p.append(f"train.cuda_graph={t.cuda_graph!r} must be auto, true or false")
    positive("train.cuda_graph_warmup", t.cuda_graph_warmup)
    if t.warmup_steps > t.max_steps:
        p.append(f"train.warmup_steps={t.warmup_steps} exceeds train.max_steps={t.max_steps}")
    if not (math.isfinite(t.weight_decay) and t.weight_decay >= 0):
        p.append(f"train.weight_decay={t.weight_decay} must be >= 0")
    for name in ("beta1", "beta2"):
        val = getattr(t, name)
        if not 0.0 <= val < 1.0:
            p.append(f"train.{name}={val} must be in [0, 1)")
    if not t.grad_clip >= 0:
        p.append(f"train.grad_clip={t.grad_clip} must be >= 0 (0 turns clipping off)")
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", t.device):
        p.append(f"train.device='{t.device}' must be 'auto', 'cpu', 'cuda' or 'cuda:N'")
    if not (math.isfinite(t.dist_timeout_s) and t.dist_timeout_s > 0):
        p.append(f"train.dist_timeout_s={t.dist_timeout_s} must be a positive number of seconds")
    if t.precision not in ("auto", "bf16", "fp32"):
        p.append(f"train.precision='{t.precision}' must be 'auto', 'bf16' or 'fp32'")
    elif t.precision == "bf16" and t.device == "cpu":
        p.append("train.precision='bf16' needs a CUDA device (train.device='cpu'); use 'fp32'")

    non_negative("eval.eval_every", e.eval_every)
    non_negative("eval.max_bytes", e.max_bytes)
    non_negative("eval.generate_every", e.generate_every)
    positive("eval.prime_len", e.prime_len)
    positive("eval.generate_len", e.generate_len)
    if e.prime_len > m.max_seq_len:
        p.append(f"eval.prime_len={e.prime_len} exceeds model.max_seq_len={m.max_seq_len}")
    if e.generate_every and not m.causal:
        p.append("eval.generate_every needs a causal model (model.causal=true) or 0")
    if not (math.isfinite(e.temperature) and e.temperature >= 0):
        p.append(f"eval.temperature={e.temperature} must be >= 0 (0: greedy)")
    if not 0.0 <= e.filter_thres < 1.0:
        p.append(f"eval.filter_thres={e.filter_thres} must be in [0, 1)")

    positive("log.log_every", lg.log_every)
    non_negative("log.checkpoint_every", lg.checkpoint_every)
    if not lg.out_dir.strip() and not lg.run_dir.strip():
        p.append("log.out_dir is empty (set it, or log.run_dir)")
    if "/" in lg.run_name or "\\" in lg.run_name:
        p.append(f"log.run_name='{lg.run_name}' must not contain path separators")
    return p


# --------------------------------------------------------------------------- command line


class _Override(argparse.Action):
    """Append (key, value) to namespace.overrides, keeping command-line order."""

    def __init__(self, option_strings, dest, key=None, const=None, nargs=None, **kwargs):
        self.key = key
        super().__init__(option_strings, dest, nargs=nargs, const=const, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        overrides = getattr(namespace, "overrides", None) or []
        if self.key is None:  # --set SECTION.FIELD=VALUE
            try:
                overrides.append(parse_override(values))
            except ConfigError as err:
                parser.error(str(err))
        else:
            value = self.const if self.nargs == 0 else values
            if self.key == "train.max_steps" and self.option_strings == ["--max-steps"]:
                value = FitWarmup(value)
            overrides.append((self.key, value))
        namespace.overrides = overrides


# convenience flag -> (key, constant for switches or None when it takes a value, help)
CONVENIENCE_FLAGS: dict[str, tuple[str, Any, str]] = {
    "--use-triton": ("model.use_triton", True, "run every op as its Triton kernel"),
    "--compile": ("train.compile", True, "torch.compile the model"),
    "--cuda-graph": (
        "train.cuda_graph",
        None,
        "auto (default: on for CUDA), true or false: run each step as one CUDA graph replay",
    ),
    "--wandb": ("log.wandb", True, "also log to Weights & Biases (offline without a key)"),
    "--device": ("train.device", None, "auto, cpu, cuda or cuda:N"),
    "--data": ("data.source", None, "enwik8, stdlib, hf:NAME[:CONFIG] or a file path"),
    "--max-steps": (
        "train.max_steps",
        None,
        "total optimizer steps; a warmup longer than that is shortened to keep its fraction "
        "of the run",
    ),
    "--seed": ("train.seed", None, "random seed"),
    "--out-dir": ("log.out_dir", None, "parent directory of new run directories"),
    "--run-dir": ("log.run_dir", None, "exact run directory"),
    "--run-name": ("log.run_name", None, "base name of the run directory"),
}


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add --set, the convenience flags and one --SECTION.FIELD flag per config field.

    After parsing, `args.overrides` is the list of (key, value) in command-line order.
    """
    parser.set_defaults(overrides=[])
    parser.add_argument(
        "--set",
        action=_Override,
        metavar="SECTION.FIELD=VALUE",
        help="override any config field, e.g. --set train.lr=3e-4 (repeatable)",
    )
    for flag, (key, const, help_text) in CONVENIENCE_FLAGS.items():
        if const is None:
            parser.add_argument(flag, action=_Override, key=key, metavar="VALUE", help=help_text)
        else:
            parser.add_argument(
                flag,
                action=_Override,
                key=key,
                const=const,
                nargs=0,
                help=f"{help_text} ({key}={str(const).lower()})",
            )
    group = parser.add_argument_group(
        "config fields", "--SECTION.FIELD VALUE for any field of the TOML, e.g. --train.lr 3e-4"
    )
    for section in SECTIONS:
        for name, typ in _field_types(section).items():
            key = f"{section}.{name}"
            flags = [f"--{key}"]
            if "_" in name:
                flags.append(f"--{section}.{name.replace('_', '-')}")
            group.add_argument(
                *flags,
                action=_Override,
                key=key,
                metavar=typ.__name__.upper(),
                help=argparse.SUPPRESS,
            )
    return parser
