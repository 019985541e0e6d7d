"""A second Ctrl-C (KeyboardInterrupt at any line) never leaves an inconsistent checkpoint.

The step/phase protocol (training/step.py's docstring): an interrupt while a step only drew
from the RNG streams ("forward") saves the previous step with the streams rewound; one while
the parameters, optimizer or scheduler change, or before the step is counted ("update"), saves
nothing; one between steps ("idle") saves the step. Whatever happens, the checkpoint on disk
must be exactly the state an uninterrupted run has after the step it names.

Both step paths run on CPU: the CUDA-graph one with a fake graph that runs the captured step's
body eagerly (what `GraphedStep` does for its warm-up steps) and a fake static input buffer,
so batch staging, the graph call and the scheduler step run in `OptimizerStep`'s own order.

Runs: 4 steps (dropout on), checkpoints at steps 2 and 4, a metrics record at step 4 only
(so graphed steps 1 and 3 leave their losses on the "device" until a later read), and the
interrupt in step 3.
"""

import shutil
import sys
from dataclasses import dataclass

import pytest
import torch
from helpers import tiny_config

import triton_transformer.training.data as data_mod
import triton_transformer.training.step as step_mod
import triton_transformer.training.trainer as trainer_mod
from triton_transformer.training.checkpoint import load_checkpoint
from triton_transformer.training.trainer import Trainer

STEP = 3  # the step that is interrupted
KEPT = 2  # the periodic checkpoint before it
MODES = ["eager", "graphed"]


def _config(run_dir, corpus_file):
    return tiny_config(
        run_dir, corpus_file, train__max_steps=4, log__checkpoint_every=2, log__log_every=100
    )


class _FakeGraph:
    """`GraphedStep` on CPU: every call runs the step body eagerly. `trip(phase)` is called
    before ("before") and after ("after") the body."""

    def __init__(self, body, trip=lambda where: None):
        self.body, self.trip = body, trip

    def __call__(self):
        self.trip("before")
        out = self.body()
        self.trip("after")
        return out


class _FakeInputs:
    """`StaticInputs` on CPU: the "device buffer" is a copy of the last batches loaded."""

    device_buffer = None

    def load(self, host):
        self.device_buffer = host.clone()


def _fake_graph(runner):
    runner._graphed = _FakeGraph(runner._graph_body)
    runner._inputs = _FakeInputs()


def _train(config, corpus, mode, *, resume=None, callbacks=(), cls=Trainer, prepare=None):
    trainer = cls(config, resume=resume, corpus=corpus, callbacks=callbacks)
    try:
        if mode == "graphed":
            _fake_graph(trainer.step_runner)
        if prepare is not None:
            prepare(trainer)
        return trainer.fit()
    finally:
        trainer.step_runner._graphed = None  # a fake: no CUDA graph to release
        trainer.close()


# ------------------------------------------------------------------ the uninterrupted run

STATE_KEYS = ("step", "tokens_seen", "model", "optimizer", "scheduler", "rng")


def _state(ckpt: dict) -> dict:
    """What must match: everything but timings (and the config, which names the run dir)."""
    state = {k: ckpt[k] for k in STATE_KEYS}
    state["log_window"] = {k: ckpt["log_window"][k] for k in ("loss", "steps")}
    return state


def _assert_same(a, b, path="checkpoint"):
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), f"{path} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{path}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            _assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


@dataclass
class Reference:
    losses: dict[int, float]
    states: dict[int, dict]  # step -> `_state` of a checkpoint written after it
    step_2: object  # a copy of the step-2 checkpoint file


@pytest.fixture(scope="module")
def references(tmp_path_factory, corpus_file, corpus):
    """mode -> the uninterrupted run: its losses and its checkpoint state after every step."""
    refs = {}
    for mode in MODES:
        root = tmp_path_factory.mktemp(f"ref-{mode}")
        states, losses = {}, {}

        def snapshot(trainer, step, info, root=root, states=states, losses=losses):
            path = trainer.save_checkpoint()  # reads a graphed step's loss early
            losses.update(trainer.checks.last_read)
            states[step] = _state(load_checkpoint(path))
            if step == KEPT:
                shutil.copy(path, root / "step2.pt")

        result = _train(_config(root / "run", corpus_file), corpus, mode, callbacks=[snapshot])
        assert not result.interrupted
        losses.update(result.losses)
        assert sorted(losses) == [1, 2, 3, 4]
        refs[mode] = Reference(losses, states, root / "step2.pt")
    # the fake graph runs the same body, so both paths train alike
    assert refs["eager"].losses == refs["graphed"].losses
    return refs


