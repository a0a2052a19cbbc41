"""The rules in real runs: rules of a user, the findings' life, runs without a
FeatureStatsMonitor, alerts rate-limited per rule and module, and a resumed run."""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from helpers.health_models import Fault, Injector, Net, data
from helpers.models import QUIET
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

from lightning_recorder import (
    FeatureStatsMonitor,
    HealthEvent,
    HealthMonitor,
    HealthRule,
    LossSpikeRule,
    RecorderStateError,
    RuleInput,
    UpdateRatioRule,
)


def fit(
    model: pl.LightningModule, callbacks: list[pl.Callback], steps: int, **kwargs: Any
) -> pl.Trainer:
    ckpt_path = kwargs.pop("ckpt_path", None)
    options = {**QUIET, "logger": False, "max_steps": steps, **kwargs}
    trainer = pl.Trainer(callbacks=callbacks, **options)
    trainer.fit(model, data(model.arch, 4 * steps), ckpt_path=ckpt_path)
    return trainer


class Spiky(Net):
    """The MLP of the health tests, whose loss is 10 higher at ``spikes`` (the gradients are
    the same: a spike that changes nothing else)."""

    def __init__(self, spikes: tuple[int, ...]) -> None:
        super().__init__("mlp")
        self.spikes = spikes

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        return loss + 10.0 if self.global_step in self.spikes else loss


class Scripted(HealthRule):
    """Finds, at each check, the modules its script names for that step."""

    name = "scripted"
    needs_statistics = False

    def __init__(self, script: dict[int, list[str]]) -> None:
        self.script = script

    def check(self, seen: RuleInput) -> list[HealthEvent]:
        return [
            self.event(seen, m, f"`{m}` looks wrong at step {seen.step}.")
            for m in self.script.get(seen.step, [])
        ]


# ---------------------------------------------------------------------------- rules of a user
class MeanBelow(HealthRule):
    """A rule reading the FeatureStatsMonitor's report: a module's mean output below a limit."""

    name = "mean_below"

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self.steps: list[int] = []

    def check(self, seen: RuleInput) -> list[HealthEvent]:
        assert seen.report is not None
        self.steps.append(seen.step)
        return [
            self.event(seen, name, f"`{name}`'s mean is below {self.limit}.")
            for name in seen.report.modules
            if seen.report.stat("mean", name) < self.limit
        ]


@pytest.mark.parametrize("order", ["health_first", "stats_first"])
def test_a_rule_of_a_user_reads_the_statistics_and_fires_once_while_in_force(
    order: str, tmp_path: Path
) -> None:
    rule = MeanBelow(limit=10.0)  # every module: in force from the first check to the end
    monitor = HealthMonitor(rules=[rule], evidence_max_bytes=0)
    stats = FeatureStatsMonitor([nn.Linear], every_n_steps=2, histograms=False)
    callbacks: list[pl.Callback] = [monitor, stats] if order == "health_first" else [stats, monitor]
    logger = TensorBoardLogger(tmp_path, name="run", version=0)
    fit(Net("mlp"), callbacks, steps=6, logger=logger)
    assert rule.steps == [1, 3, 5]  # the FeatureStatsMonitor's logged steps, whichever is first
    linears = ["body.0", "body.2", "body.5", "body.7"]
    assert [(e.kind, e.module, e.step) for e in monitor.events] == [
        ("mean_below", m, 1) for m in linears
    ]
    assert sorted(k[1] for k in monitor.findings) == linears  # still in force, since step 1
    assert all(e.step == 1 and e.rank == 0 for e in monitor.findings.values())
    assert monitor.counters["rule_events"] == 4


@pytest.mark.parametrize(
    ("returned", "match"),
    [
        (None, r"rule 'odd' \(Odd.check\) to return a list of HealthEvent objects .* NoneType"),
        ("fine", r"rule 'odd' \(Odd.check\) to return a list .* str 'fine'"),
        (["fine"], r"rule 'odd' to return HealthEvent objects of kind 'odd' but it returned str"),
        (
            [HealthEvent("other", 0, None)],
            r"HealthEvent objects of kind 'odd' but it returned HealthEvent",
        ),
    ],
)
def test_a_rule_returning_something_else_stops_the_run_with_a_clear_error(
    returned: Any, match: str
) -> None:
    class Odd(HealthRule):
        name = "odd"
        needs_statistics = False

        def check(self, seen: RuleInput) -> Any:
            return returned

    monitor = HealthMonitor(rules=[Odd()], evidence_max_bytes=0)
    with pytest.raises(RecorderStateError, match=match):
        fit(Net("mlp"), [monitor], steps=2, log_every_n_steps=1)


