"""`HealthMonitor`: where the first NaN/Inf of a run came from, told in one message; training
that goes on past a bad batch, alike on every rank; rules that name dead, saturated or exploding
layers; and a view of every layer at a glance.

The classes a user meets are re-exported here: :class:`HealthEvent` (a finding),
:class:`HealthRule` and :class:`RuleInput` (to write a rule), and the rules that ship.
"""

from __future__ import annotations

import fnmatch
import os
import re
import threading
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from .._core.checks import (
    check_bool,
    check_callable,
    check_int,
    check_name,
    check_number,
    check_option,
    closest_hint,
    suggestion,
)
from .._core.names import named_modules, named_parameters
from ..errors import RecorderConfigError, UnknownSourceError
from ..stats import STAT_NAMES
from ._health_diagnosis import Diagnosis, check_rules
from ._health_diagnosis import default_rules as _default_rules
from ._health_event import HealthEvent
from ._health_evidence import Evidence
from ._health_policy import Decisions, Pending
from ._health_replay import MicroBatch, capture_rng, why_not_replayable
from ._health_report import Reporter
from ._health_rules import HealthRule, RuleInput
from ._health_rules_grads import ExplodingGradientsRule, UpdateRatioRule, VanishingGradientsRule
from ._health_rules_loss import LossSpikeRule
from ._health_rules_units import DeadUnitsRule, SaturationRule
from ._health_sentinel import Sentinel, to_host_later
from ._health_trace import Trace
from ._health_verdict import Timeline
from ._health_view import PARAMETER_STATS, HealthView
from ._lightning import (
    STATE_KEY,
    check_one_run,
    fast_dev_run,
    serves,
    step_axis,
    unclaimed_state,
)
from ._optimizer_steps import StepsInProgress

__all__ = [
    "DeadUnitsRule",
    "ExplodingGradientsRule",
    "HealthEvent",
    "HealthMonitor",
    "HealthRule",
    "LossSpikeRule",
    "RuleInput",
    "SaturationRule",
    "UpdateRatioRule",
    "VanishingGradientsRule",
]

Policy = Literal["warn", "skip", "raise"]
# two Literals: to a wrong value, LightningCLI (jsonargparse) answers one Literal mixing strings
# and False with "Expected a <class 'bool'>", and these two with both Literals and their values
Localize = Literal["replay", "always"] | Literal[False]
_MiB = 1 << 20
_NO_RNG = torch.empty(0, dtype=torch.uint8)

#: the default of ``max_consecutive_skips`` (the signature says 5 too)
_MAX_SKIPS = 5


def _fresh_counters() -> dict[str, int]:
    """The counters of a fit that has counted nothing yet."""
    return {"nonfinite_steps": 0, "skipped_steps": 0, "amp_skipped_steps": 0, "rule_events": 0}


def _check_exclude(patterns: Sequence[str], modules: Collection[str]) -> None:
    """Refuse a pattern of ``exclude`` whose module part (before ``.input`` or ``.output``)
    matches no module of the model: it could never leave anything out."""
    names = [name for name in modules if name]
    for pattern in patterns:
        if _names_batch(pattern):
            continue
        parts = [m.start() for m in re.finditer(r"\.(input|output)(?=\.|$)", pattern)]
        if not parts or any(fnmatch.fnmatchcase(n, pattern[:at]) for at in parts for n in names):
            continue
        module = pattern[: parts[0]]
        raise UnknownSourceError(
            f"Expected every pattern of `exclude` of HealthMonitor to name tensors of the "
            f"model's modules ('<module>.input.<argument>', '<module>.output[.<path>]') or of "
            f"the batch ('batch.<path>') but {pattern!r} names the module {module!r}, which the "
            f"model does not have. {suggestion(module, names, 'module names')}"
        )


def _never_matches(pattern: str) -> bool:
    """Whether an ``exclude`` pattern without glob characters can name no tensor of any model:
    every name is ``"<module>.input.<argument>[.<path>]"``, ``"<module>.output[.<path>]"``,
    ``"batch"`` or ``"batch.<path>"``."""
    if any(c in pattern for c in "*?[") or _names_batch(pattern):
        return False
    return re.search(r"\.input\.|\.output(?=\.|$)", pattern) is None


