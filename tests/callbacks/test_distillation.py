"""FeatureDistillation, end to end: real Trainer runs on CPU with tiny networks."""

from __future__ import annotations

import copy
import functools
import importlib.util
import math
import os
import pickle
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from helpers.distill_models import N_CLASSES, Student, Teacher, loader, trainer_kwargs
from helpers.docs import python_blocks, run_page
from helpers.two_runs import Hold, check_second_run_refused
from lightning.pytorch.callbacks import LearningRateFinder
from torch import Tensor, nn

from lightning_recorder import (
    AttentionTransferLoss,
    FeatureDistillation,
    KLDivLoss,
    MSELoss,
    TeacherInput,
    attention_transfer_loss,
    build_connector,
    distillation_loss,
    kl_div_loss,
    mse_loss,
)
from lightning_recorder._core.hooks import live_hooks
from lightning_recorder.callbacks.distillation._patch import StepPatch, is_patched
from lightning_recorder.errors import (
    RecorderConfigError,
    RecorderStateError,
    RecordModifiedError,
    UnknownSourceError,
)

PAIRS = {"features.2": "features.2", "head": "head"}


def fit(student: pl.LightningModule, callbacks: list[pl.Callback], **kwargs: Any) -> pl.Trainer:
    val = kwargs.pop("val", None)
    trainer = pl.Trainer(callbacks=callbacks, **trainer_kwargs(**kwargs))
    trainer.fit(student, loader(), val)
    return trainer


def seeded(seed: int = 0, **student_kwargs: Any) -> tuple[Teacher, Student]:
    torch.manual_seed(seed)
    return Teacher(), Student(**student_kwargs)


# --------------------------------------------------------------------------- the loss term
class ExpectTerm(pl.Callback):
    """Computes the expected term independently before each step; checks the step's loss after."""

    def __init__(self, teacher: Teacher, connector: nn.Module) -> None:
        self.teacher, self.connector = teacher, connector
        self.expected: list[float] = []
        self.checked = 0

    def on_train_batch_start(self, trainer: pl.Trainer, m: Any, batch: Any, idx: int) -> None:
        x, _ = batch
        with torch.no_grad():
            s_map, t_map = m.features[:3](x), self.teacher.features[:3](x)
            s_logits, t_logits = m(x), self.teacher.head(self.teacher.features(x).mean((2, 3)))
            term = 0.5 * mse_loss(self.connector(s_map), t_map) + 2.0 * kl_div_loss(
                s_logits, t_logits, temperature=4.0
            )
        self.expected.append(float(term))

    def on_train_batch_end(self, trainer: pl.Trainer, m: Any, out: Any, b: Any, i: int) -> None:
        # The term recomputed here by hand (other kernels and order than the callback's): float32
        # losses over a few hundred terms, so about n * eps ~ 1e-5 relative in the worst case.
        assert float(out["loss"]) == pytest.approx(m.task_losses[-1] + self.expected[-1], rel=1e-5)
        self.checked += 1


def two_pairs(teacher: Teacher) -> tuple[nn.Conv2d, FeatureDistillation]:
    """MSE through a 1x1 connector on `features.2` (weight 0.5) and KL at T=4 on `head`
    (weight 2): the connector and the callback."""
    connector = nn.Conv2d(6, 12, 1, bias=False)
    return connector, FeatureDistillation(
        teacher,
        PAIRS,
        loss={"features.2": "mse", "head": KLDivLoss(temperature=4.0)},
        weight={"features.2": 0.5, "head": 2.0},
        connectors={"features.2": connector, "head": "identity"},
    )


def test_term_is_added_to_the_returned_loss_and_logged() -> None:
    teacher, student = seeded()
    connector, distill = two_pairs(teacher)
    expect = ExpectTerm(teacher, connector)
    trainer = fit(student, [distill, expect], max_steps=3)
    assert expect.checked == 3
    logged = trainer.logged_metrics
    assert set(logged) == {"distill/features.2", "distill/head", "distill/total"}
    assert float(logged["distill/total"]) == pytest.approx(expect.expected[-1], rel=1e-5)
    total = float(logged["distill/features.2"]) + float(logged["distill/head"])
    # The callback's float32 sum against the float64 sum of the two float32 terms: half an ulp
    # (6e-8 relative) apart at most.
    assert float(logged["distill/total"]) == pytest.approx(total, rel=1e-6)


def test_a_second_run_at_once_is_refused_and_the_first_keeps_its_terms() -> None:
    # One callback handed to two Trainers running at once (a sweep in threads): the second run
    # used to take the teacher and the step patch over, and the first then failed with "no step
    # is running"; the second is now refused at its start, naming the first run's thread.
    teacher, student = seeded()
    connector, distill = two_pairs(teacher)
    expect, hold = ExpectTerm(teacher, connector), Hold()
    check_second_run_refused(
        lambda: fit(student, [distill, expect, hold], max_steps=3),
        lambda: fit(Student(), [distill], max_steps=3),
        hold,
    )
    assert expect.checked == 3  # each step of the first run had its term
    assert live_hooks() == [] and not is_patched(student)


def test_auto_connector_is_built_trained_and_kept_out_of_the_student() -> None:
    teacher, student = seeded()
    distill = FeatureDistillation(teacher, PAIRS, loss={"features.2": "mse", "head": "kl"})
    trainer = fit(student, [distill], max_steps=2)
    connector = distill.connectors["features.2"]
    assert isinstance(connector, nn.Conv2d) and connector.weight.shape == (12, 6, 1, 1)
    assert isinstance(distill.connectors["head"], nn.Identity)
    groups = trainer.optimizers[0].param_groups
    assert len(groups) == 2 and groups[1]["params"] == [connector.weight]
    assert connector.weight.grad is not None and connector.weight.grad.abs().sum() > 0
    assert not any(k.startswith("_") or "connector" in k for k in student.state_dict())


# --------------------------------------------------------------------------- the teacher
class WatchTeacher(pl.Callback):
    def __init__(self, teacher: nn.Module) -> None:
        self.teacher = teacher
        self.seen = 0

    def on_train_batch_end(self, trainer: pl.Trainer, m: Any, out: Any, b: Any, i: int) -> None:
        assert not self.teacher.training
        assert not any(p.requires_grad or p.grad is not None for p in self.teacher.parameters())
        assert all(p.device == m.device for p in self.teacher.parameters())
        assert is_patched(m)
        # The patched module still deep-copies and pickles; copies are unpatched.
        for clone in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
            assert not isinstance(clone.__dict__.get("training_step"), StepPatch)
        self.seen += 1


def test_teacher_frozen_in_eval_unchanged_and_absent_from_the_checkpoint(tmp_path: Path) -> None:
    teacher, student = seeded()
    before = copy.deepcopy(teacher.state_dict())
    distill = FeatureDistillation(teacher, PAIRS)
    watch = WatchTeacher(teacher)
    trainer = fit(student, [distill, watch], max_steps=3)
    assert watch.seen == 3
    for key, value in teacher.state_dict().items():
        assert torch.equal(value, before[key]), key
    # Left as found: train mode and requires_grad are restored after fit.
    assert teacher.training and all(p.requires_grad for p in teacher.parameters())
    assert "training_step" not in student.__dict__

    path = tmp_path / "student.ckpt"
    trainer.save_checkpoint(path)
    ckpt = torch.load(path, weights_only=True)
    teacher_tensors = {t.data_ptr() for t in teacher.state_dict().values()}
    assert set(ckpt["state_dict"]) == set(Student().state_dict())
    assert not teacher_tensors & {t.data_ptr() for t in ckpt["state_dict"].values()}
    fresh = Student()
    fresh.load_state_dict(ckpt["state_dict"], strict=True)
    # The optimizer state is what configure_optimizers creates; connectors live in the callback.
    assert len(ckpt["optimizer_states"][0]["param_groups"]) == 1
    state = ckpt["callbacks"][distill.state_key]
    assert state["pairs"]["features.2"]["teacher_shape"] == [12, 8, 8]
    assert not any("head.weight" in k for k in state["pairs"]["features.2"]["weights"])


def test_validation_runs_the_teacher_only_when_asked() -> None:
    teacher, student = seeded()
    fit(
        student,
        [FeatureDistillation(teacher, PAIRS)],
        max_epochs=1,
        val=loader(16),
        num_sanity_val_steps=2,
    )
    assert teacher.calls == 4  # one per training batch, none for sanity check or validation

    teacher, student = seeded()
    distill = FeatureDistillation(teacher, PAIRS, log_validation=True)
    trainer = fit(student, [distill], max_epochs=1, val=loader(16), num_sanity_val_steps=2)
    assert teacher.calls == 4 + 2  # plus the two validation batches (sanity check skipped)
    assert {"val/distill/features.2", "val/distill/head", "val/distill/total"} <= set(
        trainer.callback_metrics
    )