# ---------------------------------------------------------------------------- no statistics
def test_without_a_feature_stats_monitor_the_loss_rule_and_the_non_finite_check_work(
    recwarn: pytest.WarningsRecorder,
) -> None:
    monitor = HealthMonitor("skip", evidence_max_bytes=0)
    faults = {13: Fault("body.2", "forward", "nan", 13)}
    # checks every 4 steps (3, 7, 11, 15, 19): the spike of step 6 fires at check 7; that of
    # step 10 stays quiet (the finding is in force); check 15 finds none: the spike of step
    # 18 fires again
    fit(Spiky((6, 10, 18)), [Injector(faults), monitor], steps=20, log_every_n_steps=4)
    warned = [str(w.message) for w in recwarn if "FeatureStatsMonitor" in str(w.message)]
    assert len(warned) == 1
    assert warned[0].startswith(
        "HealthMonitor's rules dead_units, saturation, vanishing_gradients, exploding_gradients, "
        "update_ratio read the statistics of a FeatureStatsMonitor, and the Trainer has none"
    )
    assert "Add one to the Trainer's callbacks, e.g. FeatureStatsMonitor([torch.nn." in warned[0]
    found = [(e.kind, e.step, e.module) for e in monitor.events]
    assert found == [("loss_spike", 6, None), ("nonfinite", 13, "body.2"), ("loss_spike", 18, None)]
    assert monitor.counters == {
        "nonfinite_steps": 1, "skipped_steps": 1, "amp_skipped_steps": 0, "rule_events": 2,
    }  # fmt: skip


def test_no_warning_when_no_rule_needs_statistics(recwarn: pytest.WarningsRecorder) -> None:
    monitor = HealthMonitor(rules=[LossSpikeRule()], evidence_max_bytes=0)
    fit(Spiky((3,)), [monitor], steps=4, log_every_n_steps=2)
    assert not [w for w in recwarn if "FeatureStatsMonitor" in str(w.message)]
    assert [(e.kind, e.step) for e in monitor.events] == [("loss_spike", 3)]


def test_a_warning_when_the_monitor_watches_none_of_the_modules_a_rule_judges(
    tmp_path: Path,
) -> None:
    stats = FeatureStatsMonitor([nn.Linear], every_n_steps=1, histograms=False)
    monitor = HealthMonitor(evidence_max_bytes=0)
    logger = TensorBoardLogger(tmp_path, name="run", version=0)
    with pytest.warns(UserWarning) as record:
        fit(Net("mlp"), [stats, monitor], steps=2, logger=logger)
    messages = [str(w.message) for w in record]
    assert (
        "HealthMonitor's rule 'dead_units' judges modules such as body.4, but the "
        "FeatureStatsMonitor monitors none of them; add them to its sources (e.g. torch.nn.ReLU)."
    ) in messages
    assert sum("'saturation' judges modules such as body.6" in m for m in messages) == 1