def _check_checkpoint(ckpt_path, ref: Reference, expected_step: int) -> None:
    """The checkpoint is the uninterrupted run's state at the step it names (consistent),
    and that step is `expected_step`."""
    ckpt = load_checkpoint(ckpt_path)
    _assert_same(_state(ckpt), ref.states[ckpt["step"]], f"checkpoint of step {ckpt['step']}")
    assert ckpt["step"] == expected_step


# ------------------------------------------------------------------ one interrupt point


def _trip(monkeypatch, trainer, obj, name, *, after=False, nth=1):
    """Make `obj.name(...)` raise KeyboardInterrupt on its `nth` call during step STEP (while
    the trainer's counter still says STEP - 1), before or `after` the real call."""
    real = getattr(obj, name)
    calls = []

    def tripping(*args, **kwargs):
        hit = trainer.step == STEP - 1 and len(calls) < nth
        if hit:
            calls.append(1)
            hit = len(calls) == nth
        if hit and not after:
            raise KeyboardInterrupt
        out = real(*args, **kwargs)
        if hit:
            raise KeyboardInterrupt
        return out

    monkeypatch.setattr(obj, name, tripping)


class _TripOnCount(Trainer):
    """A Trainer whose step counter raises KeyboardInterrupt as step STEP is assigned to it:
    before or (`trip_after`) after the assignment."""

    trip_after = False

    @property
    def step(self):
        return self._step

    @step.setter
    def step(self, value):
        if value == STEP and not self.trip_after:
            raise KeyboardInterrupt
        self._step = value
        if value == STEP and self.trip_after:
            raise KeyboardInterrupt


class _TripAfterCount(_TripOnCount):
    trip_after = True


def _staging_draw(trainer, monkeypatch):
    # the second micro-batch drawn for step 3 (the data stream has moved once already)
    _trip(monkeypatch, trainer, data_mod, "random_batch", nth=2)


def _staging_load(trainer, monkeypatch):
    _trip(monkeypatch, trainer, trainer.step_runner._inputs, "load", after=True)


def _graph_call(trainer, monkeypatch):
    graph = trainer.step_runner._graphed
    # after the body: the parameters have moved, the scheduler has not
    graph.trip = lambda where: _raise_if(where == "after" and trainer.step == STEP - 1)


def _raise_if(condition):
    if condition:
        raise KeyboardInterrupt


def _optimizer_step(trainer, monkeypatch):
    _trip(monkeypatch, trainer, trainer.step_runner.optimizer, "step", after=True)


def _scheduler_step(trainer, monkeypatch):
    # on the class: an instance attribute would land in the scheduler's state dict
    _trip(monkeypatch, trainer, type(trainer.step_runner.scheduler), "step", after=True)


def _run_returned(trainer, monkeypatch):
    # right after `OptimizerStep.run` returns: before the fix, the step was not counted yet
    real = trainer.step_runner.run

    def run(step, **kwargs):
        out = real(step, **kwargs)
        _raise_if(step == STEP)
        return out

    trainer.step_runner.run = run


# name -> (modes, Trainer class, prepare, the step of the checkpoint left, whether it is saved)
POINTS = {
    "staging draw": (["graphed"], Trainer, _staging_draw, KEPT, True),  # rewound
    "staging load": (["graphed"], Trainer, _staging_load, KEPT, True),  # rewound
    "graph call": (["graphed"], Trainer, _graph_call, KEPT, False),
    "optimizer.step": (MODES, Trainer, _optimizer_step, KEPT, False),
    "scheduler.step": (MODES, Trainer, _scheduler_step, KEPT, False),
    "before counting": (MODES, _TripOnCount, None, KEPT, False),
    "while counting": (MODES, _TripAfterCount, None, KEPT, False),
    "run returned": (MODES, Trainer, _run_returned, STEP, True),
}
CASES = [(mode, point) for point, (modes, *_) in POINTS.items() for mode in modes]