class SharedStepStudent(Student):
    """Its validation_step calls training_step, a common way to share the step."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.log("val_loss", self.training_step(batch, batch_idx))


class ValLoss(pl.Callback):
    """The task's validation loss, computed by hand in the validation batches' hook."""

    def __init__(self) -> None:
        self.expected: list[float] = []

    def on_validation_batch_start(self, trainer: pl.Trainer, m: Any, batch: Any, i: int) -> None:
        with torch.no_grad():
            self.expected.append(float(F.cross_entropy(m(batch[0]), batch[1])))


@pytest.mark.parametrize("add_to_loss", [True, False])
@pytest.mark.parametrize("log_validation", [False, True])
def test_a_training_step_called_by_validation_step_adds_no_term(
    add_to_loss: bool, log_validation: bool
) -> None:
    """Validation does not add the term to a training_step that validation_step calls, nor run
    the teacher for it; log_validation=True still logs the validation terms."""

    class Explicit(SharedStepStudent):
        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            return super().training_step(batch, batch_idx) + distillation_loss(self)

    torch.manual_seed(0)
    teacher = Teacher()
    student = SharedStepStudent() if add_to_loss else Explicit()
    distill = FeatureDistillation(
        teacher, PAIRS, add_to_loss=add_to_loss, log_validation=log_validation
    )
    val_loss = ValLoss()
    trainer = fit(student, [distill, val_loss], max_epochs=1, limit_train_batches=2, val=loader(16))
    assert teacher.calls == 2 + (2 if log_validation else 0)  # training batches, then validation
    # the mean of two float32 cross-entropies, recomputed on the same weights and batches
    want = sum(val_loss.expected) / 2
    assert float(trainer.callback_metrics["val_loss"]) == pytest.approx(want, rel=1e-6)
    assert ("val/distill/total" in trainer.callback_metrics) == log_validation
    # the same in a validate() of its own
    val_loss.expected.clear()
    (metrics,) = trainer.validate(student, loader(16), verbose=False)
    assert metrics["val_loss"] == pytest.approx(sum(val_loss.expected) / 2, rel=1e-6)
    assert ("val/distill/total" in metrics) == log_validation


def test_validate_then_fit_builds_trainable_connectors() -> None:
    teacher, student = seeded()
    distill = FeatureDistillation(teacher, PAIRS, log_validation=True)
    trainer = pl.Trainer(callbacks=[distill], **trainer_kwargs())
    metrics = trainer.validate(student, loader(16), verbose=False)
    assert "val/distill/total" in metrics[0] and teacher.calls == 2
    weight = distill.connectors["features.2"].weight.detach().clone()
    fit(student, [distill], max_steps=2)
    assert not torch.equal(weight, distill.connectors["features.2"].weight)


# --------------------------------------------------------------------------- restoration
class Boom(Student):
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        if batch_idx == 1:
            raise RuntimeError("boom in training_step")
        return super().training_step(batch, batch_idx)


def test_training_step_restored_after_fit_and_after_an_exception() -> None:
    teacher, _ = seeded()
    student = Boom()
    with pytest.raises(RuntimeError, match="boom in training_step"):
        fit(student, [FeatureDistillation(teacher, PAIRS)], max_steps=3)
    assert "training_step" not in student.__dict__
    assert teacher.training and all(p.requires_grad for p in teacher.parameters())

    # An instance attribute that was there before comes back, the same object.
    student = Student()
    own = student.training_step
    student.training_step = own  # type: ignore[method-assign]
    fit(student, [FeatureDistillation(teacher, PAIRS)], max_steps=1)
    assert student.__dict__["training_step"] is own


def test_two_teachers_chain_and_unwind() -> None:
    torch.manual_seed(0)
    first, second, student = Teacher(), Teacher(), Student()
    callbacks: list[pl.Callback] = [
        FeatureDistillation(first, PAIRS, loss="l1", log_prefix="kd1"),
        FeatureDistillation(second, PAIRS, log_prefix="kd2"),  # same pairs, another state key
    ]
    trainer = fit(student, callbacks, max_steps=2)
    assert {"kd1/total", "kd2/total", "kd1/head", "kd2/features.2"} <= set(trainer.logged_metrics)
    assert callbacks[0].state_key != callbacks[1].state_key
    assert first.calls == second.calls == 2
    assert "training_step" not in student.__dict__


@pytest.mark.parametrize("fails", [False, True], ids=["fit", "exception"])
def test_one_teacher_shared_by_two_callbacks_is_put_back_as_it_was(fails: bool) -> None:
    """Each callback freezes the teacher; the flags from before the first come back, whichever
    callback lets go first, after a fit and after an exception."""
    torch.manual_seed(0)
    teacher, student = Teacher(), Boom() if fails else Student()
    teacher.features[0].requires_grad_(False)  # a teacher in train mode with a frozen part
    flags = [p.requires_grad for p in teacher.parameters()]
    assert teacher.training and not all(flags) and any(flags)
    callbacks: list[pl.Callback] = [
        FeatureDistillation(teacher, {"head": "head"}, loss="l1", log_prefix="kd1"),
        FeatureDistillation(teacher, {"features.2": "features.2"}, log_prefix="kd2"),
    ]
    if fails:
        with pytest.raises(RuntimeError, match="boom in training_step"):
            fit(student, callbacks, max_steps=3)
    else:
        trainer = fit(student, callbacks, max_steps=2)
        assert {"kd1/head", "kd2/features.2"} <= set(trainer.logged_metrics)
    assert teacher.training
    assert [p.requires_grad for p in teacher.parameters()] == flags
    assert "training_step" not in student.__dict__ and live_hooks() == []


def test_two_teachers_with_one_log_prefix_are_refused_before_anything_is_installed() -> None:
    """One ``distill/total`` would overwrite the other: refused when the fit sets up."""
    torch.manual_seed(0)
    first, second, student = Teacher(), Teacher(), Student()
    callbacks: list[pl.Callback] = [
        FeatureDistillation(first, {"head": "head"}),
        FeatureDistillation(second, {"features.2": "features.2"}),  # another state key
    ]
    with pytest.raises(
        RecorderConfigError,
        match=r"each FeatureDistillation of a Trainer to have its own `log_prefix`, but .* both "
        r"have 'distill': both would log 'distill/total'.* another `log_prefix` "
        r"\(e.g. 'distill_2'\)",
    ):
        fit(student, callbacks, max_steps=2)
    assert first.calls == second.calls == 0
    assert not is_patched(student) and live_hooks() == []


# --------------------------------------------------------------------------- accumulation
def test_gradient_accumulation_matches_a_manual_loop() -> None:
    teacher, student = seeded(lr=0.1)
    connector = nn.Conv2d(6, 12, 1, bias=False)
    ref_student, ref_connector = copy.deepcopy(student), copy.deepcopy(connector)
    distill = FeatureDistillation(
        teacher, {"features.2": "features.2"}, weight=0.5, connectors={"features.2": connector}
    )
    fit(student, [distill], max_steps=2, accumulate_grad_batches=2)

    params = [*ref_student.parameters(), *ref_connector.parameters()]
    optimizer = torch.optim.SGD(params, lr=0.1)
    for i, (x, y) in enumerate(loader()):
        with torch.no_grad():
            target = teacher.features[:3](x)
        feats = ref_student.features[:3](x)
        logits = ref_student.head(F.relu(feats).mean((2, 3)))
        loss = F.cross_entropy(logits, y) + 0.5 * F.mse_loss(ref_connector(feats), target)
        (loss / 2).backward()
        if i % 2 == 1:
            optimizer.step()
            optimizer.zero_grad()
    for got, want in zip([*student.parameters(), *connector.parameters()], params, strict=True):
        torch.testing.assert_close(got, want)


# --------------------------------------------------------------------------- resume
def _run(teacher: Teacher, epochs: int, ckpt: Path | None, save: Path | None) -> tuple[Any, ...]:
    torch.manual_seed(1)
    student = Student(lr=0.01, optimizer="adam", step_lr=True)
    distill = FeatureDistillation(copy.deepcopy(teacher), PAIRS)
    trainer = pl.Trainer(callbacks=[distill], max_epochs=epochs, **trainer_kwargs())
    trainer.fit(student, loader(), ckpt_path=ckpt)
    if save is not None:
        trainer.save_checkpoint(save)
    optimizer = trainer.optimizers[0]
    connector = distill.connectors["features.2"].weight
    # the scheduler drives the connectors' group too, and reports it after its steps
    (config,) = trainer.lr_scheduler_configs
    assert config.scheduler.get_last_lr() == [g["lr"] for g in optimizer.param_groups]
    return student, connector, optimizer.state[connector], optimizer.param_groups[1]["lr"]


def test_resume_restores_connectors_and_their_optimizer_state(tmp_path: Path) -> None:
    torch.manual_seed(0)
    teacher = Teacher()
    student_a, conn_a, state_a, lr_a = _run(teacher, 2, None, None)
    path = tmp_path / "epoch1.ckpt"
    _, conn_b, _, _ = _run(teacher, 1, None, path)
    student_c, conn_c, state_c, lr_c = _run(teacher, 2, path, None)

    assert not torch.equal(conn_b, conn_a)  # the second epoch changed the connector
    torch.testing.assert_close(conn_c, conn_a)
    for key in ("step", "exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(state_c[key], state_a[key])
    assert lr_c == lr_a == pytest.approx(0.01 * 0.5**8)  # the scheduler drives the connectors too
    for got, want in zip(student_c.parameters(), student_a.parameters(), strict=True):
        torch.testing.assert_close(got, want)


def test_resume_with_another_log_prefix_restores_connectors_and_their_optimizer_state(
    tmp_path: Path,
) -> None:
    """``log_prefix`` makes the callback's ``state_key``: a fit resumed with another takes the
    connectors the checkpoint holds for the same pairs, with a warning, and trains on as the
    same callback would."""
    torch.manual_seed(0)
    teacher = Teacher()
    student_a, conn_a, state_a, _ = _run(teacher, 2, None, None)
    path = tmp_path / "epoch1.ckpt"
    _run(teacher, 1, None, path)
    torch.manual_seed(0)
    student = Student(lr=0.01, optimizer="adam", step_lr=True)
    distill = FeatureDistillation(copy.deepcopy(teacher), PAIRS, log_prefix="kd")
    trainer = pl.Trainer(callbacks=[distill], max_epochs=2, **trainer_kwargs())
    with pytest.warns(UserWarning, match=r"takes the connectors of the checkpoint's Feature"):
        trainer.fit(student, loader(), ckpt_path=path)
    conn_c = distill.connectors["features.2"].weight
    torch.testing.assert_close(conn_c, conn_a)
    for key in ("step", "exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(trainer.optimizers[0].state[conn_c][key], state_a[key])
    for got, want in zip(student.parameters(), student_a.parameters(), strict=True):
        torch.testing.assert_close(got, want)
    # `validate` with the checkpoint measures the checkpoint's connectors too
    losses = []
    for prefix in ("distill", "kd"):
        distill = FeatureDistillation(
            copy.deepcopy(teacher), PAIRS, log_prefix=prefix, log_validation=True
        )
        trainer = pl.Trainer(callbacks=[distill], **trainer_kwargs())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the notice of the other prefix
            (logged,) = trainer.validate(Student(), loader(), ckpt_path=path, verbose=False)
        losses.append(logged[f"val/{prefix}/features.2"])
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)


class SeeRestored(pl.Callback):
    """After the callbacks' ``on_train_start`` (connectors restored, in the optimizer): each
    callback's connector weight and its Adam state, copied."""

    def __init__(self, callbacks: list[FeatureDistillation]) -> None:
        self.callbacks = callbacks
        self.seen: dict[str | None, tuple[Tensor, dict[str, Tensor]]] = {}

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for distill in self.callbacks:
            if "features.2" not in distill.connectors:  # a fresh fit: built at its first step
                continue
            weight = distill.connectors["features.2"].weight
            state = trainer.optimizers[0].state[weight]
            self.seen[distill.name] = (
                weight.detach().clone(),
                {k: v.clone() for k, v in state.items()},
            )