def test_the_rules_read_a_monitor_of_training_steps(tmp_path: Path) -> None:
    """A FeatureStatsMonitor of validation only reports no training step: the rules would check
    nothing, so the monitor says so; with another one that monitors training, they read that."""
    sources = [nn.Linear, nn.ReLU, nn.Sigmoid]
    logger = TensorBoardLogger(tmp_path, name="run", version=0)
    val_only = FeatureStatsMonitor(sources, histograms=False, stages="val")
    monitor = HealthMonitor(rules=[UpdateRatioRule(patience=1), LossSpikeRule()])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(Net("mlp", lr=0.0), [val_only, monitor], steps=2, logger=logger)
    warned = [str(w.message) for w in record if "HealthMonitor's rules" in str(w.message)]
    assert warned == [
        "HealthMonitor's rules update_ratio read the statistics of training steps, and the "
        "Trainer's FeatureStatsMonitor monitors none (stages=('val',)): they check nothing (the "
        "non-finite check and the rules on the loss still work). Add 'train' to its `stages`, "
        "e.g. FeatureStatsMonitor(..., stages=('train', 'val')), or pass "
        "`rules=[LossSpikeRule()]` (or `rules=()`) to silence this warning."
    ]
    assert monitor.events == []
    # a second monitor that watches training: its statistics are judged (lr=0: no update)
    val_only = FeatureStatsMonitor(sources, histograms=False, stages="val")
    train = FeatureStatsMonitor(
        sources, every_n_steps=1, histograms=False, stages="train", prefix="train-stats"
    )
    monitor = HealthMonitor(rules=[UpdateRatioRule(patience=1), LossSpikeRule()])
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(Net("mlp", lr=0.0), [val_only, train, monitor], steps=2, logger=logger)
    assert not [w for w in record if "HealthMonitor's rules" in str(w.message)]
    assert [(e.step, e.module, e.details["side"]) for e in monitor.events] == [
        (0, m, "low") for m in ("body.0", "body.2", "body.5", "body.7")
    ]


@pytest.mark.parametrize("parameters", [False, "*.bias", True])
def test_a_warning_when_the_monitor_logs_no_weight_the_gradient_rules_read(
    parameters: bool | str, tmp_path: Path
) -> None:
    stats = FeatureStatsMonitor(
        [nn.Linear, nn.ReLU, nn.Sigmoid], every_n_steps=1, histograms=False, parameters=parameters
    )
    monitor = HealthMonitor(evidence_max_bytes=0)
    logger = TensorBoardLogger(tmp_path, name="run", version=0)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(Net("mlp"), [stats, monitor], steps=3, logger=logger)
    warned = [str(w.message) for w in record if "and update ratios of" in str(w.message)]
    rules = "HealthMonitor's rules vanishing_gradients, exploding_gradients, update_ratio"
    if parameters is True:
        assert warned == []
    elif parameters is False:
        assert warned == [
            f"{rules} read the gradient norms and update ratios of the weights, and the "
            "FeatureStatsMonitor logs none (`parameters=False`): they check nothing. Pass "
            "`parameters=True` to the FeatureStatsMonitor (or a pattern covering the weights, "
            "e.g. `parameters='*.weight'`), or leave these rules out of `rules=` to silence "
            "this warning."
        ]
    else:
        assert warned == [
            f"{rules} read the gradient norms and update ratios of the weights, and the "
            "FeatureStatsMonitor logs those of none of the model's weights (such as "
            "body.0.weight, body.2.weight …): they check nothing. Monitor the modules that hold "
            "them and pass `parameters=True` to the FeatureStatsMonitor (or a pattern covering "
            "them, e.g. `parameters='*.weight'`), or leave these rules out of `rules=` to "
            "silence this warning."
        ]