@pytest.mark.parametrize(("mode", "point"), CASES)
@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
def test_interrupt_at_point_resumes_exactly(
    tmp_path, corpus_file, corpus, references, monkeypatch, mode, point
):
    """An interrupt at `point` of step 3: the checkpoint left behind is the uninterrupted
    run's state at the step it names (2: rewound or kept; 3: the step counted), and resuming
    from it reproduces the uninterrupted run's losses bit for bit."""
    _, cls, prepare, expected_step, saved = POINTS[point]
    ref = references[mode]
    run_dir = tmp_path / "run"
    config = _config(run_dir, corpus_file)
    first = _train(
        config,
        corpus,
        mode,
        cls=cls,
        prepare=None if prepare is None else lambda trainer: prepare(trainer, monkeypatch),
    )
    monkeypatch.undo()
    assert first.interrupted
    _check_checkpoint(run_dir / "checkpoint.pt", ref, expected_step)
    assert (first.checkpoint is not None) == saved  # None: not saved, step 2's kept
    assert first.step in (expected_step, STEP)  # the trainer object itself may be mid-step

    second = _train(config, corpus, mode, resume=run_dir)
    assert not second.interrupted and second.step == 4
    assert second.losses == {s: ref.losses[s] for s in range(expected_step + 1, 5)}
    assert {s: first.losses[s] for s in range(1, expected_step + 1)} == {
        s: ref.losses[s] for s in range(1, expected_step + 1)
    }


# ------------------------------------------------------------------ every line


class _LineTrip:
    """A tracer that raises KeyboardInterrupt at the `k`-th line run in training/step.py and
    training/trainer.py from the call of step 3's `train_step` until step 3's callbacks;
    `k=None` only counts them (`seen`)."""

    FILES = frozenset({step_mod.__file__, trainer_mod.__file__})

    def __init__(self, k: int | None):
        self.k = k
        self.seen = 0
        self.armed = False
        self.done = False
        self.where = ""

    def global_trace(self, frame, event, arg):
        if frame.f_code.co_filename not in self.FILES:
            return None
        if frame.f_code.co_name == "train_step" and not self.done:
            self.armed = True
        return self.local_trace

    def local_trace(self, frame, event, arg):
        if event == "line" and self.armed:
            if self.seen == self.k:
                self.armed, self.done = False, True
                self.where = f"{frame.f_code.co_name}, line {frame.f_lineno}"
                raise KeyboardInterrupt
            self.seen += 1
        return self.local_trace

    def stop(self, trainer, step, info):  # a callback
        if step == STEP:
            self.armed, self.done = False, True


def _run_with_line_trip(tmp_path, corpus_file, corpus, ref, mode, k):
    """Resume the reference's step-2 checkpoint into a new run directory and run step 3
    with `_LineTrip(k)`; returns (the tracer, the result)."""
    trip = _LineTrip(k)
    config = _config(tmp_path / f"run-{k}", corpus_file)
    sys.settrace(trip.global_trace)
    try:
        result = _train(config, corpus, mode, resume=ref.step_2, callbacks=[trip.stop])
    finally:
        sys.settrace(None)
    return trip, result


@pytest.mark.parametrize("mode", MODES)
def test_interrupt_at_every_line_of_a_step(tmp_path, corpus_file, corpus, references, mode):
    """A KeyboardInterrupt at each line step.py and trainer.py run for step 3 in turn (the
    micro-batches, the loss read, the update, the counting, the loop after it): the run dir
    then holds no checkpoint (the step-2 one it resumed from is kept) or exactly the
    uninterrupted run's state at step 2 or 3, and each of the three cases happens."""
    ref = references[mode]
    counting, result = _run_with_line_trip(tmp_path, corpus_file, corpus, ref, mode, None)
    assert not result.interrupted and result.step == 4
    n = counting.seen
    assert n > 30, n
    outcomes = {"kept": 0, KEPT: 0, STEP: 0}
    for k in range(n):
        trip, result = _run_with_line_trip(tmp_path, corpus_file, corpus, ref, mode, k)
        where = f"interrupt #{k} in {trip.where}"
        assert trip.done and result.interrupted, where
        path = tmp_path / f"run-{k}" / "checkpoint.pt"
        ckpt = load_checkpoint(path) if path.exists() else None
        shutil.rmtree(path.parent)
        if result.checkpoint is None:
            assert ckpt is None, where
            outcomes["kept"] += 1
            continue
        assert ckpt["step"] in (KEPT, STEP), where
        try:
            _assert_same(_state(ckpt), ref.states[ckpt["step"]])
        except AssertionError as e:
            raise AssertionError(f"{where}: step {ckpt['step']} saved, {e}") from None
        outcomes[ckpt["step"]] += 1
    assert all(outcomes.values()), outcomes
