"""RecorderCallback: lifecycle on a real Trainer, step gating, freeing, cleanup, checkpoints."""

from __future__ import annotations

import doctest
import functools
import gc
import re
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers.docs import DOCS, python_blocks, run_page
from helpers.models import QUIET, ProbeNet, features, loader
from helpers.two_runs import Hold, check_second_run_refused
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.compile import from_compiled, to_uncompiled

import lightning_recorder.callbacks.recorder as callback_module
from lightning_recorder import RecorderCallback
from lightning_recorder._core.compat import is_compiled as is_compiled_by_torch
from lightning_recorder._core.hooks import live_hooks
from lightning_recorder.callbacks._lightning import is_compiled
from lightning_recorder.errors import (
    NoRecordError,
    NotInitializedError,
    RecorderConfigError,
    RecorderStateError,
    UnknownRecorderTypeError,
    UnknownSourceError,
)

FEAT = {"feat": {"type": "ModuleOutputs", "source": "body.0"}}


def trainer(**kwargs: Any) -> pl.Trainer:
    return pl.Trainer(**{**QUIET, "logger": False, **kwargs})


class Seen(pl.Callback):
    """After the recorder callback: what it recorded at each batch end, per stage."""

    def __init__(self) -> None:
        self.entries: list[tuple[str, int, int | None]] = []

    def _note(self, trainer: pl.Trainer, stage: str, batch_idx: int) -> None:
        cb = RecorderCallback.of(trainer)
        stream = cb.get_recorder("feat").streams["body.0"]
        self.entries.append((stage, batch_idx, len(stream) if len(stream) else None))

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._note(trainer, "train", args[-1])

    def on_validation_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        self._note(trainer, "val", args[3])

    def on_test_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        self._note(trainer, "test", args[3])

    def on_predict_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        self._note(trainer, "predict", args[3])


def test_training_step_reads_the_current_records() -> None:
    model = ProbeNet()
    seen: list[bool] = []

    def check(module: ProbeNet, batch_idx: int) -> None:
        record = RecorderCallback.of(module).get_record_data("feat")
        x = RecorderCallback.of(module).get_record_data("probe")
        seen.append(torch.equal(record, module.body[0](x)) and record.requires_grad)

    model.step_hook = check
    cb = RecorderCallback(
        {**FEAT, "probe": {"type": "ModuleOutputs", "source": "probe"}}, stages=["train"]
    )
    trainer(max_steps=3, callbacks=[cb]).fit(model, loader(features(16)))
    assert seen == [True, True, True]
    assert cb.recorded_steps == 3


def test_every_n_optimizer_steps_with_gradient_accumulation() -> None:
    seen = Seen()
    cb = RecorderCallback(FEAT, stages="train", every_n_steps=2)
    t = trainer(max_steps=4, accumulate_grad_batches=2, callbacks=[cb, seen])
    t.fit(ProbeNet(), loader(features(64)))
    # 8 micro-batches make 4 optimizer steps; steps 1 and 3 (0-based) are due: batches 2, 3, 6, 7.
    recorded = [idx for stage, idx, n in seen.entries if n]
    assert recorded == [2, 3, 6, 7]
    assert all(n in (None, 1) for _, _, n in seen.entries)  # a fresh buffer per micro-batch
    assert cb.recorded_steps == 2


def test_stages_and_the_sanity_check() -> None:
    seen = Seen()
    cb = RecorderCallback(FEAT)  # train and val by default
    t = trainer(max_epochs=1, limit_train_batches=2, num_sanity_val_steps=2, callbacks=[cb, seen])
    t.fit(ProbeNet(), loader(features(8)), loader(features(8)))
    # The sanity check ran two validation batches, unrecorded; the real validation is recorded.
    assert seen.entries == [
        ("val", 0, None),
        ("val", 1, None),
        ("train", 0, 1),
        ("train", 1, 1),
        ("val", 0, 1),
        ("val", 1, 1),
    ]
    seen.entries.clear()
    t.test(ProbeNet(), loader(features(4)))  # not requested: not recorded
    assert seen.entries == [("test", 0, None)]


def test_test_and_predict_on_request() -> None:
    seen = Seen()
    cb = RecorderCallback(FEAT, stages=("test", "predict"))
    t = trainer(callbacks=[cb, seen])
    t.test(ProbeNet(), loader(features(8)))
    t.predict(ProbeNet(), loader(features(4)))
    assert seen.entries == [("test", 0, 1), ("test", 1, 1), ("predict", 0, 1)]
    assert live_hooks() == []