def test_two_named_callbacks_with_the_same_pairs_each_resume_their_own_connectors(
    tmp_path: Path,
) -> None:
    """``name`` makes the ``state_key``: two callbacks of one Trainer with the same pairs keep
    their states apart, and each resumes its own (weights and optimizer state, exactly), also
    with their `log_prefix`es swapped, which would swap the states of unnamed callbacks."""
    torch.manual_seed(0)
    teachers = {"a": Teacher(), "b": Teacher()}  # other teachers: other connectors

    def run(prefixes: dict[str, str], ckpt: Path | None) -> tuple[Any, ...]:
        torch.manual_seed(1)
        callbacks = [
            FeatureDistillation(copy.deepcopy(teachers[n]), PAIRS, log_prefix=p, name=n)
            for n, p in prefixes.items()
        ]
        see = SeeRestored(callbacks)
        student = Student(lr=0.01, optimizer="adam")
        trainer = pl.Trainer(
            callbacks=[*callbacks, see], max_epochs=1 + (ckpt is not None), **trainer_kwargs()
        )
        trainer.fit(student, loader(), ckpt_path=ckpt)
        return trainer, callbacks, see.seen

    trainer, saved, _ = run({"a": "kd1", "b": "kd2"}, None)
    assert saved[0].state_key == "FeatureDistillation{'name': 'a'}"
    assert saved[1].state_key == "FeatureDistillation{'name': 'b'}"
    trainer.save_checkpoint(tmp_path / "named.ckpt")
    ckpt = torch.load(tmp_path / "named.ckpt", weights_only=True)
    kept = {name: ckpt["callbacks"][f"FeatureDistillation{{'name': '{name}'}}"] for name in "ab"}
    weights = {name: kept[name]["pairs"]["features.2"]["weights"]["weight"] for name in "ab"}
    assert not torch.equal(weights["a"], weights["b"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, _, seen = run({"a": "kd2", "b": "kd1"}, tmp_path / "named.ckpt")
    # each finds its own state: no notice of taking another's
    assert not [w for w in caught if "FeatureDistillation:" in str(w.message)]
    assert sorted(seen) == ["a", "b"]
    for name, (weight, state) in seen.items():
        assert torch.equal(weight, weights[name]), name
        (saved_state,) = kept[name]["optimizer"]["state"]  # the one connector weight's
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(state[key], saved_state[key]), (name, key)


def test_the_state_key_without_a_name_is_that_of_earlier_versions(tmp_path: Path) -> None:
    """Without ``name`` the ``state_key`` is made of ``pairs`` and ``log_prefix`` as before, so
    a checkpoint of an earlier version resumes into a callback made without ``name``; one made
    with a name takes it, with a notice naming its ``name``."""
    teacher, student = seeded()
    distill = FeatureDistillation(copy.deepcopy(teacher), PAIRS)
    assert distill.state_key == (
        "FeatureDistillation{'pairs': {'features.2': 'features.2', 'head': 'head'}, "
        "'log_prefix': 'distill'}"
    )
    trainer = fit(student, [distill], max_epochs=1)
    trainer.save_checkpoint(tmp_path / "unnamed.ckpt")
    weight = distill.connectors["features.2"].weight.detach().clone()
    for name in (None, "probe"):
        resumed = FeatureDistillation(copy.deepcopy(teacher), PAIRS, name=name)
        see = SeeRestored([resumed])
        trainer = pl.Trainer(callbacks=[resumed, see], max_epochs=2, **trainer_kwargs())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(Student(), loader(), ckpt_path=tmp_path / "unnamed.ckpt")
        notices = [str(w.message) for w in caught if "FeatureDistillation:" in str(w.message)]
        if name is None:  # its own state, found under its own key
            assert notices == []
        else:
            assert len(notices) == 1
            assert (
                "no state for this callback's `name` 'probe', so it takes the connectors of "
                "the checkpoint's FeatureDistillation{'pairs'" in notices[0]
            )
        assert torch.equal(see.seen[name][0], weight), name


def test_resume_with_another_connector_says_the_checkpoint_holds_other_weights(
    tmp_path: Path,
) -> None:
    teacher, student = seeded()
    pair = {"features.2": "features.2"}
    trainer = fit(student, [FeatureDistillation(copy.deepcopy(teacher), pair)], max_epochs=1)
    trainer.save_checkpoint(tmp_path / "last.ckpt")  # an automatic connector: a 1x1 conv, no bias

    def with_bias(s_shape: torch.Size, t_shape: torch.Size) -> nn.Module:
        return nn.Conv2d(s_shape[1], t_shape[1], 1)

    distill = FeatureDistillation(copy.deepcopy(teacher), pair, connectors=with_bias)
    resumed = Student()
    trainer = pl.Trainer(callbacks=[distill], max_epochs=2, **trainer_kwargs())
    with pytest.raises(
        RecorderConfigError,
        match=r"connector of pair 'features.2' to take the weights saved in the checkpoint's "
        r"FeatureDistillation state \(weight \[12, 6, 1, 1\]\) but the Conv2d built from this "
        r"run's `connectors` does not \(.*\"bias\"\)\. Resume with the `connectors`",
    ):
        trainer.fit(resumed, loader(), ckpt_path=tmp_path / "last.ckpt")
    assert not is_patched(resumed) and live_hooks() == []


def test_resume_with_another_teacher_names_the_restored_connectors_shapes(
    tmp_path: Path,
) -> None:
    teacher, student = seeded()
    pair = {"features.2": "features.2"}
    trainer = fit(student, [FeatureDistillation(copy.deepcopy(teacher), pair)], max_epochs=1)
    trainer.save_checkpoint(tmp_path / "last.ckpt")  # its connector maps 6 channels to 12
    teacher.features[2] = nn.Conv2d(8, 16, 3, padding=1)  # a wider teacher: 16 channels
    teacher.head = nn.Linear(16, 3)
    resumed = Student()
    trainer = pl.Trainer(
        callbacks=[FeatureDistillation(teacher, pair)], max_epochs=2, **trainer_kwargs()
    )
    with pytest.raises(
        RecorderConfigError,
        match=r"features of pair 'features.2' -> 'features.2' to have the shapes its connector, "
        r"restored from the checkpoint, was built for \(student \[6, 8, 8\], teacher "
        r"\[12, 8, 8\], without the batch dimension\) but got student \[6, 8, 8\] and "
        r"teacher \[16, 8, 8\]: the student or the teacher is not the one of the run",
    ):
        trainer.fit(resumed, loader(), ckpt_path=tmp_path / "last.ckpt")
    assert not is_patched(resumed) and live_hooks() == []


# --------------------------------------------------------------------------- explicit form
class ExplicitStudent(Student):
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        return loss + distillation_loss(self)


class ManualStudent(Student):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> None:
        optimizer = self.optimizers()
        x, y = batch
        loss = F.cross_entropy(self(x), y) + distillation_loss(self)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()


def test_explicit_term_in_training_step_equals_the_automatic_one() -> None:
    teacher, auto_student = seeded()
    explicit_student = copy.deepcopy(ExplicitStudent())
    explicit_student.load_state_dict(auto_student.state_dict())
    torch.manual_seed(5)  # the connectors are initialised from the random stream
    fit(auto_student, [FeatureDistillation(copy.deepcopy(teacher), PAIRS)], max_steps=3)
    distill = FeatureDistillation(copy.deepcopy(teacher), PAIRS, add_to_loss=False)
    torch.manual_seed(5)
    trainer = fit(explicit_student, [distill], max_steps=3)
    assert "distill/total" in trainer.logged_metrics
    for got, want in zip(explicit_student.parameters(), auto_student.parameters(), strict=True):
        torch.testing.assert_close(got, want)


def test_manual_optimization_needs_the_explicit_form() -> None:
    teacher, _ = seeded()
    with pytest.raises(RecorderConfigError, match="Expected `add_to_loss=False` with manual"):
        fit(ManualStudent(), [FeatureDistillation(teacher, PAIRS)], max_steps=1)
    distill = FeatureDistillation(teacher, PAIRS, add_to_loss=False)
    fit(ManualStudent(), [distill], max_steps=2)
    assert distill.connectors["features.2"].weight.grad is not None


def test_the_explicit_form_in_the_tuners_trial_steps_names_the_tuner() -> None:
    # Lightning's Tuner runs its trial steps without the Trainer's callbacks (no teacher)
    from lightning.pytorch.tuner import Tuner

    teacher, _ = seeded()
    student = ExplicitStudent()
    trainer = pl.Trainer(
        callbacks=[FeatureDistillation(teacher, PAIRS, add_to_loss=False)],
        **trainer_kwargs(max_steps=2),
    )
    with pytest.raises(
        RecorderStateError,
        match=r"found none \(with add_to_loss=True the term is already added to the loss\)\. "
        r"Lightning's Tuner, `lr_find` and `scale_batch_size`, runs its trial steps without "
        r"the Trainer's callbacks, so without the teacher: to tune, use add_to_loss=True",
    ):
        Tuner(trainer).lr_find(student, loader(), num_training=2, update_attr=False)
    assert not is_patched(student) and live_hooks() == []


class LrFindAtEpochs(LearningRateFinder):
    """Lightning's documented pattern: ``lr_find`` at the start of chosen epochs of the fit."""

    def __init__(self, epochs: tuple[int, ...], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.epochs = epochs

    def on_fit_start(self, *args: Any, **kwargs: Any) -> None:
        return

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.current_epoch in self.epochs:
            self.lr_find(trainer, pl_module)


@pytest.mark.parametrize("epochs", [(0,), (1, 2)], ids=["at-the-start", "mid-fit"])
def test_the_learning_rate_finder_as_a_callback_leaves_the_fit_as_it_was(
    epochs: tuple[int, ...], tmp_path: Path
) -> None:
    # The finder's trial steps (the Trainer's callbacks set aside) run without the teacher, so
    # no connector is built or stepped there; a finder in a later epoch restores the optimizer
    # states saved without the connectors' group. Its suggestion is not applied: the fit is
    # that of a run without it.
    runs = []
    for finder in (None, LrFindAtEpochs(epochs, num_training_steps=3, update_attr=False)):
        teacher, student = seeded(optimizer="adam")
        distill = FeatureDistillation(teacher, PAIRS)
        callbacks = [distill] + ([finder] if finder else [])
        trainer = fit(student, callbacks, max_epochs=3, default_root_dir=tmp_path)
        groups = [len(g["params"]) for g in trainer.optimizers[0].param_groups]
        runs.append((student.state_dict(), distill.connectors["features.2"].state_dict(), groups))
    (plain, plain_connector, plain_groups), (found, found_connector, found_groups) = runs
    assert plain_groups == found_groups == [6, 1]  # the student's, then the connector's
    torch.testing.assert_close(found, plain)  # the same float32 steps: rounding at most
    torch.testing.assert_close(found_connector, plain_connector)
    assert live_hooks() == []


class EarlyTermStudent(Student):
    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        term = distillation_loss(self)  # before the student's forward: no teacher pass yet
        x, y = batch
        return F.cross_entropy(self(x), y) + term


def test_distillation_loss_errors() -> None:
    teacher, _ = seeded()
    early = FeatureDistillation(teacher, PAIRS, add_to_loss=False)
    with pytest.raises(
        RecorderStateError,
        match=r"teacher to have run in this step, but the student's forward was never called.*"
        r"compiled before this run.*torch\.compiler\.reset\(\)",
    ):
        fit(EarlyTermStudent(), [early], max_steps=1)
    with pytest.raises(RecorderStateError, match=r"Expected a FeatureDistillation\(\.\.\., add"):
        fit(ExplicitStudent(), [FeatureDistillation(teacher, PAIRS)], max_steps=1)
    distill = FeatureDistillation(teacher, PAIRS, add_to_loss=False)
    with pytest.raises(RecorderStateError, match="inside `training_step` while"):
        distill.loss()


# --------------------------------------------------------------------------- teacher input
class SubmoduleStudent(Student):
    """Calls its submodules directly: the student's own forward never runs."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self.head(self.features(x).mean((2, 3))), y)


def test_teacher_input_maps_the_batch() -> None:
    teacher, _ = seeded()
    with pytest.raises(RecorderStateError, match="student's forward was never called"):
        fit(SubmoduleStudent(), [FeatureDistillation(teacher, PAIRS)], max_steps=1)
    distill = FeatureDistillation(teacher, PAIRS, teacher_input=lambda batch: batch[0] * 2)
    fit(SubmoduleStudent(), [distill], max_steps=2)
    assert teacher.calls == 2
    assert teacher.last_input is not None
    first_batch = list(loader())[1][0]
    torch.testing.assert_close(teacher.last_input, first_batch * 2)


class MaskedTeacher(Teacher):
    """Takes its input Hugging Face style: a positional tensor and a keyword mask."""

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:  # type: ignore[override]
        self.mask = mask
        return super().forward(x if mask is None else x * mask)


class DictStudent(Student):
    """Takes dict batches and calls its submodules directly (its forward never runs)."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x = batch["x"] * batch["mask"]
        return F.cross_entropy(self.head(self.features(x).mean((2, 3))), batch["y"])

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.head(self.features(batch["x"] * batch["mask"]).mean((2, 3)))


def dict_loader() -> Any:
    x, y = loader().dataset.tensors
    mask = (torch.arange(8) < 6).float().expand(len(x), 1, 8, 8)
    rows = [{"x": x[i], "mask": mask[i], "y": y[i]} for i in range(len(x))]
    return torch.utils.data.DataLoader(rows, batch_size=8)


def test_teacher_input_may_give_keyword_arguments() -> None:
    """A TeacherInput returned by teacher_input is the teacher's call, positional and keyword:
    a dict batch gives a Hugging Face style teacher its input and mask (in training and in
    validation); anything else is the teacher's one argument."""
    torch.manual_seed(0)
    teacher = MaskedTeacher()
    distill = FeatureDistillation(
        teacher,
        PAIRS,
        teacher_input=lambda batch: TeacherInput(batch["x"], mask=batch["mask"]),
        log_validation=True,
    )
    trainer = pl.Trainer(
        callbacks=[distill],
        **trainer_kwargs(max_epochs=1, limit_train_batches=2, limit_val_batches=1),
    )
    trainer.fit(DictStudent(), dict_loader(), dict_loader())
    assert teacher.calls == 3  # two training steps, one validation batch
    last = next(iter(dict_loader()))  # validation ran last, on the first batch
    assert teacher.mask is not None
    torch.testing.assert_close(teacher.mask, last["mask"], rtol=0, atol=0)
    torch.testing.assert_close(teacher.last_input, last["x"] * last["mask"], rtol=0, atol=0)
    assert "val/distill/total" in trainer.logged_metrics
    assert repr(TeacherInput(torch.ones(2, 3), mask=None)) == (
        "TeacherInput(Tensor(2, 3) float32, mask=NoneType)"
    )


def test_teacher_input_returning_a_dict_points_to_teacher_input_class() -> None:
    torch.manual_seed(0)
    distill = FeatureDistillation(MaskedTeacher(), PAIRS, teacher_input=lambda batch: batch)
    trainer = pl.Trainer(callbacks=[distill], **trainer_kwargs(max_steps=1))
    with pytest.raises(RecorderConfigError, match=r"return TeacherInput\(\*args, \*\*kwargs\)"):
        trainer.fit(DictStudent(), dict_loader())
    assert distill._runner.module is None and live_hooks() == []

    class BatchStudent(DictStudent):  # its forward takes the dict batch
        def forward(self, batch: Any) -> Tensor:  # type: ignore[override]
            return self.head(self.features(batch["x"] * batch["mask"]).mean((2, 3)))

        def training_step(self, batch: Any, batch_idx: int) -> Tensor:
            return F.cross_entropy(self(batch), batch["y"])

    distill = FeatureDistillation(MaskedTeacher(), PAIRS)
    trainer = pl.Trainer(callbacks=[distill], **trainer_kwargs(max_steps=1))
    with pytest.raises(
        RecorderConfigError,
        match=r"could not take the student's input \(dict\).*For a dict batch, "
        r"teacher_input=lambda batch: TeacherInput\(\*\*batch\)",
    ):
        trainer.fit(BatchStudent(), dict_loader())


# --------------------------------------------------------------------------- deliveries
class SameInput(pl.Callback):
    def __init__(self, teacher: Teacher) -> None:
        self.teacher = teacher
        self.same: list[bool] = []

    def on_train_batch_end(self, trainer: pl.Trainer, m: Any, out: Any, b: Any, i: int) -> None:
        self.same.append(torch.equal(self.teacher.last_input, m.last_input))


def test_deliveries_give_the_student_the_teachers_augmentation() -> None:
    deliveries = {"noise": {"type": "FunctionOutputs", "source": "helpers.distill_models.jitter"}}
    for config, expected in ((None, False), (deliveries, True)):
        torch.manual_seed(0)
        teacher, student = Teacher(use_jitter=True), Student(use_jitter=True)
        watch = SameInput(teacher)
        distill = FeatureDistillation(teacher, PAIRS, deliveries=config)
        # Validation (no teacher there) calls jitter normally: no delivery error.
        fit(student, [distill, watch], max_steps=3, val=loader(8), num_sanity_val_steps=1)
        assert watch.same == [expected] * 3


# --------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"teacher": "resnet"}, "Expected `teacher` to be an nn.Module but got str"),
        ({"pairs": {}}, "Expected `pairs` to be a non-empty mapping"),
        ({"pairs": {"head": ""}}, "map non-empty module names to module names but got 'head': ''"),
        ({"pairs": {"total": "head"}}, "no student module named 'total'"),
        (
            {"loss": {"haed": "mse"}},
            "keys of `loss` to be student module names.*Closest pairs: 'head'",
        ),
        (
            {"loss": {"head": "kl"}},
            "Expected `loss` to give a value for every pair but 'features.2'",
        ),
        ({"loss": "msee"}, "Unknown loss type 'msee'.*Closest types: 'mse'"),
        (
            {"weight": -1.0},
            "weight` of pair 'features.2' to be a finite non-negative number but got -1.0",
        ),
        ({"weight": {"head": 1.0}}, "Expected `weight` to give a value for every pair"),
        ({"resize": 1}, "Expected `resize` to be a bool but got 1"),
        ({"log_validation": "yes"}, "Expected `log_validation` to be a bool"),
        ({"teacher_input": 3}, "Expected `teacher_input` to be a callable"),
        ({"optimizer_idx": -1}, "Expected `optimizer_idx` to be a non-negative int"),
        ({"connector_lr": "fast"}, "Expected `connector_lr` to be a finite non-negative number"),
        ({"connectors": {"head2": "auto"}}, "keys of `connectors`.*Closest pairs: 'head'"),
        ({"deliveries": {"d": {"type": "Function"}}}, "Unknown delivery type 'Function'"),
        ({"log_prefix": ""}, "Expected `log_prefix` to be a non-empty str but got ''"),
        ({"on_nonfinite": "loud"}, "Expected `on_nonfinite` to be one of 'warn', 'raise'"),
        ({"name": " "}, "Expected `name` of FeatureDistillation to be a non-empty str or None"),
        ({"name": 3}, "Expected `name` of FeatureDistillation to be a str but got 3"),
    ],
)
def test_invalid_arguments_raise_in_init(kwargs: dict[str, Any], match: str) -> None:
    arguments: dict[str, Any] = {"teacher": Teacher(), "pairs": PAIRS, **kwargs}
    with pytest.raises(RecorderConfigError, match=match):
        FeatureDistillation(**arguments)


def test_loss_options_for_every_named_loss_or_per_pair() -> None:
    distill = FeatureDistillation(
        Teacher(), {"head": "head"}, "kl", loss_options={"temperature": 2}
    )
    assert distill._runner.losses["head"].temperature == 2.0  # type: ignore[union-attr]
    distill = FeatureDistillation(
        Teacher(),
        PAIRS,
        loss={"features.2": "mse", "head": "kl"},
        loss_options={"head": {"temperature": 3.0}},
    )
    assert isinstance(distill._runner.losses["features.2"], MSELoss)
    assert distill._runner.losses["head"].temperature == 3.0  # type: ignore[union-attr]
    custom = KLDivLoss(temperature=5.0)  # modules are used as they are
    distill = FeatureDistillation(
        Teacher(), PAIRS, loss={"features.2": "cosine", "head": custom}, loss_options={"dim": 1}
    )
    assert distill._runner.losses["head"] is custom
    assert distill._runner.losses["features.2"].dim == 1  # type: ignore[union-attr]
    with pytest.raises(RecorderConfigError, match="Expected no options for the 'mse' loss"):
        FeatureDistillation(Teacher(), PAIRS, loss="mse", loss_options={"temperature": 2.0})


def test_loss_options_that_no_loss_takes_are_refused() -> None:
    # one mapping of options with only modules and callables as losses configured nothing: a
    # KLDivLoss() kept temperature 1 without a word, while the per-pair form raised or bound
    def scaled(student: Tensor, teacher: Tensor, scale: float = 1.0) -> Tensor:
        return mse_loss(student, teacher) * scale

    for loss in (KLDivLoss(), {"features.2": scaled, "head": KLDivLoss()}):
        with pytest.raises(
            RecorderConfigError,
            match=r"Expected `loss_options` for a loss given by its name or class, but the loss "
            r"of every pair is a module or a callable, used as it is, so 'temperature' would "
            r"configure nothing\. Configure the module itself \(`KLDivLoss\(temperature=4\.0\)`\)",
        ):
            FeatureDistillation(Teacher(), PAIRS, loss=loss, loss_options={"temperature": 4.0})
    distill = FeatureDistillation(
        Teacher(), {"features.2": "features.2"}, scaled, loss_options={"features.2": {"scale": 2}}
    )
    assert distill._runner.losses["features.2"].keywords == {"scale": 2}  # type: ignore[union-attr]


def _no_return(student: Tensor, teacher: Tensor) -> None:
    mse_loss(student, teacher)  # the `return` forgotten


@pytest.mark.parametrize(
    ("loss", "name", "got"),
    [
        (nn.MSELoss(reduction="none"), r"MSELoss\(\)", r"a tensor of shape \(8, 3\)"),
        (lambda s, t: mse_loss(s, t).item(), "<lambda>", r"float [\d.]+"),
        (_no_return, "_no_return", "NoneType None"),
    ],
)
def test_a_loss_that_returns_no_single_value_names_the_pair(loss: Any, name: str, got: str) -> None:
    # failed inside the callback (AttributeError: 'float' object has no attribute 'detach';
    # TypeError on None * weight) or in a self.log call the user never wrote
    student = Student()
    with pytest.raises(
        RecorderConfigError,
        match=rf"Expected the loss of pair 'head' -> 'head' \({name}\) to return a tensor of one "
        rf"element but got {got}\. .*reduce it \(`\.mean\(\)`\)",
    ):
        fit(student, [FeatureDistillation(Teacher(), {"head": "head"}, loss=loss)], max_steps=1)
    assert "training_step" not in student.__dict__ and not live_hooks()


class TeacherInside(Student):
    def __init__(self, teacher: nn.Module) -> None:
        super().__init__()
        self.teacher = teacher


class TupleStudent(Student):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return (super().training_step(batch, batch_idx),)


def test_errors_found_when_fitting() -> None:
    teacher, student = seeded()
    with pytest.raises(
        UnknownSourceError,
        match=r"No module named 'feature\.2'.*'features\.2'.*looked up in the student \(Student\): "
        r"the keys of `pairs`",
    ):
        fit(student, [FeatureDistillation(teacher, {"feature.2": "features.2"})], max_steps=1)
    with pytest.raises(
        UnknownSourceError,
        match=r"No module named 'nope'.*looked up in the teacher \(Teacher\): the values of",
    ):
        fit(student, [FeatureDistillation(teacher, {"features.2": "nope"})], max_steps=1)
    with pytest.raises(RecorderConfigError, match="teacher to live outside the student"):
        fit(TeacherInside(teacher), [FeatureDistillation(teacher, PAIRS)], max_steps=1)
    with pytest.raises(
        RecorderConfigError,
        match=r"teacher to be another model than the student but got the student itself "
        r"\(Student\)\. .*copy\.deepcopy\(student\)",
    ):
        fit(student, [FeatureDistillation(student, PAIRS)], max_steps=1)
    with pytest.raises(RecorderConfigError, match="Expected `training_step` to return a loss"):
        fit(TupleStudent(), [FeatureDistillation(teacher, PAIRS)], max_steps=1)
    with pytest.raises(RecorderConfigError, match=r"same rank but got student \(8, 3\)"):
        fit(Student(), [FeatureDistillation(teacher, {"head": "features.2"})], max_steps=1)
    assert "training_step" not in student.__dict__


class LBFGSStudent(Student):
    def configure_optimizers(self) -> Any:
        return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=3)