# ---------------------------------------------------------------------------- alerts
def test_alerts_are_rate_limited_per_rule_and_module(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    script = {
        0: ["body.0", "body.2"],  # two modules at once: one message naming both
        1: ["body.0", "body.2"],  # in force: quiet
        2: ["body.0"],  # body.2 is over
        3: ["body.0", "body.2"],  # body.2 again, within the interval: an event, no alert
        4: ["body.0", "body.2", "body.5"],  # a new module: an alert
    }
    alerts: list[HealthEvent] = []
    monitor = HealthMonitor(rules=[Scripted(script)], alert=alerts.append, evidence_max_bytes=0)
    logger = TensorBoardLogger(tmp_path, name="run", version=0)
    with caplog.at_level(logging.DEBUG, logger="lightning_recorder.health"):
        fit(Net("mlp"), [monitor], steps=6, log_every_n_steps=1, logger=logger)
    assert [(e.module, e.step) for e in monitor.events] == [
        ("body.0", 0), ("body.2", 0), ("body.2", 3), ("body.5", 4),
    ]  # fmt: skip
    assert [(a.module, a.step) for a in alerts] == [("body.0", 0), ("body.5", 4)]
    assert alerts[0].message == (
        "`body.0` looks wrong at step 0. The same on `body.2`."  # both modules got through
    )
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [alerts[0].message, alerts[1].message]
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert "`body.2` looks wrong at step 3." in debug
    # the loggers: a text entry per message, the counter at each step something fired
    acc = EventAccumulator(str(tmp_path / "run" / "version_0"), size_guidance={"tensors": 0})
    acc.Reload()
    texts = acc.Tensors("health/events/text_summary")
    assert [(t.step, t.tensor_proto.string_val[0].decode()) for t in texts] == [
        (0, alerts[0].message), (4, alerts[1].message),
    ]  # fmt: skip
    assert {e.step: e.value for e in acc.Scalars("health/rule_events")} == {0: 2, 3: 3, 4: 4}


def test_a_finding_and_a_non_finite_step_at_one_step_share_the_text_tensorboard_shows(
    tmp_path: Path,
) -> None:
    """TensorBoard shows the last text of a tag and step: the entry written for the finding
    holds the message of the non-finite step reported before it at the same step."""
    monitor = HealthMonitor(
        "skip", rules=[Scripted({2: ["body.0"]})], alert_interval_s=0, evidence_max_bytes=0
    )
    injector = Injector({2: Fault("body.1", "forward", "nan", 2)})
    logger = TensorBoardLogger(tmp_path, name="run", version=0)
    fit(Net("mlp"), [injector, monitor], steps=4, log_every_n_steps=1, logger=logger)
    assert [(e.kind, e.step) for e in monitor.events] == [("nonfinite", 2), ("scripted", 2)]
    acc = EventAccumulator(str(tmp_path / "run" / "version_0"), size_guidance={"tensors": 0})
    acc.Reload()
    texts = [t for t in acc.Tensors("health/events/text_summary") if t.step == 2]
    last = texts[-1].tensor_proto.string_val[0].decode()
    assert last == "\n\n".join(e.message for e in monitor.events)
    # the counters written last at the step are the step's
    last_count = [e.value for e in acc.Scalars("health/rule_events") if e.step == 2][-1]
    assert last_count == 1


def test_update_ratio_findings_on_both_sides_of_the_band_make_a_message_each(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """One layer barely moves while another moves too fast, found at the same check: the
    advice is opposite, so neither message may say "the same on" the other."""

    class Groups(Net):
        def configure_optimizers(self) -> torch.optim.Optimizer:
            body = self.body
            return torch.optim.SGD(
                [
                    {"params": body[0].parameters(), "lr": 0.0},  # does not move
                    {"params": body[2].parameters(), "lr": 50.0},  # far too fast
                    {"params": [*body[5].parameters(), *body[7].parameters()]},
                ],
                lr=1e-3,
            )

    alerts: list[HealthEvent] = []
    stats = FeatureStatsMonitor([nn.Linear], every_n_steps=1, histograms=False)
    monitor = HealthMonitor(
        rules=[UpdateRatioRule(patience=1)], alert=alerts.append, evidence_max_bytes=0
    )
    with caplog.at_level(logging.WARNING, logger="lightning_recorder.health"):
        fit(Groups("mlp"), [stats, monitor], steps=1, logger=TensorBoardLogger(tmp_path))
    assert [(e.module, e.details["side"]) for e in monitor.events] == [
        ("body.0", "low"), ("body.2", "high"),
    ]  # fmt: skip
    warned = [r.getMessage() for r in caplog.records if "moves" in r.getMessage()]
    assert len(warned) == 2 and not any("The same on" in m for m in warned)
    assert warned[0].startswith("`body.0.weight` moves 0 of its norm per step")
    assert "below 1e-06: it barely learns" in warned[0]
    assert warned[1].startswith("`body.2.weight` moves ")
    assert "above 0.1: the learning rate is likely too high for it" in warned[1]
    assert [a.message for a in alerts] == warned


def test_a_weight_whose_norm_before_the_step_is_0_has_no_update_ratio_to_judge(
    tmp_path: Path,
) -> None:
    """A weight initialised to zeros (a residual branch's last layer, a LoRA ``B``) has no
    update ratio at its first step (``||Δw|| / 0``, logged as about 1e10 before): the rule
    judges it from its next step on and finds nothing here; the view draws the steps it has."""

    class ZeroHead(Net):
        def __init__(self) -> None:
            super().__init__("mlp")
            nn.init.zeros_(self.body[7].weight)

    logger = TensorBoardLogger(tmp_path, name="run", version=0)
    stats = FeatureStatsMonitor([nn.Linear], every_n_steps=1, histograms=False)
    seen: list[dict[str, float]] = []
    stats.subscribe(lambda report: seen.append(dict(report.parameters["body.7.weight"])))
    # a high bound of 1e3: ||Δw|| / (0 + 1e-12) is far above it, the later ratios far below
    rule = UpdateRatioRule(high=1e3, low=None, patience=1)
    monitor = HealthMonitor(
        rules=[rule], view_every=1, heatmap_stats=("update_ratio",), evidence_max_bytes=0
    )
    fit(ZeroHead(), [stats, monitor], steps=3, logger=logger)
    assert [sorted(figures) for figures in seen] == [
        ["grad_norm", "norm"],
        *[["grad_norm", "norm", "update_ratio"]] * 2,
    ]
    assert all(0.0 < figures["update_ratio"] < 1e3 for figures in seen[1:])
    assert monitor.events == [] and monitor.findings == {}
    acc = EventAccumulator(str(logger.log_dir), size_guidance={"images": 0})
    acc.Reload()
    assert [i.step for i in acc.Images("health/heatmap/update_ratio")] == [0, 1, 2]


def test_after_the_interval_the_same_finding_alerts_again() -> None:
    script = {0: ["body.0"], 2: ["body.0"]}
    alerts: list[HealthEvent] = []
    monitor = HealthMonitor(
        rules=[Scripted(script)], alert=alerts.append, alert_interval_s=1e-9, evidence_max_bytes=0
    )
    fit(Net("mlp"), [monitor], steps=3, log_every_n_steps=1)
    assert [(a.module, a.step) for a in alerts] == [("body.0", 0), ("body.0", 2)]

    def broken(event: HealthEvent) -> None:
        raise ConnectionError("no network")

    monitor = HealthMonitor(rules=[Scripted(script)], alert=broken, evidence_max_bytes=0)
    with pytest.warns(UserWarning, match="`alert` raised ConnectionError: no network"):
        fit(Net("mlp"), [monitor], steps=3, log_every_n_steps=1)
    assert len(monitor.events) == 2  # training went on


# ---------------------------------------------------------------------------- resuming
class Spy(HealthRule):
    name = "spy"

    def __init__(self) -> None:
        self.steps: list[int] = []

    def check(self, seen: RuleInput) -> list[HealthEvent]:
        self.steps.append(seen.step)
        return []


def test_a_resumed_run_goes_on_without_firing_again(tmp_path: Path) -> None:
    """A run with a loss spike, saved and resumed: the rules go on from the checkpoint's step,
    the counters carry over, and nothing fires again."""

    def parts() -> tuple[HealthMonitor, Spy, list[pl.Callback]]:
        spy = Spy()
        monitor = HealthMonitor(rules=[*HealthMonitor.default_rules(), spy], evidence_max_bytes=0)
        stats = FeatureStatsMonitor(
            [nn.Linear, nn.ReLU, nn.Sigmoid], every_n_steps=2, histograms=False
        )
        return monitor, spy, [stats, monitor]

    logger = TensorBoardLogger(tmp_path, name="run", version=0)
    monitor, spy, callbacks = parts()
    trainer = fit(Spiky((3,)), callbacks, steps=8, logger=logger)
    assert [(e.kind, e.step) for e in monitor.events] == [("loss_spike", 3)]
    assert spy.steps == [1, 3, 5, 7]
    path = tmp_path / "resume.ckpt"
    trainer.save_checkpoint(path)

    monitor, spy, callbacks = parts()
    logger = TensorBoardLogger(tmp_path, name="run", version=1)
    fit(Spiky((3,)), callbacks, steps=16, logger=logger, ckpt_path=path)
    assert spy.steps == [9, 11, 13, 15]
    assert monitor.events == [] and monitor.findings == {}
    assert monitor.counters["rule_events"] == 1  # from the checkpoint; nothing new


# ---------------------------------------------------------------------------- the losses read
class Losses(HealthRule):
    name = "losses"
    needs_statistics = False

    def __init__(self) -> None:
        self.read: dict[int, float] = {}

    def check(self, seen: RuleInput) -> list[HealthEvent]:
        self.read.update(zip(seen.loss_steps.tolist(), seen.losses.tolist(), strict=True))
        return []


class Recording(Net):
    """Keeps each micro-batch's loss by optimizer step."""

    def __init__(self) -> None:
        super().__init__("mlp")
        self.losses: dict[int, list[float]] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.losses.setdefault(self.global_step, []).append(loss.item())
        return loss


@pytest.mark.parametrize("accumulate", [1, 3])
def test_the_rules_read_every_steps_loss_once(accumulate: int) -> None:
    """Every optimizer step's loss reaches the rules once, between checks too, the mean of its
    micro-batches under gradient accumulation."""
    rule, model = Losses(), Recording()
    monitor = HealthMonitor(rules=[rule], evidence_max_bytes=0)
    trainer = pl.Trainer(
        **QUIET, logger=False, max_steps=7, callbacks=[monitor], log_every_n_steps=3,
        accumulate_grad_batches=accumulate,
    )  # fmt: skip
    trainer.fit(model, data("mlp", 4 * 7 * accumulate))
    assert sorted(rule.read) == [0, 1, 2, 3, 4, 5, 6]  # checks at steps 2 and 5, 6 at the end
    for step, value in rule.read.items():
        assert len(model.losses[step]) == accumulate
        assert value == pytest.approx(np.mean(model.losses[step]), rel=1e-6)


def test_the_loss_of_an_epochs_shorter_last_group_of_micro_batches_is_their_mean() -> None:
    """Eight batches an epoch in groups of three: every third step has two micro-batches, and
    Lightning divides their losses by three all the same; the rules get their mean."""
    rule, model = Losses(), Recording()
    monitor = HealthMonitor(rules=[rule], evidence_max_bytes=0)
    trainer = pl.Trainer(
        **QUIET, logger=False, max_steps=6, callbacks=[monitor], log_every_n_steps=2,
        accumulate_grad_batches=3,
    )  # fmt: skip
    trainer.fit(model, data("mlp", 4 * 8))
    assert sorted(rule.read) == [0, 1, 2, 3, 4, 5]
    assert [len(model.losses[step]) for step in range(6)] == [3, 3, 2, 3, 3, 2]
    for step, value in rule.read.items():
        assert value == pytest.approx(np.mean(model.losses[step]), rel=1e-6)


class Twin(Scripted):
    name = "twin"


def test_findings_of_one_check_are_one_tensorboard_text_with_every_message(
    tmp_path: Path,
) -> None:
    """TensorBoard keeps one text per tag and step: two rules firing at the same check must
    share one entry, or the second hides the first."""
    rules = [Scripted({3: ["body.0"]}), Twin({3: ["body.2"]})]
    monitor = HealthMonitor(rules=rules, evidence_max_bytes=0, view=False)
    logger = TensorBoardLogger(tmp_path, name="run", version=0)
    fit(Net("mlp"), [monitor], steps=6, logger=logger, log_every_n_steps=2)
    assert [(e.kind, e.module) for e in monitor.events] == [
        ("scripted", "body.0"),
        ("twin", "body.2"),
    ]
    events = EventAccumulator(str(tmp_path / "run" / "version_0"), size_guidance={"tensors": 0})
    events.Reload()
    texts = events.Tensors("health/events/text_summary")
    assert len(texts) == 1
    text = texts[0].tensor_proto.string_val[0].decode()
    assert "`body.0` looks wrong at step 3." in text and "`body.2` looks wrong at step 3." in text


def test_a_spike_after_the_last_check_is_found_at_the_end_of_training(tmp_path: Path) -> None:
    monitor = HealthMonitor(evidence_max_bytes=0, view=False)
    stats = FeatureStatsMonitor([nn.Linear], every_n_steps=10, histograms=False)
    # checks at steps 9 and 19 (the monitor's logged steps); the spike of step 22 comes after
    logger = TensorBoardLogger(tmp_path, name="run", version=0)
    fit(Spiky((22,)), [monitor, stats], steps=24, logger=logger)
    assert [(e.kind, e.step) for e in monitor.events] == [("loss_spike", 22)]