def _names_batch(pattern: str) -> bool:
    """Whether an ``exclude`` pattern may name a tensor of the batch (``"batch"``,
    ``"batch.<path>"``): a module named ``batchnorm`` is a module."""
    return pattern == "batch" or pattern.startswith(("batch.", "batch*", "batch?", "batch["))


def _names(value: object) -> bool:
    """Whether ``value`` is a collection of strings (a list, a tuple; a string itself is not)."""
    if isinstance(value, str) or not isinstance(value, Collection):
        return False
    return all(isinstance(item, str) for item in value)


class HealthMonitor(Decisions, Diagnosis, Callback):
    """Find the first NaN/Inf of a training run, say which module made it, and keep training.

    **The check (every step).** Before each optimizer step the loss and every parameter
    gradient are checked for NaN and ±Inf with one fused multi-tensor norm per device and dtype
    (no per-tensor synchronisation). With ``"skip"`` or ``"raise"``, or with ``"warn"`` and
    ``localize="replay"`` (or ``evidence_checkpoint=True``, until its checkpoint is saved),
    the result is read before the optimizer step: one host synchronisation per step on a GPU
    (none on the CPU). Otherwise it is copied without waiting and read at the next step: a
    clean step never synchronises (a fit that raises first still reports it, on its way out).
    Steps that the AMP grad scaler skips itself (``precision="16-mixed"``: gradients
    overflowed, loss finite) are reported as ``kind="amp_skipped"``, not as alarms.

    **Where it came from.** ``localize="replay"`` (default): on a flagged step, before the
    optimizer step, the same batch runs again through ``training_step`` with every module and
    parameter hooked (random generators reset to the step's start, buffers such as BatchNorm
    statistics written back, ``self.log`` muted, the real gradients untouched), and the event
    names the first module whose forward output, or whose backward gradient, was non-finite —
    with its direction, the tensor's path, dtype, shape and counts, and whether the module made
    the values from finite ones (``producer``). A batch that holds NaN itself is reported with
    ``module=None`` (also when only the loss reads the tensor, as a target).
    ``localize="always"`` hooks every module on every step instead (for what cannot be
    replayed: manual optimization steps inside ``training_step``); it costs about one extra
    pass over every module output, gradient and parameter per step (a weight non-finite
    already is named as such there too). ``False``: the check only.

    **What happens then** (``on_nonfinite``): ``"warn"`` reports and lets the update happen
    (the parameters will usually become non-finite; later steps of that run are counted, not
    replayed). ``"skip"`` reports and discards the update — every gradient of the optimizer is
    set to ``None``, so neither the parameters nor the optimizer's state (momentum, Adam's
    moments and step count) change — the same decision on every DDP rank (the flag is reduced
    across ranks first); after ``max_consecutive_skips`` skipped steps in a row the next
    non-finite step raises. ``"raise"`` reports, writes the evidence, and raises
    :class:`~lightning_recorder.NonFiniteError` (its ``event`` attribute is the event). With
    manual optimization the policy applies at each ``optimizer.step()`` in ``training_step``:
    ``"skip"`` turns that call into a no-op, ``"raise"`` raises from it, and steps are localised
    only with ``localize="always"``.

    **Evidence.** Each non-finite event writes a bundle (safetensors + JSON, atomically): the
    batch, the blamed module's inputs and outputs (and a backward fault's non-finite gradients
    of that call or parameter), the per-module summary of the replay, the
    random generators' states, step, batch index and rank (optionally a checkpoint taken before
    the bad update); all bundles of a run share ``evidence_max_bytes``. Under
    ``Trainer(fast_dev_run=...)``, where Lightning writes no logs or checkpoints, none is
    written (an info message says so).

    **Rules** (with a :class:`~lightning_recorder.FeatureStatsMonitor` in the Trainer, on its
    logged training steps, on rank zero; nothing on the other steps but keeping each step's
    loss on its device): dead ReLU units (:class:`DeadUnitsRule`), saturated tanh/sigmoid units
    (:class:`SaturationRule`), vanishing and exploding gradients
    (:class:`VanishingGradientsRule`, :class:`ExplodingGradientsRule`, AutoTrainer's rules),
    update-to-weight ratios outside a band around 1e-3 (:class:`UpdateRatioRule`) and loss
    spikes (:class:`LossSpikeRule`, Lightning's rule, on every step's loss). ``rules=None``
    checks all of them with their defaults (:meth:`default_rules`); pass your own list to
    choose, configure or add rules, ``rules=()`` for none. The monitor asks the
    FeatureStatsMonitor for the per-channel extremes of the activations the rules judge: it
    should monitor them (``FeatureStatsMonitor([nn.Conv2d, nn.Linear, nn.ReLU, nn.Tanh])``). A
    finding *fires* when it appears (an event, one message) and stays in :attr:`findings` while
    it lasts.

    **The view** (``view=True``, TensorBoard and W&B): a custom-scalars layout with one chart per
    statistic and every layer on it, a layer-by-step heat map of each of ``heatmap_stats`` with
    the findings written beside their layer, and a table of the findings in force; drawn at
    the first logged step, every ``view_every`` logged steps, when a rule fires, and at the end.

    **Reporting.** Python logging (``"lightning_recorder.health"``, rank zero), the loggers (a
    text entry and the event counters as scalars), the ``alert`` callable (rate-limited; rule
    findings per rule and module, the notices of skipped steps per module: the counters go to
    the loggers at every step), and :attr:`events`. :attr:`events` and :attr:`counters` are
    those of the latest ``fit``: each fit starts them afresh (new objects), except that a fit
    resumed from a checkpoint (``ckpt_path``) goes on with the checkpoint's counters. A Weights
    & Biases alert is two lines::

        import wandb
        alert = lambda e: wandb.alert(title=f"HealthMonitor: {e.kind}", text=e.message)

    Args:
        on_nonfinite: what a step with a non-finite loss or gradient does: ``"warn"`` reports
            it and lets the update happen; ``"skip"`` reports it and discards the update (no
            parameter or optimizer state changes; the next non-finite step after
            ``max_consecutive_skips`` skipped ones in a row raises); ``"raise"`` reports it,
            writes the evidence and raises :class:`~lightning_recorder.NonFiniteError`.
        localize: how the module that made the first non-finite values is found: ``"replay"``
            runs a flagged step's batch again with every module hooked; ``"always"`` hooks
            every module on every step (for manual optimization); ``False``: the check only.
        rules: the :class:`HealthRule` objects checked on logged steps, one or a list;
            ``None``: every rule that ships, with its defaults (:meth:`default_rules`); ``()``:
            none.
        evidence_dir: where bundles go; default ``<trainer.log_dir>/health``. Checked when
            ``fit`` starts: a folder that could hold no bundle (a file on its path, no write
            permission) raises :class:`~lightning_recorder.RecorderConfigError` (the default
            folder: a warning). Evidence that cannot be written later (a full disk) leaves no
            part of itself and does not stop training: one warning a fit says so, and the event.
        alert: called with each event worth an alert (the first of a run of non-finite steps,
            rule findings), at most once per ``alert_interval_s``.
        max_consecutive_skips: with ``"skip"``, how many non-finite steps in a row are skipped
            before the next one raises (counted per optimizer); given with another policy, a
            warning says it has no effect.
        exclude: glob patterns of tensors that may hold non-finite values on purpose, e.g.
            ``["*.input.attn_mask"]``: names are ``"<module>.output[.<path>]"``,
            ``"<module>.input.<argument>"`` and ``"batch.<path>"``; a pattern whose module part
            matches no module of the model is refused when ``fit`` starts.
        evidence_max_bytes: the bytes all bundles of a fit may take; 0 writes none.
        evidence_checkpoint: also save a Trainer checkpoint before the first bad update of each
            fit (when the model and optimizer state fit in ``evidence_max_bytes``); with
            ``"warn"`` and no replay, the check is read before each optimizer step until it is
            saved.
        alert_interval_s: the least time between two alerts, in seconds (for rule findings:
            between two messages of one rule about one module; with ``"skip"``: between two
            notices of steps skipped for one module, the others logged at ``DEBUG``).
        view: draw the health view (custom scalars, heat maps, findings table).
        view_every: redraw the heat maps and the table every this many logged steps.
        heatmap_stats: the statistics drawn as heat maps: those of
            :data:`~lightning_recorder.STAT_NAMES` (rows: monitored modules) and
            ``"grad_norm"``, ``"update_ratio"``, ``"norm"`` (rows: weight tensors); each
            once, at least one (``view=False`` for no view).
        heatmap_steps: the logged steps a heat map shows (its columns), the latest ones.
        name: distinguishes two monitors with the same ``on_nonfinite`` and ``localize``
            (checkpoint state): two monitors of one Trainer need different names unless one
            of these differs; not empty or blank.

    Raises:
        RecorderConfigError: an argument is invalid.
        UnknownSourceError: when ``fit`` starts, a pattern of ``exclude`` names a module the
            model does not have.
        NonFiniteError: during ``fit``, as the policy says.

    Examples:
        >>> import lightning.pytorch as pl
        >>> import torch
        >>> from torch import nn
        >>> class Net(pl.LightningModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        ...     def training_step(self, batch, batch_idx):
        ...         x = batch[0]
        ...         if batch_idx == 2:
        ...             x = x / 0.0 * 0.0  # a bad batch: NaN before any module
        ...         return self.body(x).square().mean()
        ...     def configure_optimizers(self):
        ...         return torch.optim.SGD(self.parameters(), lr=0.1)
        >>> data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 4)),
        ...                                    batch_size=4)
        >>> monitor = HealthMonitor(on_nonfinite="skip", evidence_max_bytes=0)
        >>> trainer = pl.Trainer(max_steps=4, callbacks=[monitor], logger=False,
        ...     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        >>> trainer.fit(Net(), data)
        >>> [(e.step, e.module, e.direction, e.path, e.action) for e in monitor.events]
        [(2, None, 'forward', 'body.input.input', 'skipped')]
    """

    def __init__(
        self,
        on_nonfinite: Policy = "warn",
        localize: Localize = "replay",
        rules: HealthRule | Sequence[HealthRule] | None = None,
        evidence_dir: str | os.PathLike[str] | None = None,
        alert: Callable[[HealthEvent], Any] | None = None,
        max_consecutive_skips: int = 5,
        *,
        exclude: Sequence[str] = (),
        evidence_max_bytes: int = 256 * _MiB,
        evidence_checkpoint: bool = False,
        alert_interval_s: float = 300.0,
        view: bool = True,
        view_every: int = 10,
        heatmap_stats: Sequence[str] = ("zero_fraction", "std", "grad_norm"),
        heatmap_steps: int = 100,
        name: str | None = None,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        check_option("on_nonfinite", on_nonfinite, ("warn", "skip", "raise"), owner)
        if localize not in ("replay", "always") and localize is not False:
            raise RecorderConfigError(
                f"Expected `localize` of {owner} to be 'replay', 'always' or False but got "
                f"{localize!r}."
            )
        self.rules = check_rules(rules, owner)
        check_callable(alert, "alert", "a function of a HealthEvent")
        check_int(max_consecutive_skips, "max_consecutive_skips", owner, minimum=0)
        if on_nonfinite != "skip" and max_consecutive_skips != _MAX_SKIPS:
            rank_zero_warn(
                f"{owner}(max_consecutive_skips={max_consecutive_skips}) has no effect with "
                f"on_nonfinite={on_nonfinite!r}: it counts skipped steps, and only 'skip' skips "
                "any. Pass on_nonfinite='skip', or leave max_consecutive_skips out."
            )
        check_int(evidence_max_bytes, "evidence_max_bytes", owner, minimum=0)
        check_bool(evidence_checkpoint, "evidence_checkpoint", owner)
        check_number(alert_interval_s, "alert_interval_s", owner, positive=True)
        check_bool(view, "view", owner)
        check_int(view_every, "view_every", owner)
        check_int(heatmap_steps, "heatmap_steps", owner)
        known = (*STAT_NAMES, *PARAMETER_STATS)
        if not _names(heatmap_stats) or not all(s in known for s in heatmap_stats):
            unknown = [s for s in heatmap_stats if s not in known] if _names(heatmap_stats) else []
            hint = closest_hint(unknown[0], known, "names") if len(unknown) == 1 else ""
            raise RecorderConfigError(
                f"Expected `heatmap_stats` of {owner} to be a list of names among "
                f"{', '.join(map(repr, known))} but got {heatmap_stats!r}.{hint}"
            )
        if not heatmap_stats:
            raise RecorderConfigError(
                f"Expected `heatmap_stats` of {owner} to name at least one statistic but got "
                f"{heatmap_stats!r}: an empty list draws no heat map and says nothing. Pass "
                "`view=False` for no health view at all, or names among "
                f"{', '.join(map(repr, known))}."
            )
        repeated = sorted(s for s, n in Counter(heatmap_stats).items() if n > 1)
        if repeated:
            raise RecorderConfigError(
                f"Expected each name of `heatmap_stats` of {owner} once but got "
                f"{', '.join(map(repr, repeated))} more than once in {heatmap_stats!r}: each "
                "name draws one heat map."
            )
        if not _names(exclude):
            raise RecorderConfigError(
                f"Expected `exclude` of {owner} to be a list of glob patterns such as "
                f"['*.input.attn_mask'] but got {exclude!r}."
            )
        for pattern in exclude:
            if _never_matches(pattern):
                like = (
                    f"{pattern}.*"
                    if pattern.endswith(".input")
                    else f"*.input.{pattern}"
                    if "." not in pattern
                    else "*.input.attn_mask"
                )
                raise RecorderConfigError(
                    f"Expected every pattern of `exclude` of {owner} to name tensors as "
                    f"'<module>.input.<argument>[.<path>]', '<module>.output[.<path>]' or "
                    f"'batch[.<path>]', or to hold a glob character, but {pattern!r} can never "
                    f"match a tensor's name; write e.g. {like!r}."
                )
        check_name(name, owner)
        if evidence_dir is not None and not isinstance(evidence_dir, (str, os.PathLike)):
            raise RecorderConfigError(
                f"Expected `evidence_dir` of {owner} to be a path or None but got {evidence_dir!r}."
            )
        self.on_nonfinite: Policy = on_nonfinite
        self.localize: Localize = localize
        self.name = name
        self.evidence_dir = evidence_dir
        self.max_consecutive_skips = max_consecutive_skips
        self.exclude = tuple(exclude)
        self.evidence_checkpoint = evidence_checkpoint
        self.events: list[HealthEvent] = []
        self.counters = _fresh_counters()
        self._reporter = Reporter(alert, alert_interval_s)
        self._evidence = Evidence(None, evidence_max_bytes)
        self._sentinel = Sentinel()
        self._trace: Trace | None = None
        self._window: list[MicroBatch] = []
        self._timelines: list[Timeline] = []
        self._pending: list[Pending] = []
        self._names: dict[int, str] = {}
        self._fitting: pl.LightningModule | None = None  # the module of the fit in progress
        self._thread = ""  # the name of the thread that fit runs in
        self._replays = False
        self._streaks: dict[int, int] = {}
        self._steps = StepsInProgress()
        self._step_window: list[MicroBatch] = []  # the micro-batches of the step in progress
        self._reported: set[int] = set()
        self._streak_before: dict[int, int] = {}
        self._checkpointed = False
        self._paused_clip: tuple[pl.Trainer, float] | None = None
        self._view = HealthView(heatmap_stats, view_every, heatmap_steps) if view else None
        self._init_diagnosis()

    @staticmethod
    def default_rules() -> list[HealthRule]:
        """A fresh instance of every rule that ships, with its defaults (what ``rules=None``
        checks): start from it to drop, replace or add rules.

        Examples:
            >>> for rule in HealthMonitor.default_rules():
            ...     print(rule)
            DeadUnitsRule(window=5, min_fraction=0.7)
            SaturationRule(window=5, min_fraction=0.5)
            VanishingGradientsRule(ratio=0.001, first_norm=0.0001)
            ExplodingGradientsRule(ratio=70)
            UpdateRatioRule(high=0.1, low=1e-06)
            LossSpikeRule(window=10, rtol=2.0, atol=1.0)
            >>> rules = [r for r in HealthMonitor.default_rules() if r.name != "update_ratio"]
            >>> monitor = HealthMonitor(rules=[*rules, UpdateRatioRule(low=None)])
        """
        return _default_rules()

    def __repr__(self) -> str:
        rules = ", ".join(type(rule).__name__ for rule in self.rules)
        extra = "" if self.name is None else f", name={self.name!r}"
        return (
            f"{type(self).__name__}(on_nonfinite={self.on_nonfinite!r}, "
            f"localize={self.localize!r}, rules=[{rules}]{extra})"
        )

    state_key = STATE_KEY  # made once by _make_state_key, then an instance attribute

    def _make_state_key(self) -> str:
        if self.name is not None:
            return self._generate_state_key(name=self.name)
        return self._generate_state_key(on_nonfinite=self.on_nonfinite, localize=self.localize)

    # ------------------------------------------------------------------ lifecycle
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        check_one_run(type(self).__name__, self._fitting, pl_module, self._thread)
        self._fitting, self._thread = pl_module, threading.current_thread().name
        # steps in a row, events and counters are those of this fit (a resumed fit loads the
        # checkpoint's streaks and counters after setup); new objects: the last fit's stay whole
        self._streaks = {}
        self.events, self.counters = [], _fresh_counters()
        # each fit has its own evidence budget and its own checkpoint before its first bad update
        self._evidence.start()
        self._checkpointed = False
        root = self.evidence_dir
        if root is None:  # every rank asks: log_dir is broadcast from rank 0
            root = Path(trainer.log_dir or trainer.default_root_dir) / "health"
        self._evidence.root = Path(root)
        why = self._evidence.unwritable()
        if why is not None:
            fix = (
                "Pass an `evidence_dir` that can be written to, or evidence_max_bytes=0 to "
                "write none"
            )
            if self.evidence_dir is not None:
                raise RecorderConfigError(
                    "Expected `evidence_dir` of HealthMonitor to be a folder it can write "
                    f"evidence bundles in but {why}. {fix}."
                )
            rank_zero_warn(f"HealthMonitor cannot write evidence bundles in {root}: {why}. {fix}.")
        if fast_dev_run(trainer) and self._evidence.enabled:  # Lightning's smoke test
            rank_zero_info(
                "HealthMonitor writes no evidence bundles or checkpoints under `fast_dev_run`, "
                "as Lightning writes no logs or checkpoints then: non-finite steps are still "
                "found and reported, without evidence."
            )
            self._evidence.root = None
        _check_exclude(self.exclude, named_modules(pl_module))
        self._attach_rules(trainer)

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._names = {id(p): n for n, p in named_parameters(pl_module).items()}
        self._window, self._timelines, self._pending = [], [], []
        self._sentinel.reset()
        self._reporter.start()
        self._step_window, self._reported, self._streak_before = [], set(), {}
        self._replays = False
        if self.localize == "replay":
            why = why_not_replayable(trainer, pl_module)
            self._replays = why is None
            if why is not None:
                rank_zero_warn(
                    f"HealthMonitor cannot replay steps: {why}. Non-finite steps are reported "
                    "without the module that made them; pass `localize='always'` to check every "
                    "module on every step."
                )
        if self.localize == "always":
            self._trace = Trace(pl_module, self.exclude, owner="HealthMonitor(always)")
            self._trace.install()
        self._start_rules(trainer, pl_module)

    def _detach(self) -> None:
        self._resume_clipping()
        if self._trace is not None:
            self._trace.remove()
            self._trace = None
        self._steps.release()
        self._window, self._timelines, self._step_window = [], [], []
        self._detach_rules()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._write_layout(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._resolve(trainer, wait=True)
        self._end_rules(trainer)
        self._detach()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._end_run(pl_module)

    @override
    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        if serves(self._fitting, pl_module):
            self._report_unread(trainer)
        self._end_run(pl_module)

    def _report_unread(self, trainer: pl.Trainer) -> None:
        """Report the checks read lazily that had not been read when the fit stopped with an
        exception (often the NaN's own, a step later), waiting for them now, as they would have
        been reported; a failure to report one is a warning: the run's own exception is the
        one to raise."""
        while self._pending:
            pending = self._pending.pop(0)
            try:
                pending.reading.wait()
                self._lazy(trainer, pending)
            except Exception as err:
                rank_zero_warn(
                    f"HealthMonitor could not report the check of step {pending.step}, not read "
                    f"yet when the fit stopped: {type(err).__name__}: {err}. The fit's own "
                    "exception follows."
                )

    def _end_run(self, pl_module: pl.LightningModule) -> None:
        """Release what the run of ``pl_module`` installed (not what another fit still going
        on, which refused this run, installed)."""
        if serves(self._fitting, pl_module):
            self._fitting = None
            self._detach()

    # ------------------------------------------------------------------ per batch
    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._resolve(trainer, wait=False)
        self._steps.reset()  # no optimizer step goes on from one batch into the next
        self._step_window = []
        if self._trace is not None:
            if self._window and self._trace.active:  # an earlier micro-batch of this step
                self._timelines.append(self._trace.finish())
            self._trace.begin(batch)
        # the random state before the forward: the replay sets it again; every bundle holds it,
        # so that the step can be run again with the same dropout masks, whatever `localize` is
        if self._replays or self._evidence.enabled:
            self._window.append(capture_rng(pl_module, batch, batch_idx))
        else:
            self._window.append(MicroBatch(batch, batch_idx, _NO_RNG))

    @override
    def on_before_backward(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor
    ) -> None:
        self._sentinel.add_loss(loss, self._window[-1] if self._window else None)
        if self._trace is not None:
            self._trace.end_forward(loss)

    def _name_outside(self, trainer: pl.Trainer, params: list[torch.Tensor]) -> None:
        """Name the optimized parameters outside the LightningModule: the connectors of a
        ``FeatureDistillation`` (built at its first batch) as the expression that reaches them,
        ``FeatureDistillation.connectors['features.2'].weight``; any other by its position."""
        from .distillation.callback import FeatureDistillation

        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(callback, FeatureDistillation):
                for pair, connector in callback.connectors.items():
                    for name, weight in connector.named_parameters():
                        where = f"{type(callback).__name__}.connectors[{pair!r}].{name}"
                        self._names.setdefault(id(weight), where)
        for k, param in enumerate(params):
            self._names.setdefault(id(param), f"param{k}")

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if any(id(p) not in self._names for p in params):
            self._name_outside(trainer, params)
        named = [(self._names[id(p)], p) for p in params]
        reading = self._sentinel.read(named, pl_module.device)
        # an optimizer that calls its closure several times in one step (LBFGS): each of its
        # backwards is checked, on the batch the closure ran, and the step is reported once
        again = self._steps.enter(optimizer)
        if not again:
            self._step_window = self._window
        timelines = self._timelines
        if self._trace is not None:
            timelines = [*timelines, self._trace.finish()]
        window, step, log_step = self._window, trainer.global_step, step_axis(trainer)
        if again:
            window = self._step_window[-1:]
        # manual optimization may step again in this batch: its next steps are of this batch too
        self._window = [] if pl_module.automatic_optimization else window[-1:]
        self._timelines = []
        self._sentinel.reset()
        if self._trace is not None:  # manual optimization may go on in this batch
            self._trace.begin()
        index = next((k for k, o in enumerate(trainer.optimizers) if o is optimizer), 0)
        if self._decides_now(trainer):
            self._decide(trainer, pl_module, named, reading, window, timelines, index, again)
            return
        pending = Pending(reading, step, log_step, window, index, timelines, again)
        packed = [line.pack() for line in timelines]
        pending.packed = [to_host_later(p) if p is not None else None for p in packed]
        reading.later()  # its event is recorded after the copies above
        self._pending.append(pending)
        self._resolve(trainer, wait=False)

    @override
    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self._resume_clipping()  # the optimizer step of a skipped batch is over
        self._rules_after_batch(trainer, outputs)

    # ------------------------------------------------------------------ checkpointing
    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "counters": dict(self.counters),
            "streaks": dict(self._streaks),
            **self._rules_state(),
        }

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # A monitor resumed with another `on_nonfinite`, `localize` or `name` (another `state_key`)
        # goes on with the checkpoint's monitor: its counters, rules and findings still apply.
        found = unclaimed_state(
            self,
            trainer,
            checkpoint,
            takes=lambda other: isinstance(other, HealthMonitor),
            fits=lambda state: "counters" in state,
        )
        if found is None:
            return
        key, state = found
        self.load_state_dict(state)
        made_of = "`on_nonfinite` and `localize`" if self.name is None else "`name`"
        rank_zero_warn(
            f"{type(self).__name__}: the checkpoint holds no state for this monitor's "
            f"{made_of}, so it takes the state of the checkpoint's {key} "
            "(its counters, its rules' windows and counts, the findings in force) and goes on "
            "as that monitor would."
        )

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.counters.update(state_dict.get("counters", {}))
        streaks = state_dict.get("streaks", {0: state_dict.get("streak", 0)})  # one optimizer
        self._streaks = {int(k): int(v) for k, v in streaks.items()}
        self._load_rules_state(state_dict)