def test_lbfgs_cannot_train_connectors_and_says_so_before_its_step() -> None:
    teacher, _ = seeded()
    distill = FeatureDistillation(teacher, PAIRS)
    with pytest.raises(
        RecorderConfigError,
        match=r"connectors of pairs \['features\.2'\] \(an extra parameter group\) but got "
        r"LBFGS, which optimizes exactly one parameter group\..*connectors='identity'",
    ):
        fit(LBFGSStudent(), [distill], max_steps=1)
    assert "features.2" not in distill.connectors  # no connector left half-attached
    assert live_hooks() == []
    # a pair whose shapes match needs no connector parameters: LBFGS trains it
    distill = FeatureDistillation(teacher, {"head": "head"})
    trainer = fit(LBFGSStudent(), [distill], max_steps=2)
    assert len(trainer.optimizers[0].param_groups) == 1
    assert trainer.global_step == 2 and float(trainer.callback_metrics["distill/head"]) > 0


class PackedLSTM(nn.Module):
    """An LSTM over a packed batch: its output is (PackedSequence, (h, c))."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 4, batch_first=True)
        self.head = nn.Linear(4, N_CLASSES)

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, 8, 8)  # 8 steps of 8 features
        lengths = torch.arange(rows.shape[0]) % 8 + 1
        packed = nn.utils.rnn.pack_padded_sequence(rows, lengths, True, enforce_sorted=False)
        _, (h, _) = self.lstm(packed)
        return self.head(h[-1])


class PackedStudent(Student):
    def __init__(self) -> None:
        super().__init__()
        self.net = PackedLSTM()

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


def test_a_packed_sequence_output_is_named_with_the_fix_of_its_side() -> None:
    with pytest.raises(
        RecorderConfigError,
        match=r"student module 'net\.lstm' to be a tensor .* but got a tuple whose first item is "
        r"a PackedSequence; pair a submodule of the student that returns a tensor \(the student "
        r"side takes no path\)\.$",
    ):
        fit(PackedStudent(), [FeatureDistillation(PackedLSTM(), {"net.lstm": "lstm"})], max_steps=1)
    with pytest.raises(
        RecorderConfigError,
        match=r"teacher module 'lstm' to be a tensor .* but got a tuple whose first item is a "
        r"PackedSequence; give the teacher side a path: \{'source': name, 'path': \.\.\.\}\.$",
    ):
        fit(PackedStudent(), [FeatureDistillation(PackedLSTM(), {"net.head": "lstm"})], max_steps=1)
    assert live_hooks() == []


def test_a_teacher_sharing_a_trainable_parameter_with_the_student_is_refused() -> None:
    teacher, student = seeded()
    # the student's first Conv2d (4 channels) is the teacher's too
    teacher.features[0], teacher.features[2] = student.features[0], nn.Conv2d(4, 12, 3, padding=1)
    before = student.features[0].weight.detach().clone()
    distill = FeatureDistillation(teacher, {"features.2": "features.2"})
    with pytest.raises(
        RecorderConfigError,
        match=r"share no trainable parameter with the student but the teacher's "
        r"'features\.0\.weight' is the student's 'features\.0\.weight'.*copy\.deepcopy",
    ):
        fit(student, [distill], max_steps=1)
    assert all(p.requires_grad for p in student.parameters())
    assert not live_hooks()
    # frozen in the student too, it may be shared: the rest of the student trains
    student.features[0].requires_grad_(False)
    fit(student, [distill], max_steps=1)
    assert torch.equal(student.features[0].weight, before)  # frozen: never stepped


def test_spatial_mismatch_fails_naming_both_shapes_or_is_resized() -> None:
    strided = nn.Sequential(nn.Conv2d(1, 12, 3, stride=2, padding=1))  # (N, 12, 4, 4)
    pairs = {"features.2": "0"}
    with pytest.raises(
        RecorderConfigError,
        match=r"same spatial size \(H, W\) but got student \(8, 6, 8, 8\) and teacher "
        r"\(8, 12, 4, 4\)\. Pass `resize=True`",
    ):
        fit(Student(), [FeatureDistillation(strided, pairs)], max_steps=1)
    distill = FeatureDistillation(strided, pairs, resize=True)
    fit(Student(), [distill], max_steps=1)
    assert distill.connectors["features.2"](torch.zeros(2, 6, 8, 8)).shape == (2, 12, 4, 4)


# --------------------------------------------------------------------------- attention transfer
class StridedTeacher(Teacher):
    """features.2: (N, 12, 4, 4), half the student's (H, W)."""

    def __init__(self) -> None:
        super().__init__()
        self.features[2] = nn.Conv2d(8, 12, 3, stride=2, padding=1)


class TermStudent(Student):
    """Adds the distillation term itself (``add_to_loss=False``) and keeps each step's term."""

    def __init__(self) -> None:
        super().__init__()
        self.terms: list[float] = []

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        term = distillation_loss(self)
        self.terms.append(float(term.detach()))
        return loss + term


class ExpectAttention(pl.Callback):
    """Attention transfer of the raw ``features.2`` maps, recomputed by hand in float64 before
    each step (the student map resized bilinearly, antialiased, to the teacher's (H, W) where
    they differ)."""

    def __init__(self, teacher: Teacher) -> None:
        self.teacher = teacher
        self.expected: list[float] = []

    def on_train_batch_start(self, trainer: pl.Trainer, m: Any, batch: Any, idx: int) -> None:
        x, _ = batch
        with torch.no_grad():
            s, t = m.features[:3](x).double(), self.teacher.features[:3](x).double()
        if s.shape[2:] != t.shape[2:]:
            # the student map shrinks to the teacher's: antialiased, as the connector does
            s = F.interpolate(
                s, size=t.shape[2:], mode="bilinear", align_corners=False, antialias=True
            )

        def at_map(f: Tensor) -> Tensor:  # mean over channels of f**2, per sample L2-normalised
            a = f.pow(2).mean(dim=1).flatten(1)
            return a / a.norm(dim=1, keepdim=True)

        self.expected.append(float((at_map(s) - at_map(t)).pow(2).mean()))


@pytest.mark.parametrize(
    ("strided", "loss"),
    [(False, "at"), (False, attention_transfer_loss), (True, AttentionTransferLoss())],
    ids=["same-size-name", "same-size-function", "resized-module"],
)
def test_attention_transfer_with_auto_connectors_learns_no_connector(
    strided: bool, loss: Any, tmp_path: Path
) -> None:
    """6 student channels against 12 teacher channels: attention transfer compares channel-
    pooled maps, so 'auto' gives its pair no parameters (it built a learned 1x1 convolution,
    an extra optimizer group that trained nothing the loss used): an identity, or the resize
    of `resize=True` where the maps' (H, W) differ."""
    torch.manual_seed(0)
    teacher, student = StridedTeacher() if strided else Teacher(), TermStudent()
    pairs = {"features.2": "features.2"}

    def distill() -> FeatureDistillation:
        return FeatureDistillation(
            copy.deepcopy(teacher), pairs, loss=loss, add_to_loss=False, resize=strided
        )

    callback = distill()
    expect = ExpectAttention(callback.teacher)
    trainer = fit(student, [callback, expect], max_steps=3)
    connector = callback.connectors["features.2"]
    assert list(connector.parameters()) == [] and list(connector.buffers()) == []
    if strided:
        assert connector(torch.zeros(2, 6, 8, 8)).shape == (2, 6, 4, 4)
    else:
        assert isinstance(connector, nn.Identity)
    assert len(trainer.optimizers[0].param_groups) == 1  # no connector group
    # The callback's float32 loss against the float64 one of the raw float32 features: a few
    # ulps of the maps' normalisation and of a mean over 64 (or 16) positions: below 1e-7
    # relative here.
    assert len(student.terms) == len(expect.expected) == 3
    for got, want in zip(student.terms, expect.expected, strict=True):
        assert got == pytest.approx(want, rel=1e-5)
        assert want > 1e-4  # a term worth comparing, not a zero

    # A checkpoint of it saves no connector weights and resumes: the resumed run ends where an
    # uninterrupted one does.
    def run(epochs: int, ckpt: Path | None = None, save: Path | None = None) -> TermStudent:
        torch.manual_seed(1)
        student = TermStudent()
        trainer = pl.Trainer(callbacks=[distill()], **trainer_kwargs(max_epochs=epochs))
        trainer.fit(student, loader(), ckpt_path=ckpt)
        if save is not None:
            trainer.save_checkpoint(save)
        assert len(trainer.optimizers[0].param_groups) == 1
        return student

    path = tmp_path / "epoch1.ckpt"
    run(1, save=path)
    state = torch.load(path, weights_only=True)
    assert len(state["optimizer_states"][0]["param_groups"]) == 1
    (saved,) = [v for k, v in state["callbacks"].items() if k.startswith("FeatureDistillation")]
    assert saved["pairs"]["features.2"]["weights"] == {} and saved["optimizer"] is None
    resumed, straight = run(2, ckpt=path), run(2)
    assert resumed.terms == pytest.approx(straight.terms[4:], rel=1e-6)  # the same float32 ops
    for got, want in zip(resumed.parameters(), straight.parameters(), strict=True):
        torch.testing.assert_close(got, want)  # float32 defaults: rtol 1.3e-6, atol 1e-5