class AliveAtNextStart(pl.Callback):
    """Holds a weak reference to one tensor of each training batch (``watched(trainer,
    on_train_batch_end's arguments)``) and tells, at the next batch's start and after a garbage
    collection, whether it is still alive (``alive``)."""

    def __init__(self, watched: Callable[[pl.Trainer, tuple[Any, ...]], torch.Tensor]) -> None:
        self.watched = watched
        self.refs: list[weakref.ref[torch.Tensor]] = []
        self.alive: list[bool] = []

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        gc.collect()
        if self.refs:
            self.alive.append(self.refs[-1]() is not None)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.refs.append(weakref.ref(self.watched(trainer, args)))


def test_records_are_freed_after_the_step_and_hooks_removed_after_the_run() -> None:
    hooks_during: list[int] = []

    class Watch(AliveAtNextStart):
        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            super().on_train_batch_start(trainer, *args)
            hooks_during.append(len(live_hooks()))

    watch = Watch(lambda trainer, _: RecorderCallback.of(trainer).get_record_data("feat"))
    cb = RecorderCallback(FEAT)
    trainer(max_steps=3, callbacks=[cb, watch]).fit(ProbeNet(), loader(features(16)))
    gc.collect()
    assert watch.alive == [False, False]
    assert watch.refs[-1]() is None
    assert hooks_during == [1, 1, 1]
    assert live_hooks() == []
    with pytest.raises(NotInitializedError, match="no recorders outside a run"):
        cb.manager  # noqa: B018


@pytest.mark.parametrize("with_callback", [True, False], ids=["recorder", "control"])
def test_a_batch_is_not_kept_after_its_step(with_callback: bool) -> None:
    # the callback holds a batch only while its records are handed over: another step's batch,
    # recorded or not, is the data loader's to free (a large batch is memory)
    watch = AliveAtNextStart(lambda _, args: args[-2][0])  # (outputs, batch, batch_idx)
    recorder = RecorderCallback(FEAT, every_n_steps=2)
    callbacks: list[pl.Callback] = [recorder] if with_callback else []
    trainer(max_steps=5, callbacks=[*callbacks, watch]).fit(ProbeNet(), loader(features(32)))
    assert watch.alive == [False] * 4


def test_not_due_step_has_no_record() -> None:
    errors: list[str] = []
    flags: list[bool] = []

    def read(module: ProbeNet, batch_idx: int) -> None:
        flags.append(RecorderCallback.of(module).recording)
        try:
            RecorderCallback.of(module).get_record_data("feat")
        except NoRecordError as err:
            errors.append(str(err))

    model = ProbeNet()
    model.step_hook = read
    cb = RecorderCallback(FEAT, every_n_steps=2)
    trainer(max_steps=2, callbacks=[cb]).fit(model, loader(features(16)))
    assert flags == [False, True]
    assert errors == [
        "RecorderCallback(feat) records nothing in this step: it records the stages train, val, "
        "training every 2 optimizer step(s), never the sanity check. Check `.recording` before "
        "reading."
    ]


def test_a_source_not_called_in_a_recorded_step() -> None:
    cb = RecorderCallback({"spare": {"type": "ModuleOutputs", "source": "body.1"}})
    errors: list[str] = []

    class Skip(ProbeNet):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.body[2](self.body[0](x))

    def read(module: ProbeNet, batch_idx: int) -> None:
        with pytest.raises(NoRecordError, match=r"recorded nothing for 'body\.1'") as info:
            RecorderCallback.of(module).get_record_data("spare")
        errors.append(str(info.value))

    model = Skip()
    model.step_hook = read
    trainer(max_steps=1, callbacks=[cb]).fit(model, loader(features(8)))
    assert len(errors) == 1


def test_a_forward_that_raises_leaves_no_hook() -> None:
    def boom(module: ProbeNet, batch_idx: int) -> None:
        assert len(live_hooks()) == 1
        if batch_idx == 1:
            raise RuntimeError("boom in training_step")

    model = ProbeNet()
    model.step_hook = boom
    cb = RecorderCallback(FEAT)
    with pytest.raises(RuntimeError, match="boom in training_step"):
        trainer(max_steps=4, callbacks=[cb]).fit(model, loader(features(16)))
    assert live_hooks() == []
    assert not cb.recording


def test_a_callback_in_a_second_run_at_once_raises_and_leaves_the_first_recording() -> None:
    # A sweep in threads that hands one callback object to two Trainers: the second run's start
    # is refused, naming the thread of the first, whose recorders stay on its model. (It used to
    # go on silently: the second model was never hooked, and its run stopped and then released
    # the first run's recorders.)
    cb, hold = RecorderCallback(FEAT), Hold()
    reads: list[tuple[torch.Tensor, torch.Tensor]] = []

    def read(module: ProbeNet, batch_idx: int) -> None:
        with torch.no_grad():
            expected = module.body[0](module.probe(module.batch))
        reads.append((RecorderCallback.of(module).get_record_data("feat").detach(), expected))

    class Keep(ProbeNet):
        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            self.batch = batch[0]
            return super().training_step(batch, batch_idx)

    first = Keep()
    first.step_hook = read
    check_second_run_refused(
        lambda: trainer(max_steps=3, callbacks=[cb, hold]).fit(first, loader(features(16))),
        lambda: trainer(max_steps=3, callbacks=[cb]).fit(ProbeNet(), loader(features(16))),
        hold,
    )
    assert len(reads) == 3  # the first run recorded each of its steps, before and after
    for record, expected in reads:
        torch.testing.assert_close(record, expected, rtol=1e-6, atol=1e-7)
    assert live_hooks() == [] and not cb.recording


def test_unknown_module_fails_at_start_with_closest_names() -> None:
    cb = RecorderCallback({"feat": {"type": "ModuleOutputs", "source": "body.O"}})
    with pytest.raises(UnknownSourceError, match=r"No module named 'body.O'.*Closest.*'body.0'"):
        trainer(max_steps=1, callbacks=[cb]).fit(ProbeNet(), loader(features(8)))
    assert live_hooks() == []


def test_batch_start_without_end_is_harmless() -> None:
    class SkipRest(ProbeNet):
        def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
            return -1 if self.current_epoch == 0 and batch_idx == 1 else None

    seen = Seen()
    cb = RecorderCallback(FEAT, stages="train")
    t = trainer(max_epochs=2, limit_train_batches=3, callbacks=[cb, seen])
    t.fit(SkipRest(), loader(features(16)))
    # Epoch 0 stops at batch 1 after the callback started recording; epoch 1 is unaffected.
    assert seen.entries == [("train", 0, 1), ("train", 0, 1), ("train", 1, 1), ("train", 2, 1)]


def test_validate_then_fit() -> None:
    model = ProbeNet()
    seen = Seen()
    cb = RecorderCallback(FEAT)
    t = trainer(max_steps=2, num_sanity_val_steps=0, limit_val_batches=1, callbacks=[cb, seen])
    t.validate(model, loader(features(8)))
    t.fit(model, loader(features(8)), loader(features(8)))
    assert [entry for entry in seen.entries if entry[2]] == [
        ("val", 0, 1),
        ("train", 0, 1),
        ("train", 1, 1),
        ("val", 0, 1),
    ]


class Unlogged(ProbeNet):
    """``self.log`` inside a compiled ``training_step`` is not supported by Lightning."""

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch[0]).square().mean()


def test_compiled_model_records_on_every_due_step() -> None:
    # The hooks are installed before the first compiled call and gated by a flag: dynamo traces
    # them and guards on the flag, so due and not-due steps alternate correctly.
    seen = Seen()
    cb = RecorderCallback(FEAT, stages="train", every_n_steps=2)
    compiled = torch.compile(Unlogged(), backend="aot_eager")
    trainer(max_steps=6, callbacks=[cb, seen]).fit(compiled, loader(features(32)))
    assert [n for _, _, n in seen.entries] == [None, 1, None, 1, None, 1]