def test_attention_transfer_maps_of_other_sizes_without_resize_name_both_shapes() -> None:
    distill = FeatureDistillation(StridedTeacher(), {"features.2": "features.2"}, loss="at")
    student = Student()
    with pytest.raises(
        RecorderConfigError,
        match=r"same spatial size \(H, W\) but got student \(8, 6, 8, 8\) and teacher "
        r"\(8, 12, 4, 4\)\. Pass `resize=True`",
    ):
        fit(student, [distill], max_steps=1)
    assert not is_patched(student) and live_hooks() == []
    assert distill.teacher.training and all(p.requires_grad for p in distill.teacher.parameters())


def test_an_explicit_connector_of_an_attention_transfer_pair_is_kept(tmp_path: Path) -> None:
    teacher, student = seeded()
    pair = {"features.2": "features.2"}
    # what 'auto' built before: a 1x1 convolution, still given by its factory
    distill = FeatureDistillation(teacher, pair, loss="at", connectors=build_connector)
    trainer = fit(student, [distill], max_steps=1)
    assert isinstance(distill.connectors["features.2"], nn.Conv2d)
    assert len(trainer.optimizers[0].param_groups) == 2
    trainer.save_checkpoint(tmp_path / "learned.ckpt")
    # such a checkpoint, resumed with 'auto', says how to go on with its learned connector
    distill = FeatureDistillation(copy.deepcopy(teacher), pair, loss="at")
    resumed = Student()
    trainer = pl.Trainer(callbacks=[distill], **trainer_kwargs(max_steps=2))
    with pytest.raises(
        RecorderConfigError,
        match=r"weights saved in the checkpoint's FeatureDistillation state \(weight "
        r"\[12, 6, 1, 1\]\) but the Identity built .* The automatic connector of an attention "
        r"transfer pair has no parameters .* `lightning_recorder\.build_connector`",
    ):
        trainer.fit(resumed, loader(), ckpt_path=tmp_path / "learned.ckpt")
    assert not is_patched(resumed) and live_hooks() == []
    # and with the factory it goes on training the saved connector: one SGD step from the saved
    # weight (a fresh one, uniform in +-1/sqrt(6), would be some tenths away)
    saved = torch.load(tmp_path / "learned.ckpt", weights_only=True)["callbacks"]
    (weight,) = [v["pairs"]["features.2"]["weights"]["weight"] for v in saved.values()]
    distill = FeatureDistillation(
        copy.deepcopy(teacher), pair, loss="at", connectors=build_connector
    )
    trainer = pl.Trainer(callbacks=[distill], **trainer_kwargs(max_steps=2))
    trainer.fit(Student(), loader(), ckpt_path=tmp_path / "learned.ckpt")
    assert trainer.global_step == 2
    resumed_weight = distill.connectors["features.2"].weight.detach()
    assert 0 < float((resumed_weight - weight).abs().max()) < 0.05


# --------------------------------------------------------------------------- logits
def five_class_teacher() -> Teacher:
    """A teacher whose head has 5 classes where the student's has 3."""
    teacher = Teacher()
    teacher.head = nn.Linear(12, 5)
    return teacher


@pytest.mark.parametrize(
    ("loss", "options"),
    [
        ("kl", {"temperature": 4.0}),
        (KLDivLoss(temperature=4.0), None),
        (kl_div_loss, {"head": {"temperature": 4.0}}),
    ],
    ids=["name", "module", "function"],
)
def test_logits_of_other_class_counts_are_refused_naming_the_pair_and_both_counts(
    loss: Any, options: Any
) -> None:
    """'auto' mapped 3 student logits to 5 teacher classes through a learned Linear, without a
    word: a KL divergence between a projection and the teacher's classes is rarely meant."""
    torch.manual_seed(0)
    teacher, student = five_class_teacher(), Student()
    teacher.features[0].requires_grad_(False)  # flags to put back as they were
    distill = FeatureDistillation(teacher, {"head": "head"}, loss=loss, loss_options=options)
    with pytest.raises(
        RecorderConfigError,
        match=r"^Expected the student and teacher logits of pair 'head' -> 'head' to have the "
        r"same number of classes for the KL divergence but got 3 student classes and 5 teacher "
        r"classes \(dim 1\): .* connectors='auto' builds none\. Pair logits over the same "
        r"classes; or, if the mapping is deliberate, give this pair a connector of its own: "
        r"a module \(torch\.nn\.Linear\(3, 5\) for \(N, C\) logits\)",
    ):
        fit(student, [distill], max_steps=1)
    # nothing left behind: no connector, hook or patch; the teacher's flags as they were
    assert distill.connectors == {}
    assert not is_patched(student) and live_hooks() == []
    assert teacher.training
    assert [p.requires_grad for p in teacher.parameters()] == [False, False, True, True, True, True]


@pytest.mark.parametrize(
    ("loss", "what"),
    [
        (nn.KLDivLoss(reduction="batchmean"), "the KL divergence"),
        (functools.partial(F.kl_div, reduction="batchmean"), "the KL divergence"),
        (nn.CrossEntropyLoss(), "the cross-entropy"),  # soft targets: the teacher's features
        (F.cross_entropy, "the cross-entropy"),
    ],
    ids=["torch-kl-module", "torch-kl-function", "torch-ce-module", "torch-ce-function"],
)
def test_logits_of_other_class_counts_are_refused_for_torchs_losses_too(
    loss: Any, what: str
) -> None:
    """torch's own losses between two distributions, given as the pair's loss, got the same
    learned Linear from 3 student logits to 5 teacher classes, without a word."""
    torch.manual_seed(0)
    teacher, student = five_class_teacher(), Student()
    distill = FeatureDistillation(teacher, {"head": "head"}, loss=loss)
    with pytest.raises(
        RecorderConfigError,
        match=rf"logits of pair 'head' -> 'head' to have the same number of classes for {what} "
        r"but got 3 student classes and 5 teacher classes \(dim 1\): " + what,
    ):
        fit(student, [distill], max_steps=1)
    assert distill.connectors == {}


def test_logits_of_other_class_counts_train_through_an_explicit_connector(tmp_path: Path) -> None:
    """A connector given for the pair is used as before (the mapping is deliberate), trained,
    saved and restored: a resumed run ends where an uninterrupted one does."""
    torch.manual_seed(0)
    teacher = five_class_teacher()
    pairs = {"features.2": "features.2", "head": "head"}
    loss = {"features.2": "mse", "head": "kl"}

    def run(epochs: int, ckpt: Path | None = None, save: Path | None = None) -> tuple[Any, ...]:
        torch.manual_seed(1)
        student, head = Student(), nn.Linear(3, 5, bias=False)
        distill = FeatureDistillation(
            copy.deepcopy(teacher), pairs, loss=loss, connectors={"head": head}
        )
        trainer = pl.Trainer(callbacks=[distill], **trainer_kwargs(max_epochs=epochs))
        trainer.fit(student, loader(), ckpt_path=ckpt)
        if save is not None:
            trainer.save_checkpoint(save)
        assert distill.connectors["head"] is head
        (group,) = trainer.optimizers[0].param_groups[1:]  # both pairs' connectors
        assert group["params"] == [distill.connectors["features.2"].weight, head.weight]
        return student, head.weight.detach().clone()

    path = tmp_path / "epoch1.ckpt"
    _, first = run(1, save=path)
    student_b, weight_b = run(2, ckpt=path)
    student_a, weight_a = run(2)
    assert not torch.equal(weight_a, first)  # the second epoch trained it
    # the same float32 operations in the same order: torch's float32 defaults (rtol 1.3e-6,
    # atol 1e-5) allow for nothing more than rounding
    torch.testing.assert_close(weight_b, weight_a)
    for got, want in zip(student_b.parameters(), student_a.parameters(), strict=True):
        torch.testing.assert_close(got, want)


def test_a_connector_built_for_other_shapes_fails_naming_the_pair_and_shapes() -> None:
    teacher, student = seeded()
    # features.2 is (N, 6, 8, 8) in the student: a connector made for 5 channels cannot take it
    distill = FeatureDistillation(teacher, PAIRS, connectors={"features.2": nn.Conv2d(5, 12, 1)})
    with pytest.raises(
        RecorderConfigError,
        match=r"connector of pair 'features.2' -> 'features.2' to take the student feature of "
        r"shape \(8, 6, 8, 8\) \(to map it to the teacher's \(8, 12, 8, 8\)\) but Conv2d\(5, 12",
    ):
        fit(student, [distill], max_steps=1)
    assert not is_patched(student) and live_hooks() == []


def narrow_student() -> Student:
    """A student whose ``features.2`` has 5 channels where :class:`Student`'s has 6."""
    narrow = Student()
    narrow.features[2] = nn.Conv2d(4, 5, 3, padding=1)
    narrow.head = nn.Linear(5, 3)
    return narrow


def test_a_second_fit_with_another_student_names_the_connector_of_the_first() -> None:
    # the callback keeps its 'auto' connectors from one fit to the next: a student of other
    # widths is told so, not to "leave this pair's connector to 'auto'" (it is)
    teacher, student = seeded()
    distill = FeatureDistillation(teacher, {"features.2": "features.2"})
    fit(student, [distill], max_steps=1)  # its connector maps 6 channels to 12
    narrow = narrow_student()
    with pytest.raises(
        RecorderConfigError,
        match=r"features of pair 'features.2' -> 'features.2' to have the shapes its connector, "
        r"from an earlier fit or validation of this FeatureDistillation, was built for "
        r"\(student \[6, 8, 8\], teacher \[12, 8, 8\], without the batch dimension\) but got "
        r"student \[5, 8, 8\] and teacher \[12, 8, 8\]: the callback keeps its connectors .* "
        r"Use a new FeatureDistillation for another student or teacher\.",
    ):
        fit(narrow, [distill], max_steps=1)
    assert not is_patched(narrow) and live_hooks() == []
    with pytest.warns(UserWarning, match="trained with another student"):
        fit(Student(), [distill], max_steps=1)  # a student of the same widths goes on with it