def test_a_model_compiled_before_the_hooks_is_reported_until_torch_recompiles() -> None:
    """torch.compile does not recompile when hooks are added later: a model compiled and run
    before the callback is attached (a first fit in a notebook) records nothing, and the
    callback says so once, naming torch.compiler.reset(); after it, the same run records."""
    data = loader(features(16))
    torch.compiler.reset()  # whatever earlier tests compiled: a known start
    try:
        trainer(max_steps=1).fit(torch.compile(Unlogged(), backend="eager"), data)
        for reset in (False, True):
            if reset:
                torch.compiler.reset()
            seen = Seen()
            cb = RecorderCallback(FEAT, stages="train")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                compiled = torch.compile(Unlogged(), backend="eager")
                trainer(max_steps=2, callbacks=[cb, seen]).fit(compiled, data)
            told = [str(w.message) for w in caught if "torch.compiler.reset()" in str(w.message)]
            recorded = [n for _, _, n in seen.entries]
            if reset:
                assert told == [] and recorded == [1, 1]
            else:
                assert len(told) == 1 and "recorded nothing in its first train batch" in told[0]
                assert recorded == [None, None]
    finally:
        torch.compiler.reset()


def test_a_compiled_model_run_by_the_tuner_before_the_fit_is_reported() -> None:
    """Lightning's Tuner runs its trial steps without the Trainer's callbacks: a compiled
    submodule compiles there without hooks, the fit after it records nothing, and the
    callback's warning names the Tuner and torch.compiler.reset()."""
    from lightning.pytorch.tuner import Tuner

    torch.compiler.reset()
    try:
        model = Unlogged()
        model.body = torch.compile(model.body, backend="eager")
        seen = Seen()
        tuned = trainer(max_steps=2, callbacks=[RecorderCallback(FEAT, stages="train"), seen])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            Tuner(tuned).lr_find(model, loader(features(32)), num_training=2, update_attr=False)
            tuned.fit(model, loader(features(16)))
        told = [str(w.message) for w in caught if "torch.compiler.reset()" in str(w.message)]
        assert (
            len(told) == 1 and "in the trial steps of Lightning's Tuner, `lr_find` and " in told[0]
        )
        assert [n for _, _, n in seen.entries] == [None, None]
    finally:
        torch.compiler.reset()


def test_hooks_are_suspended_between_recorded_steps() -> None:
    # A step that records nothing runs the model without the recorders' hooks; a recorded step
    # gets them back, gradient recorders included, and records what it would have recorded.
    recorders = {
        **FEAT,
        "grad": {"type": "ModuleOutputGrads", "source": "body.2"},
        "wgrad": {"type": "ParameterGrad", "source": "body.0.weight"},
    }
    model = ProbeNet()
    during: list[tuple[int, int, int]] = []
    grads: list[bool] = []

    def count(module: ProbeNet, batch_idx: int) -> None:
        body = module.body
        during.append((len(body[0]._forward_hooks), len(body[2]._forward_hooks), len(live_hooks())))

    class Check(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            cb = RecorderCallback.of(trainer)
            if cb.recording:
                weight_grad = cb.get_record_data("wgrad")
                grads.append(torch.equal(weight_grad, model.body[0].weight.grad))
                assert cb.get_record_data("grad").shape == (4, 2)

    model.step_hook = count
    cb = RecorderCallback(recorders, every_n_steps=2)
    trainer(max_steps=4, callbacks=[cb, Check()]).fit(model, loader(features(16)))
    assert during == [(0, 0, 0), (1, 1, 3), (0, 0, 0), (1, 1, 3)]
    assert grads == [True, True] and cb.recorded_steps == 2
    assert live_hooks() == []


def test_training_batches_between_due_steps_after_a_recorded_validation() -> None:
    # Training batches between due steps run without hooks and record nothing, also right
    # after a validation that recorded (its hooks back on, its records held until then).
    model = ProbeNet()
    during: list[tuple[int, int]] = []
    seen: list[tuple[str, int]] = []

    def count(module: ProbeNet, batch_idx: int) -> None:
        during.append((batch_idx, len(module.body[0]._forward_hooks)))

    class Check(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            cb = RecorderCallback.of(trainer)
            seen.append(("train", int(cb.recording)))

        def on_validation_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            cb = RecorderCallback.of(trainer)
            seen.append(("val", cb.get_record_data("feat").shape[0]))

    model.step_hook = count
    cb = RecorderCallback(FEAT, every_n_steps=4, stages=("train", "val"))
    run = trainer(
        max_steps=10,
        callbacks=[cb, Check()],
        val_check_interval=3,
        limit_val_batches=1,
        num_sanity_val_steps=0,
    )
    run.fit(model, loader(features(64)), loader(features(4)))
    # training steps 3 and 7 are due (every 4th); validation after batches 3, 6 and 9
    assert during == [(k, 1 if k in (3, 7) else 0) for k in range(10)]
    train = [recorded for kind, recorded in seen if kind == "train"]
    assert train == [1 if k in (3, 7) else 0 for k in range(10)]
    assert [kind for kind, _ in seen].count("val") == 3
    assert cb.recorded_steps == 2 and live_hooks() == []


def test_hooks_stay_with_keep_hooks_and_on_a_compiled_model() -> None:
    counts: list[int] = []

    class Count(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *args: Any) -> None:
            counts.append(len(pl_module.body[0]._forward_hooks))

    cb = RecorderCallback(FEAT, every_n_steps=2, keep_hooks=True)
    trainer(max_steps=4, callbacks=[cb, Count()]).fit(ProbeNet(), loader(features(16)))
    assert counts == [1, 1, 1, 1]
    counts.clear()
    cb = RecorderCallback(FEAT, every_n_steps=2)  # keep_hooks=None: kept because compiled
    compiled = torch.compile(Unlogged(), backend="eager")
    trainer(max_steps=4, callbacks=[cb, Count()]).fit(compiled, loader(features(16)))
    assert counts == [1, 1, 1, 1]
    assert live_hooks() == []


def test_is_compiled() -> None:
    plain = ProbeNet()
    assert not is_compiled(plain)
    holder = ProbeNet()
    holder.body = torch.compile(holder.body, backend="eager")  # type: ignore[assignment]
    assert is_compiled(holder)
    in_place = ProbeNet()
    in_place.body[0].compile(backend="eager")
    assert is_compiled(in_place)
    # `fit(torch.compile(model))`: Lightning unwraps the model and marks it (public from_compiled)
    unwrapped = from_compiled(torch.compile(ProbeNet(), backend="eager"))  # type: ignore[arg-type]
    assert isinstance(unwrapped, ProbeNet)
    assert not is_compiled_by_torch(unwrapped)  # nothing of torch's is left to see
    assert is_compiled(unwrapped)
    for model in (plain, holder, in_place):  # the Lightning view adds to torch's, no less
        assert is_compiled(model) == is_compiled_by_torch(model)
    # told from public traces (each wrapper's `__wrapped__`), not from Lightning's private mark
    assert not is_compiled(to_uncompiled(unwrapped))  # Lightning's own undo: not compiled
    again = from_compiled(torch.compile(ProbeNet(), backend="eager"))  # type: ignore[arg-type]
    vars(again).pop("_compiler_ctx")  # without the mark, still told
    assert is_compiled(again)
    # a user's wrapper of `forward` alone, a plain function, or another module's method: not it
    only_forward = ProbeNet()
    only_forward.forward = functools.wraps(only_forward.forward)(lambda *a: None)  # type: ignore[method-assign]
    assert not is_compiled(only_forward)
    other = ProbeNet()
    donor = ProbeNet()
    for name in ("forward", "training_step"):
        setattr(other, name, functools.wraps(getattr(donor, name))(lambda *a: None))
    assert not is_compiled(other)


def test_checkpoint_resume_continues_counters(tmp_path: Path) -> None:
    first = RecorderCallback(FEAT, every_n_steps=2, name="a")
    second = RecorderCallback(FEAT, every_n_steps=2, name="b")
    assert first.state_key != second.state_key
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    kwargs = {**QUIET, "enable_checkpointing": True, "default_root_dir": tmp_path}
    pl.Trainer(**kwargs, logger=False, max_steps=4, callbacks=[first, second, ckpt]).fit(
        ProbeNet(), loader(features(64))
    )
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)["callbacks"]
    assert saved[first.state_key] == {"recorded_steps": 2}
    resumed = RecorderCallback(FEAT, every_n_steps=2, name="a")
    other = RecorderCallback(FEAT, every_n_steps=2, name="b")
    pl.Trainer(**kwargs, logger=False, max_steps=8, callbacks=[resumed, other]).fit(
        ProbeNet(), loader(features(64)), ckpt_path=tmp_path / "last.ckpt"
    )
    assert resumed.recorded_steps == 4 and other.recorded_steps == 4


def test_different_recorders_of_one_module_need_no_name(tmp_path: Path) -> None:
    """The state key tells apart what the recorders record, not only their names and sources."""

    def callbacks() -> list[RecorderCallback]:
        return [
            RecorderCallback({"feat": {"type": "ModuleOutputs", "source": "body.0"}}),
            RecorderCallback({"feat": {"type": "ModuleInputs", "source": "body.0"}}),
            RecorderCallback({"feat": {"type": "ModuleOutputGrads", "source": "body.0"}}),
        ]

    first = callbacks()
    assert len({cb.state_key for cb in first}) == 3
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    kwargs = {**QUIET, "enable_checkpointing": True, "default_root_dir": tmp_path}
    pl.Trainer(**kwargs, logger=False, max_steps=4, callbacks=[*first, ckpt]).fit(
        ProbeNet(), loader(features(64))
    )
    assert [cb.recorded_steps for cb in first] == [4, 4, 4]
    resumed = callbacks()
    pl.Trainer(**kwargs, logger=False, max_steps=6, callbacks=[*resumed]).fit(
        ProbeNet(), loader(features(64)), ckpt_path=tmp_path / "last.ckpt"
    )
    assert [cb.recorded_steps for cb in resumed] == [6, 6, 6]  # each continued its own count


def test_same_configuration_twice_needs_a_name() -> None:
    with pytest.raises(RuntimeError, match="more than one stateful callback"):
        trainer(max_steps=1, callbacks=[RecorderCallback(FEAT), RecorderCallback(FEAT)]).fit(
            ProbeNet(), loader(features(8))
        )


@pytest.mark.parametrize("name", ["", "  ", "\t"])
@pytest.mark.parametrize(
    "kind", ["RecorderCallback", "FeatureStatsMonitor", "ActivationWriter", "HealthMonitor"]
)
def test_a_blank_name_is_refused_by_every_callback_that_takes_one(
    kind: str, name: str, tmp_path: Path
) -> None:
    """`name` tells two callbacks apart in checkpoints: a blank one was taken and told nothing."""
    import lightning_recorder

    make: dict[str, Callable[[str], pl.Callback]] = {
        "RecorderCallback": lambda n: RecorderCallback(FEAT, name=n),
        "FeatureStatsMonitor": lambda n: lightning_recorder.FeatureStatsMonitor(["body.0"], name=n),
        "ActivationWriter": lambda n: lightning_recorder.ActivationWriter(
            ["body.0"], tmp_path / "acts", name=n
        ),
        "HealthMonitor": lambda n: lightning_recorder.HealthMonitor(name=n),
    }
    with pytest.raises(RecorderConfigError, match=rf"`name` of {kind} to be a non-empty str or "):
        make[kind](name)
    # a name with a visible character is taken, and a fit runs with it
    callback = make[kind](" a ")
    logger = CSVLogger(tmp_path)  # FeatureStatsMonitor needs one
    trainer(max_steps=1, callbacks=[callback], logger=logger).fit(ProbeNet(), loader(features(8)))


def test_of_errors() -> None:
    t = trainer(callbacks=[RecorderCallback(FEAT, name="a"), RecorderCallback(FEAT, name="b")])
    with pytest.raises(RecorderStateError, match=r"Expected one RecorderCallback .* found 2"):
        RecorderCallback.of(t)
    assert RecorderCallback.of(t, name="b").name == "b"
    with pytest.raises(RecorderStateError, match="Expected a RecorderCallback named 'c'"):
        RecorderCallback.of(t, name="c")
    with pytest.raises(RecorderStateError, match="found none"):
        RecorderCallback.of(trainer())
    # A plain nn.Module (`self.net` instead of `self`) is told apart from a LightningModule.
    with pytest.raises(RecorderConfigError, match=r"Trainer or a LightningModule .* got Linear"):
        RecorderCallback.of(torch.nn.Linear(2, 2))  # type: ignore[arg-type]


def test_of_in_the_tuners_trial_steps_names_the_tuner() -> None:
    # Lightning's Tuner runs its trial steps without the Trainer's callbacks: the step that
    # reads the callback is told why it is missing, and the tuning leaves nothing installed.
    from lightning.pytorch.tuner import Tuner

    model = ProbeNet()
    model.step_hook = lambda module, batch_idx: RecorderCallback.of(module)
    tuned = trainer(callbacks=[RecorderCallback(FEAT)], max_steps=2)
    with pytest.raises(
        RecorderStateError,
        match=r"found none: pass it in `Trainer\(callbacks=\[...\]\)`. \(Lightning's Tuner, "
        r"`lr_find` and `scale_batch_size`, runs its trial steps without the Trainer's "
        r"callbacks: a step that may run there skips its use of the callback",
    ):
        Tuner(tuned).lr_find(model, loader(features(32)), num_training=2)
    assert live_hooks() == []


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"recorders": {}}, RecorderConfigError, "Expected `recorders` of RecorderCallback"),
        ({"recorders": {"a": "body"}}, RecorderConfigError, r"Expected `recorders\['a'\]`"),
        (
            {"recorders": {"a": {"type": "ModuleOutput", "source": "x"}}},
            UnknownRecorderTypeError,
            "Closest types: 'ModuleOutputs'",
        ),
        (
            {"recorders": {"a": {"type": "ModuleOutputs", "source": "x", "detached": True}}},
            RecorderConfigError,
            "Unknown option.*'detached'.*Closest options: 'detach'",
        ),
        ({"stages": ["train", "valid"]}, RecorderConfigError, "hold only 'train'.*'valid'"),
        ({"stages": 3}, RecorderConfigError, "Expected `stages` of RecorderCallback"),
        ({"every_n_steps": 0}, RecorderConfigError, "`every_n_steps` .* positive int"),
        ({"name": 1}, RecorderConfigError, "Expected `name` of RecorderCallback to be a str"),
        ({"keep_hooks": "yes"}, RecorderConfigError, "`keep_hooks` .* True, False or None"),
    ],
)
def test_argument_errors(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        RecorderCallback(**{"recorders": FEAT, **kwargs})


def test_every_n_steps_without_the_train_stage_is_refused(tmp_path: Path) -> None:
    """`every_n_steps` chooses training steps only: a value other than the class's default,
    without "train" in `stages`, would be ignored, so it is refused at construction; the
    defaults (`None` too: follow the Trainer) are taken by every subclass, and a fit runs."""
    from lightning.pytorch.loggers import CSVLogger

    from lightning_recorder import ActivationWriter, FeatureStatsMonitor

    message = (
        r"Expected `every_n_steps` of {} to be left out without 'train' in `stages` .* but got "
        r"{} with stages=\[{}\], where it would be ignored; add 'train' to `stages`, or leave "
        r"every_n_steps out\."
    )
    refused: list[tuple[Callable[[], object], str, int, str]] = [
        (
            lambda: RecorderCallback(FEAT, stages="val", every_n_steps=2),
            "RecorderCallback",
            2,
            "'val'",
        ),
        (
            lambda: FeatureStatsMonitor("probe", stages=["val", "test"], every_n_steps=1),
            "FeatureStatsMonitor",
            1,
            "'val', 'test'",
        ),
        (
            lambda: ActivationWriter("probe", tmp_path / "w", every_n_steps=3),
            "ActivationWriter",
            3,
            "'predict'",
        ),
    ]
    for make, owner, got, stages in refused:
        with pytest.raises(RecorderConfigError) as found:
            make()
        assert re.search(message.format(owner, got, stages), str(found.value)), found.value
    # the defaults, None, and any value with "train": taken
    callbacks = [
        RecorderCallback(FEAT, stages="val", name="a"),
        RecorderCallback(FEAT, stages=["val", "test"], every_n_steps=None, name="b"),
        RecorderCallback(FEAT, stages="train", every_n_steps=2, name="c"),
        FeatureStatsMonitor("probe", stages="val", histograms=False),
        FeatureStatsMonitor("body.0", stages="val", every_n_steps=None, histograms=False),
        FeatureStatsMonitor("body.2", stages="train", every_n_steps=2, histograms=False),
        ActivationWriter("probe", tmp_path / "a"),
        ActivationWriter("probe", tmp_path / "b", stages="val", every_n_steps=1),
        ActivationWriter("body.0", tmp_path / "c", stages=["train"], every_n_steps=2),
    ]
    logger = CSVLogger(tmp_path, name="csv")
    trainer(logger=logger, max_steps=4, log_every_n_steps=1, callbacks=callbacks).fit(
        ProbeNet(), loader(features(16)), loader(features(8))
    )
    assert [cb.recorded_steps for cb in callbacks[:3]] == [0, 0, 2]
    assert [cb.logged_steps for cb in callbacks[3:6]] == [0, 0, 2]  # type: ignore[attr-defined]
    assert live_hooks() == []


def test_docstring_example() -> None:
    result = doctest.testmod(callback_module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_docs_page_examples(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert python_blocks(DOCS / "recorder_callback.md")
    run_page(DOCS / "recorder_callback.md")