def test_a_second_fit_with_another_student_warns_that_it_starts_from_the_connectors() -> None:
    """The connectors a fit trained are kept for the next fit: with another student of the same
    widths that fit starts from them, which it is told (not with the same student)."""
    teacher, student = seeded()
    distill = FeatureDistillation(teacher, PAIRS, loss={"features.2": "mse", "head": "kl"})
    fit(student, [distill], max_steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(student, [distill], max_steps=1)  # the same student goes on: nothing to say
    assert not [w for w in caught if "another student" in str(w.message)]
    trained = distill.connectors["features.2"].weight.detach().clone()
    other = Student()
    with pytest.warns(UserWarning) as caught_other:
        trainer = pl.Trainer(callbacks=[distill], **trainer_kwargs(max_steps=1))
        trainer.fit(other, loader())
    messages = [str(w.message) for w in caught_other if "another student" in str(w.message)]
    assert len(messages) == 1
    # the identity connector of 'head' holds nothing trained: only 'features.2' is named
    assert "pairs ['features.2'] were trained with another student" in messages[0]
    assert "use a new FeatureDistillation" in messages[0]
    # it did start from the first student's connector: one small SGD step away from it (a
    # fresh one, uniform in +-1/sqrt(6), would be some tenths away), and it is the one trained
    weight = distill.connectors["features.2"].weight
    assert trainer.optimizers[0].param_groups[1]["params"] == [weight]
    assert 0 < float((weight - trained).abs().max()) < 0.05
    clone = pickle.loads(pickle.dumps(distill))  # still pickles (ddp_spawn) after fits
    assert torch.equal(clone.connectors["features.2"].weight, weight)


def test_a_fit_after_a_resumed_one_names_the_connector_of_the_earlier_fit(tmp_path: Path) -> None:
    # the connector was restored in the resumed fit: a later fit without `ckpt_path` is not
    # told to "start a new fit (without `ckpt_path`)"
    teacher, student = seeded()
    distill = FeatureDistillation(teacher, {"features.2": "features.2"})
    fit(student, [distill], max_steps=1).save_checkpoint(tmp_path / "one.ckpt")
    trainer = pl.Trainer(callbacks=[distill], **trainer_kwargs(max_steps=2))
    trainer.fit(Student(), loader(), ckpt_path=tmp_path / "one.ckpt")
    narrow = narrow_student()
    with pytest.raises(
        RecorderConfigError,
        match=r"its connector, from an earlier fit or validation of this FeatureDistillation, "
        r"was built for \(student \[6, 8, 8\], teacher \[12, 8, 8\]",
    ):
        fit(narrow, [distill], max_steps=1)
    assert not is_patched(narrow) and live_hooks() == []


def test_teacher_checkpoint(tmp_path: Path) -> None:
    torch.manual_seed(3)
    trained = Teacher()
    torch.save(trained.state_dict(), tmp_path / "teacher.pt")
    torch.save({"state_dict": trained.state_dict(), "epoch": 3}, tmp_path / "teacher.ckpt")
    for name in ("teacher.pt", "teacher.ckpt"):
        distill = FeatureDistillation(Teacher(), PAIRS, teacher_checkpoint=str(tmp_path / name))
        for got, want in zip(distill.teacher.parameters(), trained.parameters(), strict=True):
            assert torch.equal(got, want)
    with pytest.raises(RecorderConfigError, match=r"Expected `teacher_checkpoint` .*missing\.pt"):
        FeatureDistillation(Teacher(), PAIRS, teacher_checkpoint=str(tmp_path / "missing.pt"))
    torch.save({"head.weight": torch.zeros(1)}, tmp_path / "wrong.pt")
    with pytest.raises(RecorderConfigError, match="to hold the teacher's weights"):
        FeatureDistillation(Teacher(), PAIRS, teacher_checkpoint=str(tmp_path / "wrong.pt"))


# --------------------------------------------------------------------------- docs and example
ROOT = Path(__file__).resolve().parents[2]

MY_MODELS = """
import random

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def random_flip(x):
    return x.flip(-1) if random.random() < 0.5 else x


def cnn(width):
    return nn.Sequential(
        nn.Conv2d(1, width, 3, padding=1), nn.ReLU(), nn.Conv2d(width, width, 3, padding=1)
    )


class Teacher(nn.Module):
    def __init__(self, width=32):
        super().__init__()
        self.features, self.head = cnn(width), nn.Linear(width, 3)

    def forward(self, x):
        self.seen = random_flip(x)
        return self.head(self.features(self.seen).relu().mean((2, 3)))


class Student(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.features, self.head = cnn(4), nn.Linear(4, 3)

    def forward(self, x):
        self.seen = random_flip(x)
        return self.head(self.features(self.seen).relu().mean((2, 3)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)

    def train_dataloader(self):
        data = TensorDataset(torch.randn(32, 1, 8, 8), torch.randint(0, 3, (32,)))
        return DataLoader(data, batch_size=8)
"""


def test_docs_yaml_config_runs_with_lightning_cli(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lightning.pytorch.cli import LightningCLI

    page = (ROOT / "docs" / "distillation.md").read_text()
    config = page.split("```yaml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "config.yaml").write_text(config)
    package = tmp_path / "my_project"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "models.py").write_text(MY_MODELS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    try:
        from my_project.models import Teacher as MyTeacher  # type: ignore[import-not-found]

        torch.manual_seed(7)
        trained = MyTeacher(width=16)
        torch.save(trained.state_dict(), tmp_path / "teacher.pt")
        cli = LightningCLI(run=False, args=["--config", "config.yaml"], save_config_callback=None)
        (distill,) = [c for c in cli.trainer.callbacks if isinstance(c, FeatureDistillation)]
        assert distill.pairs == {"features.2": "features.2", "head": "head"}
        assert isinstance(distill._runner.losses["head"], KLDivLoss)
        assert distill._runner.losses["head"].temperature == 4.0
        assert distill._runner.weights == {"features.2": 0.5, "head": 1.0}
        for got, want in zip(distill.teacher.parameters(), trained.parameters(), strict=True):
            assert torch.equal(got, want)
        cli.trainer.fit(cli.model)
        assert {"distill/features.2", "distill/head", "distill/total"} <= set(
            cli.trainer.logged_metrics
        )
        assert torch.equal(distill.teacher.seen, cli.model.seen)  # the delivery shared the flip
    finally:
        for name in [m for m in sys.modules if m.split(".")[0] == "my_project"]:
            del sys.modules[name]


def load_example(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_example_distill_digits_runs_and_prints_its_table() -> None:
    example = load_example("distill_digits")
    lines: list[str] = []
    threads = torch.get_num_threads()
    runs = example.main(seeds=2, steps=3, report=lines.append)
    assert torch.get_num_threads() == threads  # put back as it was
    assert len(runs) == 2
    for run in runs:
        assert list(run) == ["teacher", "hard", "soft", "small hard", "small soft"]
        assert set(run["soft"]) == {"all", "digit", "all+", "digit+"}
        assert all(0.0 <= v <= 1.0 for scores in run.values() for v in scores.values())
    assert lines[0].startswith("seed 0: digit 3 recognised by the teacher")
    assert "898 training and 899 test images; 3 steps of 128 images" in lines[2]
    table = lines[3].splitlines()
    assert table[0].startswith("| model | trained on | test: digit 3 | test: all digits |")
    assert [row.split(" | ")[1] for row in table[2:]] == [
        "all digits", "all but the 3s", "all but the 3s", "44 images", "44 images",
    ]  # fmt: skip
    assert " ± " in table[2]  # two seeds: mean ± std (min-max)


def test_example_distill_digits_from_the_command_line_writes_nothing(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    script = ROOT / "examples" / "distill_digits.py"
    args = ["--steps", "2", "--omit", "5", "--fraction", "0.1"]
    proc = subprocess.run(
        [sys.executable, str(script), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "seed 0: digit 5 recognised by the teacher" in proc.stdout
    assert "| student, distilled | all but the 5s |" in proc.stdout
    assert "| student, hard labels | 89 images |" in proc.stdout
    assert "GPU available" not in proc.stdout + proc.stderr  # no Lightning banner per fit
    assert list(tmp_path.iterdir()) == []  # no logs, no checkpoints


@pytest.mark.slow
def test_example_distill_digits_shows_the_omitted_digit_learned_from_soft_targets() -> None:
    # Hinton et al. (2015), section 3, in miniature: the hard-label student never predicts the
    # digit left out of its transfer set, the distilled one recognises most of it.
    example = load_example("distill_digits")
    run = example.main(seeds=1, steps=200, report=lambda line: None)[0]
    assert run["teacher"]["digit"] > 0.9
    assert run["hard"]["digit"] == 0.0
    assert run["soft"]["digit"] > 0.5
    assert run["soft"]["digit+"] >= run["soft"]["digit"] - 0.05  # the bias correction helps
    assert run["soft"]["all"] > run["hard"]["all"] + 0.03


def test_benchmark_measures_both_variants(monkeypatch: pytest.MonkeyPatch) -> None:
    spec = importlib.util.spec_from_file_location(
        "_test_bench_distillation", ROOT / "benchmarks" / "bench_distillation.py"
    )
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # dataclasses look their module up
    spec.loader.exec_module(bench)
    threads = torch.get_num_threads()
    try:
        result = bench.bench(bench.CASES[-1], steps=4, warmup=1, repeats=2)
    finally:
        torch.set_num_threads(threads)
    assert set(result) == {"callback_ms", "hand_ms", "ratio", "ratio_min", "ratio_max"}
    assert result["callback_ms"] > 0 and result["hand_ms"] > 0
    assert result["ratio_min"] <= result["ratio"] <= result["ratio_max"]


def test_teacher_follows_the_student_precision() -> None:
    teacher, student = seeded()
    dtypes: list[torch.dtype] = []

    class Probe(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, m: Any, o: Any, b: Any, i: int) -> None:
            dtypes.append(next(teacher.parameters()).dtype)
            dtypes.append(distill.connectors["features.2"].weight.dtype)

    distill = FeatureDistillation(teacher, PAIRS)
    trainer = fit(student, [distill, Probe()], max_steps=1, precision="bf16-true")
    assert dtypes == [torch.bfloat16, torch.bfloat16]
    assert torch.isfinite(trainer.logged_metrics["distill/total"])


class _CastStudent(Student):
    """A student cast as a whole (``.double()``, ``.to(torch.bfloat16)``): it casts its batch."""

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x.to(self.head.weight.dtype)).float(), y)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_automatic_connector_takes_the_dtype_of_a_cast_student(dtype: torch.dtype) -> None:
    # Under the default precision a connector of the default dtype (float32) failed on the
    # features of a student cast with .double() or .to(torch.bfloat16).
    torch.manual_seed(0)
    teacher, student = Teacher().to(dtype), _CastStudent(lr=0.0).to(dtype)  # lr 0: unchanged
    distill = FeatureDistillation(teacher, {"features.2": "features.2"})
    trainer = fit(student, [distill], max_steps=1)
    connector = distill.connectors["features.2"]
    assert connector.weight.dtype == dtype
    x = loader().dataset[:8][0].to(dtype)  # the first batch
    with torch.no_grad():
        s_map, t_map = connector(student.features[:3](x)), teacher.features[:3](x)
    expected = ((s_map.double() - t_map.double()) ** 2).mean()
    logged = trainer.callback_metrics["distill/features.2"]
    torch.testing.assert_close(logged.double(), expected, rtol=1e-5, atol=0)


def test_resume_under_bf16_true_restores_the_connector_in_bfloat16(tmp_path: Path) -> None:
    # A restored connector was built in float32 and failed on the bfloat16 features.
    teacher, _ = seeded()
    path = tmp_path / "step1.ckpt"
    callbacks: list[pl.Callback] = [FeatureDistillation(teacher, PAIRS)]
    first = fit(Student(), callbacks, max_steps=1, precision="bf16-true")
    first.save_checkpoint(path)
    distill = FeatureDistillation(teacher, PAIRS)
    second = pl.Trainer(callbacks=[distill], **trainer_kwargs(max_steps=2, precision="bf16-true"))
    second.fit(Student(), loader(), ckpt_path=path)
    assert second.global_step == 2 and torch.isfinite(second.callback_metrics["distill/total"])
    saved = torch.load(path, weights_only=False)["callbacks"]
    (state,) = [v for k, v in saved.items() if k.startswith("FeatureDistillation")]
    weight = state["pairs"]["features.2"]["weights"]["weight"]
    assert weight.dtype == distill.connectors["features.2"].weight.dtype == torch.bfloat16
    assert distill.connectors["features.2"].weight.shape == weight.shape


@pytest.mark.parametrize(
    ("saved_in", "resumed_in", "dtype"),
    [("bf16-true", "32-true", torch.float32), ("32-true", "bf16-true", torch.bfloat16)],
)
def test_resume_in_another_precision_restores_the_connector_in_the_students_dtype(
    tmp_path: Path, saved_in: str, resumed_in: str, dtype: torch.dtype
) -> None:
    # A restored connector kept the dtype of the run that saved it and failed on the features
    # of a student in another precision, saying to give a connector built for their shapes.
    teacher, _ = seeded()
    path = tmp_path / "step1.ckpt"
    callbacks: list[pl.Callback] = [FeatureDistillation(copy.deepcopy(teacher), PAIRS)]
    first = fit(Student(), callbacks, max_steps=1, precision=saved_in)
    first.save_checkpoint(path)
    distill = FeatureDistillation(teacher, PAIRS)
    second = pl.Trainer(callbacks=[distill], **trainer_kwargs(max_steps=2, precision=resumed_in))
    second.fit(Student(), loader(), ckpt_path=path)
    assert second.global_step == 2 and torch.isfinite(second.callback_metrics["distill/total"])
    saved = torch.load(path, weights_only=True)["callbacks"]
    (state,) = [v for k, v in saved.items() if k.startswith("FeatureDistillation")]
    weight = distill.connectors["features.2"].weight
    assert weight.dtype == dtype
    want = state["pairs"]["features.2"]["weights"]["weight"].to(dtype)
    # the loaded weights after one step (which moves them by under 1e-3 here), not new ones
    # (drawn within +-0.41 for this 1x1 convolution of 6 channels)
    torch.testing.assert_close(weight.detach(), want, rtol=0, atol=0.01)


def test_callback_pickles_and_deep_copies_before_fit() -> None:
    # ddp_spawn pickles the callbacks into the worker processes.
    deliveries = {"noise": {"type": "FunctionOutputs", "source": "helpers.distill_models.jitter"}}
    distill = FeatureDistillation(Teacher(), PAIRS, deliveries=deliveries)
    for clone in (pickle.loads(pickle.dumps(distill)), copy.deepcopy(distill)):
        assert clone.pairs == PAIRS and clone.state_key == distill.state_key
        assert "noise" in clone._runner.deliveries


def test_docs_python_examples_run_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    page = ROOT / "docs" / "distillation.md"
    assert len(python_blocks(page)) >= 6
    namespace = run_page(page)
    assert isinstance(namespace["distill"], FeatureDistillation)


# ------------------------------------------------------------------ non-finite values
def nan_head(teacher: Teacher, from_call: int = 0) -> Teacher:
    """The teacher's head returns NaN from its ``from_call``-th call on."""
    calls = {"n": 0}

    def poison(module: nn.Module, args: Any, out: Tensor) -> Tensor:
        calls["n"] += 1
        return out * float("nan") if calls["n"] > from_call else out

    teacher.head.register_forward_hook(poison)
    return teacher


def test_nonfinite_teacher_feature_warns_once_naming_the_pair_and_the_step() -> None:
    teacher, student = seeded()
    distill = FeatureDistillation(nan_head(teacher, from_call=1), PAIRS)
    with pytest.warns(UserWarning, match=r"non-finite") as caught:
        fit(student, [distill], max_steps=2)
    messages = [str(w.message) for w in caught if "non-finite" in str(w.message)]
    assert len(messages) == 1, messages  # step 1 is bad (after it the student is NaN too)
    assert "teacher features of pair 'head' -> 'head' (training step 1)" in messages[0]
    assert "features.2" not in messages[0]  # the finite pair is not named


def test_nonfinite_raise_stops_the_run_and_ignore_checks_nothing() -> None:
    teacher, student = seeded()
    distill = FeatureDistillation(nan_head(teacher), PAIRS, on_nonfinite="raise")
    with pytest.raises(RecorderStateError, match=r"non-finite.*'head' -> 'head'.*step 0"):
        fit(student, [distill], max_steps=2)
    assert distill._runner.module is None  # uninstalled on the error
    teacher, student = seeded()
    quiet = FeatureDistillation(nan_head(teacher), PAIRS, on_nonfinite="ignore")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message=".*(val_dataloader|LeafSpec|log_every_n).*")
        fit(student, [quiet], max_steps=2)
    assert quiet._runner._nonfinite is None  # no flags kept


def test_a_teacher_masking_a_class_is_no_fault_where_the_term_stays_finite() -> None:
    # kl_div_loss leaves out a class the teacher gives -inf (a masked vocabulary), but the check
    # reported "the distillation loss is non-finite" for it, and on_nonfinite="raise" stopped
    def mask_first_class(module: nn.Module, args: Any, out: Tensor) -> Tensor:
        return out.index_fill(1, torch.tensor([0]), float("-inf"))

    teacher, student = seeded()
    teacher.head.register_forward_hook(mask_first_class)
    distill = FeatureDistillation(teacher, {"head": "head"}, loss="kl", on_nonfinite="raise")
    trainer = fit(student, [distill], max_steps=2)
    assert math.isfinite(float(trainer.logged_metrics["distill/head"]))
    # where the term is not finite (mse of a -inf), the teacher is named as its cause
    teacher, student = seeded()
    teacher.head.register_forward_hook(mask_first_class)
    distill = FeatureDistillation(teacher, {"head": "head"}, loss="mse", on_nonfinite="raise")
    with pytest.raises(
        RecorderStateError, match=r"in the teacher features of pair 'head' -> 'head' \(training "
    ):
        fit(student, [distill], max_steps=2)


def test_nonfinite_flags_stay_on_the_device_until_a_logging_step() -> None:
    # On a CPU the flags are read after every step; this checks the accelerator rule without
    # one: flags accumulate (device side, or-ed) between reads and are read at the steps given.
    teacher, _ = seeded()
    distill = FeatureDistillation(nan_head(teacher, from_call=1), PAIRS)
    runner = distill._runner
    runner.pairs = {"head": "head"}
    flags = [torch.tensor([[False, False]]), torch.tensor([[True, True]])]
    runner._nonfinite = flags[0] | flags[1]
    runner._nonfinite_step = 2
    with pytest.warns(UserWarning, match=r"pair 'head' -> 'head' \(training steps 2-4\)"):
        runner.check_nonfinite(5)
    assert runner._nonfinite is None and runner._nonfinite_step == 5


def test_teacher_that_cannot_take_the_student_input_points_to_teacher_input() -> None:
    class TokenTeacher(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 4)

        def forward(self, ids: Tensor) -> Tensor:
            return self.embed(ids)

    _, student = seeded()
    distill = FeatureDistillation(TokenTeacher(), {"head": "embed"})
    with pytest.raises(
        RecorderConfigError, match=r"could not take the student's input.*teacher_input="
    ):
        fit(student, [distill], max_steps=1)
    assert distill._runner.module is None


class TeacherFailure(RuntimeError):
    """An error of the teacher's own, raised after it took the student's input once."""


class FailsAtCall(Teacher):
    def __init__(self, call: int, error: Exception) -> None:
        super().__init__()
        self.failing_call, self.error = call, error

    def forward(self, x: Tensor) -> Tensor:
        if self.calls + 1 == self.failing_call:  # `calls`: Teacher's count of its calls
            raise self.error
        return super().forward(x)


@pytest.mark.parametrize(
    "error", [TeacherFailure("the teacher's own failure"), torch.OutOfMemoryError("no memory")]
)
def test_an_error_of_a_teacher_that_took_the_input_before_is_raised_as_it_is(
    error: Exception,
) -> None:
    """Only a failure on the teacher's first input can be a student's input it cannot take: a
    later error (a data-dependent failure of its own, out of memory) reaches the user with its
    own type and message, not relabelled as a configuration error about the input; out of
    memory never is."""
    torch.manual_seed(0)
    distill = FeatureDistillation(FailsAtCall(2, error), PAIRS)
    with pytest.raises(type(error), match=str(error)) as raised:
        fit(Student(), [distill], max_steps=3)
    assert not isinstance(raised.value, RecorderConfigError)
    assert distill._runner.module is None and live_hooks() == []
    if isinstance(error, torch.OutOfMemoryError):  # not relabelled at the first call either
        torch.manual_seed(0)
        distill = FeatureDistillation(FailsAtCall(1, error), PAIRS)
        with pytest.raises(torch.OutOfMemoryError):
            fit(Student(), [distill], max_steps=1)


def _encoder(nested: bool) -> nn.TransformerEncoder:
    layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
    return nn.TransformerEncoder(layer, 1, enable_nested_tensor=nested)


class _EncoderStudent(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.enc, self.head = _encoder(True), nn.Linear(8, 1)

    def forward(self, x: Tensor, pad: Tensor) -> Tensor:
        return self.head(self.enc(x, src_key_padding_mask=pad)).mean()

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        return self(*batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class _EncoderTeacher(nn.Module):
    def __init__(self, nested: bool) -> None:
        super().__init__()
        self.enc = _encoder(nested)

    def forward(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        return self.enc(batch[0], src_key_padding_mask=batch[1])


@pytest.mark.parametrize("nested", [True, False])
def test_a_teacher_transformer_s_nested_outputs_are_refused_with_the_fix(nested: bool) -> None:
    """In eval mode with a padding mask, torch's TransformerEncoder returns nested tensors
    (its fast path), which the student's dense features cannot be compared with: a clear error
    that names the fix (it crashed in torch before); with the fix the pair trains."""
    torch.manual_seed(0)
    x, pad = torch.randn(8, 5, 8), torch.zeros(8, 5, dtype=torch.bool)
    pad[:, 3:] = True
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, pad), batch_size=4)
    distill = FeatureDistillation(
        _EncoderTeacher(nested), {"enc.layers.0": "enc.layers.0"}, teacher_input=tuple
    )
    trainer = pl.Trainer(**trainer_kwargs(max_steps=2, callbacks=[distill]))
    if nested:
        student = _EncoderStudent()
        with pytest.raises(RecorderConfigError, match="nested tensor of ragged rows") as caught:
            trainer.fit(student, data)
        assert "enable_nested_tensor=False" in str(caught.value)
        assert "set_fastpath_enabled(False)" in str(caught.value)
        # nothing left behind: the student's step unpatched, no hook on either model
        assert "training_step" not in student.__dict__
        assert live_hooks() == []
    else:
        trainer.fit(_EncoderStudent(), data)
        assert trainer.global_step == 2


def test_validation_terms_under_mixed_precision() -> None:
    # The student's validation features come out of autocast in bfloat16 while the connector
    # stays in float32: the terms are computed in the same autocast context as in training.
    teacher, student = seeded()
    distill = FeatureDistillation(teacher, PAIRS, log_validation=True)
    trainer = fit(student, [distill], max_epochs=1, val=loader(16), precision="bf16-mixed")
    assert distill.connectors["features.2"].weight.dtype == torch.float32
    assert torch.isfinite(trainer.callback_metrics["val/distill/total"])
    assert torch.isfinite(trainer.callback_metrics["val/distill/features.2"])


class _InPlaceNet(nn.Module):
    """A convolution whose output ReLU(inplace=True) then changes (features.0 as recorded)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, width, 3, padding=1), nn.ReLU(inplace=True))
        self.head = nn.Linear(width, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


class _InPlaceStudent(Student):
    def __init__(self) -> None:
        super().__init__()
        self.net = _InPlaceNet(4)
        self.seen: list[tuple[Tensor, Tensor]] = []

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, _ = batch
        out = self(x)
        term = distillation_loss(self)
        self.seen.append((x, term.detach()))
        return out.sum() * 0 + term


def test_clone_records_outputs_that_an_in_place_op_changes_later() -> None:
    torch.manual_seed(0)
    teacher, student = _InPlaceNet(8), _InPlaceStudent()
    pairs = {"net.features.0": "features.0"}
    with pytest.raises(RecordModifiedError, match="clone=True"):
        fit(student, [FeatureDistillation(teacher, pairs, add_to_loss=False)], max_steps=1)

    distill = FeatureDistillation(teacher, pairs, add_to_loss=False, clone=True)
    conv = student.net.features[0]
    before = copy.deepcopy(conv)
    connectors: list[nn.Module] = []

    class KeepConnector(pl.Callback):
        def on_before_optimizer_step(self, trainer: pl.Trainer, m: Any, opt: Any) -> None:
            connectors.append(copy.deepcopy(distill.connectors["net.features.0"]))

    fit(student, [distill, KeepConnector()], max_steps=1)
    x, term = student.seen[-1]
    with torch.no_grad():  # the convolutions' outputs, before the ReLU changed them
        expected = mse_loss(connectors[0](before(x)), teacher.features[0](x))
    # float32 convolutions and a mean over 512 values, computed twice: about 1e-6 relative
    assert float(term) == pytest.approx(float(expected), rel=1e-5)
    assert not torch.equal(conv.weight, before.weight)  # the gradient reached the student
    assert live_hooks() == []


# --------------------------------------------------------------------------- token_mask
V_TOKENS, PAD = 11, 0


def padded_batches(n_batches: int = 3, n: int = 4, length: int = 6) -> list[dict[str, Tensor]]:
    """Right-padded token batches, each with other lengths (every batch has some padding)."""
    g = torch.Generator().manual_seed(0)
    batches = []
    for b in range(n_batches):
        lengths = torch.randint(1, length, (n,), generator=g)
        lengths[b % n] = length  # one full row per batch, another row each time
        mask = torch.arange(length)[None] < lengths[:, None]
        ids = torch.randint(1, V_TOKENS, (n, length), generator=g).masked_fill(~mask, PAD)
        batches.append({"ids": ids, "mask": mask.long()})
    return batches


def as_loader(batches: list[Any]) -> torch.utils.data.DataLoader:
    """The batches as they are, one per step."""
    return torch.utils.data.DataLoader(batches, batch_size=None)  # type: ignore[arg-type]


class TokenTeacher(nn.Module):
    """hidden: (N, L, 8); logits: (N, L, V_TOKENS); pool: (N, 3)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V_TOKENS, 8)
        self.hidden = nn.Linear(8, 8)
        self.logits = nn.Linear(8, V_TOKENS)
        self.pool = nn.Linear(8, 3)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.hidden(self.embed(ids)).tanh()
        return self.logits(h).mean() + self.pool(h.mean(1)).mean()


class TokenStudent(pl.LightningModule):
    """The teacher's shapes; ``batch_form`` says how the batch holds the ids: a dict or a tuple."""

    def __init__(self, batch_form: str = "dict", grads: list[dict[str, Tensor]] | None = None):
        super().__init__()
        self.net = TokenTeacher()
        self.batch_form = batch_form
        self.grads = grads

    def forward(self, ids: Tensor) -> Tensor:
        return self.net(ids)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        ids = batch["ids"] if self.batch_form == "dict" else batch[0]
        return self(ids) * 0.0

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self(batch["ids"])

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        if self.grads is not None:
            self.grads.append({n: p.grad.clone() for n, p in self.named_parameters()})

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


TOKEN_PAIRS = {"net.hidden": "hidden", "net.logits": "logits", "net.pool": "pool"}


def _token_features(net: nn.Module, ids: Tensor) -> dict[str, Tensor]:
    """The paired outputs of ``net`` (float64) on ``ids``."""
    net = copy.deepcopy(net).double()
    with torch.no_grad():
        h = net.hidden(net.embed(ids).double())
        return {"hidden": h, "logits": net.logits(h.tanh()), "pool": net.pool(h.tanh().mean(1))}


def _kl_by_hand(s: Tensor, t: Tensor, temperature: float) -> Tensor:
    """KL(softmax(t/T) || softmax(s/T)) * T**2, summed over the classes, mean over the rows."""
    log_s, log_t = (F.log_softmax(x / temperature, dim=-1) for x in (s, t))
    return (log_t.exp() * (log_t - log_s)).sum(-1).mean() * temperature**2


class ExpectMaskedTerms(pl.Callback):
    """Before each step, the float64 terms by hand: the token pairs over the real tokens only,
    the pooled pair over every row; after it, the logged terms compared with them."""

    def __init__(self, teacher: nn.Module, seen: dict[str, list[float]]) -> None:
        self.teacher, self.seen = teacher, seen
        self.expected: list[dict[str, float]] = []

    def on_train_batch_start(self, trainer: pl.Trainer, m: Any, batch: Any, idx: int) -> None:
        ids, keep = batch["ids"], batch["mask"].bool()
        s, t = _token_features(m.net, ids), _token_features(self.teacher, ids)
        self.expected.append(
            {
                "net.hidden": float(((s["hidden"][keep] - t["hidden"][keep]) ** 2).mean()),
                "net.logits": float(_kl_by_hand(s["logits"][keep], t["logits"][keep], 2.0)),
                "net.pool": float(((s["pool"] - t["pool"]) ** 2).mean()),
            }
        )

    def on_train_batch_end(self, trainer: pl.Trainer, m: Any, out: Any, b: Any, i: int) -> None:
        # float32 losses over a few hundred values against float64 by hand: ~1e-6 relative
        for pair, value in self.expected[-1].items():
            assert self.seen[pair][-1] == pytest.approx(value, rel=1e-5), pair


def _seen_losses(seen: dict[str, list[float]]) -> dict[str, Any]:
    """Per pair a loss that notes its value (and checks that it sees 2-D features on tokens)."""

    def note(pair: str, fn: Any) -> Any:
        def loss(s: Tensor, t: Tensor) -> Tensor:
            if pair != "net.pool":
                assert s.dim() == 2 and t.dim() == 2, (pair, s.shape)  # (M, C): kept tokens
            value = fn(s, t)
            seen.setdefault(pair, []).append(float(value))
            return value

        return loss

    return {
        "net.hidden": note("net.hidden", mse_loss),
        "net.logits": note("net.logits", KLDivLoss(temperature=2.0)),
        "net.pool": note("net.pool", mse_loss),
    }


@pytest.mark.parametrize(
    ("token_mask", "batch_form"),
    [
        ("mask", "dict"),  # a key
        (1, "tuple"),  # a position
        (lambda batch: batch["mask"].float(), "dict"),  # (batch) -> a float 0/1 mask
        (lambda batch, batch_idx: batch["ids"] != PAD, "dict"),  # (batch, batch_idx) -> bool
    ],
    ids=["key", "position", "batch-function", "batch-idx-function"],
)
def test_token_mask_averages_token_pairs_over_real_tokens_only(
    token_mask: Any, batch_form: str
) -> None:
    torch.manual_seed(0)
    teacher, student = TokenTeacher(), TokenStudent(batch_form)
    seen: dict[str, list[float]] = {}
    distill = FeatureDistillation(
        teacher, TOKEN_PAIRS, loss=_seen_losses(seen), connectors="identity", token_mask=token_mask
    )
    batches = padded_batches()
    data: Any = batches if batch_form == "dict" else [(b["ids"], b["mask"]) for b in batches]
    expect = ExpectMaskedTerms(teacher, seen)
    if batch_form == "tuple":  # the expectation reads a dict

        class AsDict(pl.Callback):
            def on_train_batch_start(self, tr: pl.Trainer, m: Any, b: Any, i: int) -> None:
                expect.on_train_batch_start(tr, m, {"ids": b[0], "mask": b[1]}, i)

            def on_train_batch_end(self, tr: pl.Trainer, m: Any, o: Any, b: Any, i: int) -> None:
                expect.on_train_batch_end(tr, m, o, b, i)

        watch: pl.Callback = AsDict()
    else:
        watch = expect
    trainer = pl.Trainer(callbacks=[watch, distill], max_epochs=1, **trainer_kwargs())
    trainer.fit(student, as_loader(data))
    assert len(expect.expected) == len(batches) == len(seen["net.hidden"])
    # the unmasked mean differs: the mask changed the token pairs' terms
    ids = batches[0]["ids"]
    s, t = _token_features(student.net, ids), _token_features(teacher, ids)
    assert float(((s["hidden"] - t["hidden"]) ** 2).mean()) != pytest.approx(
        float(((s["hidden"][ids != PAD] - t["hidden"][ids != PAD]) ** 2).mean()), rel=1e-3
    )


class TinyLM(pl.LightningModule):
    """A tiny Hugging Face GPT-2 (made from its config, nothing downloaded) trained on the
    batch's next tokens."""

    def __init__(self, width: int) -> None:
        super().__init__()
        transformers = pytest.importorskip("transformers")
        # initializer_range: logits far apart, so a KL well above float32's rounding (a KL of
        # 0.005 from float32 log-probabilities is only good to ~2e-5)
        config = transformers.GPT2Config(
            vocab_size=V_TOKENS, n_positions=8, n_embd=width, n_layer=1, n_head=2,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.5,
        )  # fmt: skip
        self.lm = transformers.GPT2LMHeadModel(config)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        return self.lm(input_ids=input_ids, attention_mask=attention_mask).logits

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        logits = self(input_ids=batch["ids"], attention_mask=batch["mask"])
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["ids"][:, 1:].flatten())

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_token_mask_on_hugging_face_models_matches_the_losses_over_real_tokens() -> None:
    torch.manual_seed(0)
    student, teacher = TinyLM(8), TinyLM(16).lm
    connector = nn.Linear(8, 16)
    seen: dict[str, list[float]] = {}
    pairs = {"lm.transformer.ln_f": "transformer.ln_f", "lm.lm_head": "lm_head"}

    def noting(pair: str, fn: Any) -> Any:
        def loss(s: Tensor, t: Tensor) -> Tensor:
            seen.setdefault(pair, []).append(float(fn(s, t)))
            return fn(s, t)

        return loss

    distill = FeatureDistillation(
        teacher,
        pairs,
        loss={
            "lm.transformer.ln_f": noting("hidden", mse_loss),
            "lm.lm_head": noting("logits", KLDivLoss(temperature=2.0)),
        },
        connectors={"lm.transformer.ln_f": connector, "lm.lm_head": "identity"},
        token_mask="mask",
    )
    expected: list[tuple[float, float]] = []

    class Expect(pl.Callback):
        def on_train_batch_start(self, tr: pl.Trainer, m: Any, batch: Any, i: int) -> None:
            out = {}
            # the models' float32 features (a float64 GPT-2 differs by ~2e-5), the losses in
            # float64 by hand
            for name, lm in (("s", m.lm), ("t", teacher)):
                lm = copy.deepcopy(lm)
                lm.transformer.ln_f.register_forward_hook(
                    lambda mod, a, o, name=name: out.__setitem__(name + "h", o.double())
                )
                with torch.no_grad():
                    logits = lm(input_ids=batch["ids"], attention_mask=batch["mask"]).logits
                out[name + "l"] = logits.double()
            keep = batch["mask"].bool()
            with torch.no_grad():
                s_h = copy.deepcopy(connector).double()(out["sh"])
            mse = ((s_h[keep] - out["th"][keep]) ** 2).mean()
            kl = _kl_by_hand(out["sl"][keep], out["tl"][keep], 2.0)
            expected.append((float(mse), float(kl)))

    trainer = pl.Trainer(callbacks=[Expect(), distill], max_epochs=1, **trainer_kwargs())
    trainer.fit(student, as_loader(padded_batches()))
    assert len(expected) == len(seen["hidden"]) == 3
    for (mse, kl), got_mse, got_kl in zip(expected, seen["hidden"], seen["logits"], strict=True):
        # float32 against float64 by hand, over a few hundred values: ~1e-6 relative
        assert got_mse == pytest.approx(mse, rel=1e-5)
        assert got_kl == pytest.approx(kl, rel=1e-5)


def test_token_mask_is_used_by_validation_logging() -> None:
    torch.manual_seed(0)
    teacher, student = TokenTeacher(), TokenStudent()
    distill = FeatureDistillation(
        teacher,
        {"net.hidden": "hidden"},
        connectors="identity",
        token_mask="mask",
        log_validation=True,
    )
    val = padded_batches(1)
    trainer = pl.Trainer(callbacks=[distill], max_steps=1, limit_val_batches=1, **trainer_kwargs())
    trainer.fit(student, as_loader(padded_batches(1)), as_loader(val))
    ids, keep = val[0]["ids"], val[0]["mask"].bool()
    s, t = _token_features(student.net, ids), _token_features(teacher, ids)
    expected = ((s["hidden"][keep] - t["hidden"][keep]) ** 2).mean()
    # float32 against float64 over ~100 values: ~1e-6 relative
    got = float(trainer.callback_metrics["val/distill/net.hidden"])
    assert got == pytest.approx(float(expected), rel=1e-5)


def test_an_all_padding_batch_gives_token_pairs_zero_and_a_zero_gradient() -> None:
    torch.manual_seed(0)
    teacher, grads = TokenTeacher(), []
    student = TokenStudent(grads=grads)
    distill = FeatureDistillation(
        teacher,
        {"net.hidden": "hidden", "net.logits": "logits"},
        loss="kl",
        connectors="identity",
        token_mask=lambda batch: torch.zeros_like(batch["ids"]),
        add_to_loss=True,
    )
    trainer = pl.Trainer(callbacks=[distill], max_steps=1, **trainer_kwargs())
    trainer.fit(student, as_loader(padded_batches(1)))
    assert float(trainer.callback_metrics["distill/total"]) == 0.0
    # no value for the pairs at that step (as for an empty batch), rather than a 0
    assert set(trainer.logged_metrics) == {"distill/total"}
    for name, grad in grads[0].items():
        assert torch.equal(grad, torch.zeros_like(grad)), name  # zero, not NaN


class EmptyBatchStudent(Student):
    """A task loss that is 0 on an empty batch; notes what it logs and its gradients."""

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[int, str, float]] = []
        self.grads: list[dict[str, Tensor]] = []

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y, reduction="sum") / max(len(y), 1)

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        self.logged.append((self.global_step, name, float(value)))
        super().log(name, value, *args, **kwargs)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.grads.append({n: p.grad.clone() for n, p in self.named_parameters()})


def test_an_empty_batch_adds_zero_with_a_zero_gradient_and_logs_no_term() -> None:
    """An empty batch (the last of a filtered dataset) made every pair's loss a mean over
    nothing, NaN, which poisoned the student's weights; its pairs now add 0 with a zero
    gradient and log no value at that step (a 0 would pull the curve down)."""
    teacher, _ = seeded()
    student = EmptyBatchStudent()
    x, y = loader(n=16).dataset.tensors
    batches = [(x[:8], y[:8]), (x[:0], y[:0]), (x[8:], y[8:])]  # the second one empty
    distill = FeatureDistillation(
        teacher,
        PAIRS,
        # a loss of torch's own, whose mean over nothing is NaN too, and one of the package's
        loss={"features.2": F.smooth_l1_loss, "head": KLDivLoss(temperature=4.0)},
        on_nonfinite="raise",
    )
    trainer = pl.Trainer(callbacks=[distill], max_steps=3, **trainer_kwargs())
    trainer.fit(student, as_loader(batches))
    assert trainer.global_step == 3
    for name, param in [*student.named_parameters(), *distill.connectors.items()]:
        tensors = [param] if isinstance(param, Tensor) else list(param.parameters())
        assert all(bool(torch.isfinite(t).all()) for t in tensors), name
    assert all(torch.equal(g, torch.zeros_like(g)) for g in student.grads[1].values())
    assert any(bool(g.abs().sum() > 0) for g in student.grads[2].values())
    names = {step: [n for s, n, _ in student.logged if s == step] for step in range(3)}
    assert names[0] == names[2] == ["distill/features.2", "distill/head", "distill/total"]
    assert names[1] == ["distill/total"]  # the pairs' terms are not logged as 0
    assert [v for s, n, v in student.logged if s == 1] == [0.0]


class TokensAndMaps(nn.Module):
    """tokens: (N, L, 8); maps: the same embedding as (N, L, 2, 4), maps whose channel count
    happens to equal the mask's L."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V_TOKENS, 8)
        self.tokens = nn.Linear(8, 8)
        self.maps = nn.Identity()

    def forward(self, ids: Tensor) -> Tensor:
        h = self.embed(ids)
        return self.tokens(h).mean() + self.maps(h.view(*ids.shape, 2, 4)).mean()


class TokensAndMapsStudent(TokenStudent):
    def __init__(self) -> None:
        super().__init__()
        self.net = TokensAndMaps()  # type: ignore[assignment]


def test_token_mask_leaves_feature_maps_whose_channels_match_its_length_unmasked() -> None:
    """Token features are (N, L, C), as everywhere in the package: a feature map (N, C, H, W)
    whose C happens to equal the mask's L is not cut by the mask."""
    torch.manual_seed(0)
    teacher, student = TokensAndMaps(), TokensAndMapsStudent()
    (batch,) = padded_batches(1)
    ids, keep = batch["ids"], batch["mask"].bool()
    with torch.no_grad():
        s_h, t_h = student.net.embed(ids).double(), teacher.embed(ids).double()
        maps = F.mse_loss(s_h.view(4, 6, 2, 4), t_h.view(4, 6, 2, 4))  # every position
        s_tok = student.net.tokens.double()(s_h)
        t_tok = copy.deepcopy(teacher.tokens).double()(t_h)
        tokens = F.mse_loss(s_tok[keep], t_tok[keep])  # the real tokens only
        student.net.tokens.float()
    distill = FeatureDistillation(
        teacher,
        {"net.tokens": "tokens", "net.maps": "maps"},
        connectors="identity",
        token_mask="mask",
    )
    trainer = pl.Trainer(callbacks=[distill], max_steps=1, **trainer_kwargs())
    trainer.fit(student, as_loader([batch]))
    logged = trainer.callback_metrics
    assert float(logged["distill/net.maps"]) == pytest.approx(float(maps), rel=1e-5)
    assert float(logged["distill/net.tokens"]) == pytest.approx(float(tokens), rel=1e-5)


def test_an_empty_validation_batch_weighs_nothing_in_the_epochs_terms() -> None:
    """In validation (an epoch's mean, synced over ranks) a pair without samples is logged with
    weight 0, not left out: every rank logs the same keys (a key one rank never logged would
    leave the ranks' syncs unmatched), and the mean is that of the batches with samples."""
    teacher, _ = seeded()
    student = EmptyBatchStudent()
    x, y = loader(n=16).dataset.tensors
    val = [(x[:8], y[:8]), (x[:0], y[:0]), (x[8:12], y[8:12])]  # the second one empty
    distill = FeatureDistillation(teacher, PAIRS, log_validation=True)
    trainer = pl.Trainer(callbacks=[distill], **trainer_kwargs(max_steps=0))
    trainer.validate(student, as_loader(val), verbose=False)
    per_batch = [v for _, name, v in student.logged if name == "val/distill/head"]
    assert len(per_batch) == 3 and per_batch[1] == 0.0  # logged, with weight 0
    want = (8 * per_batch[0] + 4 * per_batch[2]) / 12
    got = float(trainer.callback_metrics["val/distill/head"])
    assert got == pytest.approx(want, rel=1e-6)  # float32 sums


@pytest.mark.parametrize(
    ("token_mask", "pairs", "match"),
    [
        (
            "mask",
            {"net.pool": "pool"},
            r"of shape \(4, 6\).*'net\.pool' \(4, 3\).*applies to no pair",
        ),
        (lambda b: b["mask"][:3], TOKEN_PAIRS, r"of shape \(3, 6\).*\(4, 6, 8\)"),  # wrong N
        (lambda b: b["mask"] * 0.5, TOKEN_PAIRS, r"0 and 1 only.*\[0\.5"),
        (lambda b: b["mask"][..., None], TOKEN_PAIRS, r"\(N, L\) tensor.*\(4, 6, 1\)"),
        (lambda b: b["mask"].tolist(), TOKEN_PAIRS, r"\(N, L\) tensor.*list"),
        ("attention_mask", TOKEN_PAIRS, r"token mask at `token_mask`='attention_mask'"),
    ],
    ids=["no-pair", "wrong-n", "float-values", "3-d", "not-a-tensor", "missing-key"],
)
def test_a_wrong_token_mask_is_refused_at_the_first_step(
    token_mask: Any, pairs: dict[str, str], match: str
) -> None:
    torch.manual_seed(0)
    distill = FeatureDistillation(
        TokenTeacher(), pairs, connectors="identity", token_mask=token_mask
    )
    trainer = pl.Trainer(callbacks=[distill], max_steps=1, **trainer_kwargs())
    with pytest.raises(RecorderConfigError, match=match):
        trainer.fit(TokenStudent(), as_loader(padded_batches(1)))
    assert live_hooks() == []


def test_token_mask_must_be_a_key_position_or_function() -> None:
    with pytest.raises(RecorderConfigError, match=r"Expected `token_mask` of FeatureDistillation"):
        FeatureDistillation(TokenTeacher(), TOKEN_PAIRS, token_mask=True)
