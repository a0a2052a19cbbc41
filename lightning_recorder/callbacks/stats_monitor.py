"""`FeatureStatsMonitor`: feature, parameter and gradient statistics of chosen layers, logged."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.loggers import Logger, TensorBoardLogger, WandbLogger
from lightning.pytorch.loggers.logger import DummyLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torch import Tensor, nn
from typing_extensions import override

from .._core.checks import check_bool, check_positive_int, suggestion
from .._core.compat import distributed_active, pending_grad_scale
from .._core.names import (
    absent_module_type,
    canonical_name,
    named_modules,
    named_parameters,
    refuse_second_name,
    select,
)
from ..errors import RecorderConfigError, UnknownSourceError
from ..recorders import RecordStream
from ..stats import STAT_NAMES, StatName
from ..stats._collect import _STAGED_32, Collector
from ..stats._engine import row_counts, warm_up
from ..stats._histogram import ranges, stream_table
from ..stats._state import F64, finalize
from ..stats.metric import BucketCounts, ChannelCounts, ChannelExtremes, StreamStates
from ..stats.sharded import any_sharded
from ._lightning import LOOP_STAGES, STAGES, Stage, is_compiled, is_due, step_axis
from ._parameter_stats import ParameterStats
from ._stats_options import (
    ALL,
    DEFAULT_STATS,
    PARAM_STATS,
    ModuleSource,
    item_key,
    logger_stats,
    parameter_patterns,
    record_tensors,
    source_and_path,
    source_key,
    stat_names,
    stats_for,
    unmonitored_parameters,
    value_tensors,
)
from ._stats_report import StatsReport
from ._tensorboard import (
    PURE_PYTHON_CHECKSUM_MS_PER_KIB,
    SLOW_CHECKSUM_BYTES,
    WANDB_MAX_BINS,
    HistogramTable,
    checksummed_in_python,
    histogram_loggers,
    logger_names,
    write_tensorboard,
    write_wandb,
)
from .recorder import RecorderCallback

__all__ = ["FeatureStatsMonitor", "StatsReport"]

# The statistics of a parameter, and of a histogram, as tag suffixes (see FeatureStatsMonitor._tags)
_NORM, _STEPPED, _HISTOGRAM = ("norm",), ("grad_norm", "update_ratio"), ("histogram",)
# The name under which the tags of every module together are cached (no module's name: module
# names never hold a NUL; the root module's is "").
_EVERY = "\0every module"
# A step whose kept records (``exact_histograms``, compiled models) exceed this many bytes warns.
_RECORDS_WARN_BYTES = 256 * 2**20
#: the largest ``histogram_sample``: the staging buffer holds eight rows of it (512 MiB of
#: float32 at this size); histograms of every element are ``exact_histograms``' job
_MAX_HISTOGRAM_SAMPLE = 2**24
# Lightning's precision settings and the dtype of the outputs they produce.
_PRECISION_DTYPES = {"bf16": torch.bfloat16, "16": torch.float16, "64": torch.float64}

Series = tuple[Stage, int | None]  # a stage and its dataloader (None: one, or pooled)
# Chooses the modules whose per-channel extremes are kept: (series name, module) -> True (the
# default channel dimension), a dimension, or False / None (not tracked).
ChannelSelector = Callable[[str, nn.Module], "bool | int | None"]


@dataclass
class _HostValues:
    """What one logged series brought to the host, for :class:`StatsReport`."""

    series: Series
    step: int
    stats: dict[str, list[float]]
    histograms: np.ndarray | None  # the flat histogram table
    channels: list[float]
    parameters: list[float]


class FeatureStatsMonitor(RecorderCallback):
    """Log statistics of the outputs, parameters and gradients of chosen layers.

    For every module matched by ``sources`` it streams the statistics of its outputs
    (those of :class:`~lightning_recorder.stats.FeatureStats`: mean, std, min, max, mean ``|x|``,
    fraction of zeros, count of NaN/Inf values — counted, never dropped) and logs them as scalars
    to every logger of the Trainer, plus a histogram to each
    :class:`~lightning.pytorch.loggers.TensorBoardLogger` and
    :class:`~lightning.pytorch.loggers.WandbLogger` (other loggers get scalars; a warning says so
    once; ``logger_stats`` narrows what each logger gets). For the parameters of those modules
    it logs the norm, the gradient norm (before clipping) and the update-to-parameter ratio
    ``||Δp|| / ||p||`` of the optimizer step that updates them.

    **How.** The statistics of each output are taken in its forward hook, while it is intact
    (no ``clone`` needed before an in-place op), by the statistics engine of
    :mod:`lightning_recorder.stats`: one pass over the output, compiled by ``torch.compile``
    where it can be (Triton on CUDA, inductor on the CPU; compiled in the background when the
    run starts, eager until then), with every sum in ``float64`` and no copy of the output.
    The histogram is taken over a strided sample of at most ``histogram_sample`` elements of
    each output, bucketed in the data's precision (:func:`lightning_recorder.stats.histogram`'s
    rule) and scaled to the output's count of finite values.

    **When.** Training statistics are logged every ``every_n_steps`` optimizer steps (default:
    the Trainer's ``log_every_n_steps``, so they land on the same steps as the loss); with
    gradient accumulation they cover every micro-batch of the logged step, the histogram its
    last micro-batch. Nothing is recorded on the other steps, and the monitor's hooks are
    removed from the model until the next logged step (kept on a compiled model, see
    ``keep_hooks``), so those steps run as they would without it. Evaluation statistics cover
    every batch of the epoch (the histogram its first batch) and are logged at the epoch's end,
    on Lightning's step axis, for each dataloader apart when there are several (as Lightning
    logs ``self.log`` metrics: tags end in ``/dataloader_idx_N``; ``pool_dataloaders=True``
    pools them). Nothing is recorded or written during the sanity check.

    **Tags** are ``{prefix}/{stage}/{module}/{stat}`` (e.g. ``stats/train/features.0/mean``,
    ``stats/val/classifier/zero_fraction``), ``{prefix}/{stage}/{module}/histogram``, and
    ``{prefix}/train/{parameter}/norm`` (``grad_norm``, ``update_ratio``); see :meth:`tag`. A
    source with a ``path`` adds it, dotted, after the module:
    ``stats/train/bert/hidden_states.2/mean``.

    **Structured outputs.** Without a ``path``, the statistics of a module that returns a tuple,
    a dict or a ``ModelOutput`` mix every tensor in it (a BERT model's ``last_hidden_state``
    with its ``pooler_output`` and every hidden state). Give the source a path,
    ``{"source": "bert", "path": "last_hidden_state"}``, to follow one of them; two paths into
    one module are two series. A sparse output counts its implicit zeros as zeros.

    **Across processes** every statistic is over the data of all ranks: the streaming states
    and the histograms are combined on every rank by the declared reductions of
    :class:`~lightning_recorder.stats.metric.StreamStates` and
    :class:`~lightning_recorder.stats.metric.BucketCounts`, and rank 0 writes. Parameters and
    gradients are replicated under DDP, so their norms are computed locally (sharded ones, under
    FSDP2, are reduced across their shards).

    **Edges worth knowing.** A parameter without a gradient in a step (frozen, or unused) gets
    its ``norm`` only. ``fast_dev_run`` suppresses logging (Lightning replaces every logger with
    a ``DummyLogger``): with ``every_n_steps=1`` the one batch's statistics still reach
    :meth:`subscribe` listeners; a short real run (``max_steps=1``, ``every_n_steps=1``) logs
    them. A Trainer without a logger (``logger=False``) needs a listener: it gets the
    statistics (with no histogram, which only a TensorBoard or W&B logger makes the monitor take).

    Args:
        sources: module names from ``named_modules()`` of the LightningModule (the root
            excluded; ``"net.layer1"`` when the network is ``self.net``), glob patterns such as
            ``"features.*"`` (``*`` crosses dots), ``"re:"`` regular expressions matching whole
            names, or module types (``torch.nn.Conv2d``, ``"torch.nn.Conv2d"``, ``"Conv2d"``, or
            the bare name of a class defined elsewhere, ``"BertLayer"``) — one, or a list.
            A type of ``torch.nn`` (or a class passed as such) that the model does not have is
            left out when another source matches, so that one list such as ``[nn.Conv2d,
            nn.Linear, nn.ReLU, nn.Tanh]`` serves any network; names, patterns and bare class
            names must match.
            An item may be a dict ``{"source": ..., "path": ...}`` to follow a path into the
            module's output: a tuple index (``0``), a key or attribute (``"last_hidden_state"``),
            or a dotted chain of them (``"hidden_states.2"``), as the ``path`` of
            :class:`~lightning_recorder.RecorderCallback`.
        every_n_steps: log training statistics every N optimizer steps; ``None`` follows the
            Trainer's ``log_every_n_steps`` (0, no training step logged, is an error in ``fit``
            when ``stages`` has ``"train"``). A number needs ``"train"`` in ``stages``.
        stages: the loops to monitor: any of ``"train"``, ``"val"``, ``"test"``, ``"predict"``.
        stats: the statistics to log, one name or a list (``"numel"`` too, if wanted).
        histograms: also write histograms to TensorBoard and W&B loggers.
        histogram_every_n_steps: write training histograms every N optimizer steps only, a
            multiple of the steps that log (``every_n_steps``, or the Trainer's
            ``log_every_n_steps``), as W&B's ``watch(log_freq=...)`` writes its histograms less
            often than scalars (it needs ``"train"`` in ``stages``); ``None`` (the default)
            writes them on every logged step. The other logged steps neither sample the outputs
            nor count buckets (about 1.4 ms of a logged step's 3 ms on the benchmarks' small
            CNN). Evaluation histograms are unchanged (one per evaluation epoch).
        bins: the number of histogram buckets (30 by default, as TensorBoard's own histogram
            summary, ``tensorboard.summary.histogram``); at most 512 when histograms go to a
            ``WandbLogger`` (a ``wandb.Histogram`` holds no more).
        parameters: also log the norms, gradient norms and update ratios of the parameters
            inside the monitored modules: ``True`` every one of them, a name, glob or ``"re:"``
            pattern (or a list of them, names as in ``named_parameters()`` of the LightningModule)
            those it selects among them (training statistics: a name or pattern needs ``"train"``
            in ``stages``), ``False`` none. A parameter shared with another module
            (tied weights) is logged once, under its first name in ``named_parameters()``.
        prefix: the first component of every tag. A logger's own ``prefix`` comes before it
            where the logger applies it: in ``log_metrics`` (W&B, CSV and other loggers) and
            in :class:`~lightning_recorder.TensorBoardLogger`'s events. Lightning's
            ``TensorBoardLogger`` keeps its prefix to itself and the monitor writes its events
            directly: there, to file the monitor's charts beside metrics logged with the
            logger's prefix ``"run"``, pass ``prefix="run-stats"``.
        clone: record a copy of each output. Needed only where records are kept
            (``exact_histograms=True``, or a compiled model) and the model modifies a
            monitored output in place (e.g. ``ReLU(inplace=True)`` right after it): there such a
            change raises :class:`~lightning_recorder.RecordModifiedError` rather than logging
            wrong values.
        name: distinguishes two monitors with the same configuration; not empty or blank.
        keep_hooks: keep the hooks installed between logged steps (see
            :class:`~lightning_recorder.RecorderCallback`); ``None`` keeps them on a compiled
            model only.
        logger_stats: ``{logger class name: statistic names}`` (one name or a list): a
            logger whose class (or a base class) is named here gets only those statistics
            (names from ``stats``, ``"norm"``, ``"grad_norm"``, ``"update_ratio"``,
            ``"histogram"``; not ``"histogram"`` with ``histograms=False``, nor the parameters'
            with ``parameters=False`` or without ``"train"`` in ``stages``); other loggers get all.
            Keeps tabular loggers such as ``CSVLogger`` readable.
        exact_histograms: keep every output until the batch ends and histogram all of its
            elements (see the attribute of that name); by default the histogram is taken over a
            strided sample, in the hook.
        histogram_sample: the number of elements sampled from each larger output for the
            histogram (see the attribute of that name); at most ``2**24``.
        pool_dataloaders: pool the statistics of several evaluation dataloaders into one series
            per stage (default: one series per dataloader, as Lightning logs metrics).

    Raises:
        RecorderConfigError: an argument is invalid (at construction, as is a ``parameters``
            name or pattern, or an ``every_n_steps`` number, without ``"train"`` in
            ``stages``); the Trainer runs with ``barebones=True`` in a loop that runs one of
            ``stages``, ``logger_stats`` names no logger of it,
            ``histogram_every_n_steps`` is not a multiple of the Trainer's
            ``log_every_n_steps``, or ``bins`` is over 512 for a
            ``WandbLogger`` (at setup); the Trainer has no logger in such a loop and the monitor
            no :meth:`subscribe` listener, a source matches no
            module, or a ``parameters`` pattern no parameter of the monitored modules (at the
            start of the run, naming the closest names), or another monitor of the Trainer
            writes the same tags (the same ``prefix``, stage and module, or the same ``prefix``
            and parameter; at the start of the run).

    Examples:
        >>> import lightning.pytorch as pl
        >>> import torch
        >>> from lightning.pytorch.loggers import CSVLogger
        >>> from torch import nn
        >>> class Net(pl.LightningModule):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        ...     def training_step(self, batch, batch_idx):
        ...         return self.body(batch[0]).square().mean()
        ...     def configure_optimizers(self):
        ...         return torch.optim.SGD(self.parameters(), lr=0.1)
        >>> import tempfile
        >>> logger = CSVLogger(tempfile.mkdtemp())
        >>> monitor = FeatureStatsMonitor(["body.0", "body.2"], every_n_steps=2)
        >>> data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)))
        >>> trainer = pl.Trainer(max_steps=4, callbacks=[monitor], logger=logger,
        ...     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        >>> trainer.fit(Net(), data)
        >>> monitor.logged_steps, monitor.last_logged_step
        (2, 3)
        >>> monitor.tag("train", "body.0", "mean")
        'stats/train/body.0/mean'
    """

    #: Keep every output until the batch ends and histogram all of its elements (the statistics
    #: are the same). By default (``False``) the statistics of each output are computed in the
    #: forward hook, while the output is intact (no ``clone`` needed before an in-place op,
    #: nothing held on long steps), and the histogram is taken over a strided sample of at most
    #: :attr:`histogram_sample` elements of each output. It needs ``clone=True`` where an
    #: in-place op follows a monitored module. Compiled models always keep their records.
    exact_histograms: bool = False
    #: Elements sampled from each output for its histogram (outputs with no more are
    #: histogrammed whole): each bucket's fraction has a standard error of at most
    #: ``0.5 / sqrt(n)`` for ``n`` sampled values (0.008 for the default), for data in no
    #: particular order; the count, sums and range are exact.
    histogram_sample: int = 2**12

    def __init__(
        self,
        sources: ModuleSource | Mapping[str, Any] | Sequence[ModuleSource | Mapping[str, Any]],
        every_n_steps: int | None = None,
        stages: Stage | Sequence[Stage] = ("train", "val"),
        stats: StatName | Sequence[StatName] = DEFAULT_STATS,
        histograms: bool = True,
        bins: int = 30,
        histogram_every_n_steps: int | None = None,
        parameters: bool | str | Sequence[str] = True,
        prefix: str = "stats",
        clone: bool = False,
        name: str | None = None,
        keep_hooks: bool | None = None,
        logger_stats: Mapping[str, str | Sequence[str]] | None = None,
        exact_histograms: bool = False,
        histogram_sample: int = 2**12,
        pool_dataloaders: bool = False,
    ) -> None:
        owner = type(self).__name__
        items = [sources] if isinstance(sources, (str, type, Mapping)) else sources
        if not isinstance(items, Sequence) or not items:
            raise RecorderConfigError(
                f"Expected `sources` of {owner} to be a module name, pattern or type, or a "
                f"non-empty list of them, but got {sources!r}."
            )
        configs: dict[str, dict[str, Any]] = {}
        # recorder name -> the dotted path into the module's output (sources with a path)
        self._paths: dict[str, str] = {}
        for item in items:
            source, path = source_and_path(item, owner)
            key = source_key(source)
            config: dict[str, Any] = {
                "type": "ModuleOutputs",
                "source": source,
                "detach": True,
                "clone": clone,
            }
            if path is not None:
                key = f"{key}/{path}"
                config["path"] = path
                self._paths.setdefault(key, path)
            configs.setdefault(key, config)
        chosen_stats = stat_names(stats, owner)
        check_bool(clone, "clone", owner)
        check_positive_int(bins, "bins", owner)
        check_bool(exact_histograms, "exact_histograms", owner)
        check_positive_int(histogram_sample, "histogram_sample", owner)
        if histogram_sample > _MAX_HISTOGRAM_SAMPLE:
            raise RecorderConfigError(
                f"Expected `histogram_sample` of {owner} to be at most 2**24 "
                f"({_MAX_HISTOGRAM_SAMPLE:,}) but got {histogram_sample:,}: the monitor holds "
                "samples of that size for several outputs at once. For histograms of every "
                "element, pass exact_histograms=True."
            )
        check_bool(pool_dataloaders, "pool_dataloaders", owner)
        if not isinstance(histograms, bool):
            raise RecorderConfigError(
                f"Expected `histograms` of {owner} to be a bool but got {histograms!r}."
            )
        check_positive_int(
            histogram_every_n_steps, "histogram_every_n_steps", owner, allow_none=True
        )
        if histogram_every_n_steps is not None and not histograms:
            raise RecorderConfigError(
                f"Expected `histogram_every_n_steps` of {owner} to be None with histograms=False "
                f"(there are no histograms to space out) but got {histogram_every_n_steps!r}; "
                "pass histograms=True, or leave histogram_every_n_steps out."
            )
        patterns = parameter_patterns(parameters, owner)
        if not isinstance(prefix, str) or "" in prefix.split("/"):
            raise RecorderConfigError(
                f"Expected `prefix` of {owner} to be a non-empty str without a leading, trailing "
                f"or doubled '/' (tag components such as 'stats' or 'probe/stats') but got "
                f"{prefix!r}."
            )
        super().__init__(
            configs, stages=stages, every_n_steps=every_n_steps, name=name, keep_hooks=keep_hooks
        )
        if patterns is not None and "train" not in self.stages:
            raise RecorderConfigError(
                f"Expected `stages` of {owner} to hold 'train' with `parameters` "
                f"{parameters!r}, since parameter statistics are taken at the optimizer steps "
                f"of training, but got stages={list(self.stages)!r}, where none would be logged. "
                "Add 'train' to `stages`, or leave `parameters` out."
            )
        self.parameters = parameters
        per_logger = logger_stats_option(
            logger_stats, chosen_stats, owner, histograms is True, self._logs_parameters
        )
        if histogram_every_n_steps is not None and "train" not in self.stages:
            raise RecorderConfigError(
                f"Expected `histogram_every_n_steps` of {owner} to be None without 'train' in "
                f"`stages` (it spaces out training histograms; an evaluation epoch writes one "
                f"histogram) but got {histogram_every_n_steps!r} with "
                f"stages={list(self.stages)!r}; add 'train' to `stages`, or leave "
                "histogram_every_n_steps out."
            )
        self.sources = list(items)
        self.stats: tuple[StatName, ...] = chosen_stats
        self.histograms = histograms
        self.bins = bins
        self.histogram_every_n_steps = histogram_every_n_steps
        if isinstance(every_n_steps, int):  # known now: say so at construction
            self._check_histogram_cadence(every_n_steps, "`every_n_steps`")
        self.prefix = prefix
        self.clone = clone
        self.logger_stats = per_logger
        self.exact_histograms = exact_histograms
        self.histogram_sample = histogram_sample
        self.pool_dataloaders = pool_dataloaders
        self._param_patterns = patterns
        self._tag_cache: dict[tuple[str, str, tuple[str, ...]], tuple[str, ...]] = {}
        #: Training steps whose statistics were logged, and the step axis value of the last one.
        self.logged_steps = 0
        self.last_logged_step = -1
        self._write_histograms = False
        self._warned = False
        self._records_warned = False
        self._checksums_checked: set[int] = set()  # id() of the TensorBoard loggers checked
        self._complex_warned: set[int] = set()  # streams told that complex outputs are left out
        self._empty_warned: set[int] = set()  # streams told that an output held no tensor
        self._streams: dict[str, RecordStream] = {}
        self._index: dict[int, int] = {}  # id(stream) -> its index among the streams
        self._collector: Collector | None = None
        self._metrics: dict[Series, StreamStates] = {}
        self._eval_tables: dict[Series, Tensor | None] = {}  # each series' first-batch histograms
        self._params: ParameterStats | None = None
        self._in_hook = True
        self._trainer: pl.Trainer | None = None
        self._batch_states: StreamStates | None = None
        self._bucket_counts: BucketCounts | None = None
        self._listeners: list[Callable[[StatsReport], None]] = []
        self._needs_logger = False  # the run's Trainer has no logger (see `setup`)
        self._selectors: list[ChannelSelector] = []
        self._channel_sizes: dict[int, int] = {}  # stream index -> channels of its outputs
        self._sizes_agreed = False  # under DDP: every tracked stream's channels known on every rank
        self._extremes_metric: ChannelExtremes | None = None

    def tag(self, stage: Stage, name: str, stat: str) -> str:
        """The tag of statistic ``stat`` of module or parameter ``name`` in ``stage``."""
        return f"{self.prefix}/{stage}/{name}/{stat}"

    @property
    def _logs_parameters(self) -> bool:
        """Whether parameter statistics are logged: ``parameters`` not ``False``, and training
        statistics (they are taken at the optimizer steps), so ``"train"`` in ``stages``."""
        return self.parameters is not False and "train" in self.stages

    def subscribe(self, listener: Callable[[StatsReport], None]) -> None:
        """Call ``listener`` with a :class:`StatsReport` of every logged training step and
        evaluation epoch (on rank zero, after the loggers got them). A listener makes the step
        bring every statistic to the host, not only those of ``stats``. With one, a Trainer
        without a logger is fine: the listeners get the statistics.

        Raises:
            RecorderConfigError: ``listener`` is not callable.
        """
        if not callable(listener):
            raise RecorderConfigError(
                f"Expected a callable taking a StatsReport but got {type(listener).__name__}."
            )
        if listener not in self._listeners:
            self._listeners.append(listener)

    def unsubscribe(self, listener: Callable[[StatsReport], None]) -> None:
        """Stop calling ``listener`` (nothing happens if it was not subscribed)."""
        if listener in self._listeners:
            self._listeners.remove(listener)

    def track_channels(self, selector: ChannelSelector) -> None:
        """Keep the per-channel extremes (min, max, min ``|x|``) of the outputs of the modules
        ``selector`` chooses, on logged training steps, for :attr:`StatsReport.channels`.

        ``selector(series, module)`` is called at the start of each run for every monitored
        series (its name, and the module) and returns ``True`` (track, channels along dim 1 of
        4-d and larger outputs, along the last dim of others), a dimension, or ``False``/
        ``None``. It costs one more pass over each tracked output on logged steps.

        Raises:
            RecorderConfigError: ``selector`` is not callable, or ``stages`` has no ``"train"``
                (evaluation stages keep no channel extremes); when the run starts, it returned
                something else than these; on a logged step, its dimension is not one of the
                outputs'.
        """
        if not callable(selector):
            raise RecorderConfigError(
                f"Expected a callable (series name, module) -> bool | int | None but got "
                f"{type(selector).__name__}."
            )
        if "train" not in self.stages:
            raise RecorderConfigError(
                f"Expected `stages` of {self!r} to hold 'train' for track_channels, since the "
                "per-channel extremes are kept on logged training steps only, but got "
                f"stages={list(self.stages)!r}, where none would be kept. Add 'train' to "
                "`stages`, or track the channels with a monitor of training steps."
            )
        if selector not in self._selectors:
            self._selectors.append(selector)

    def untrack_channels(self, selector: ChannelSelector) -> None:
        """Stop asking ``selector`` from the next run on (nothing happens if it was not given to
        :meth:`track_channels`)."""
        if selector in self._selectors:
            self._selectors.remove(selector)

    def _tags(self, stage: Stage, name: str, stats: tuple[str, ...]) -> tuple[str, ...]:
        """:meth:`tag` of each of ``stats`` (cached: every logged step writes the same tags)."""
        key = (stage, name, stats)
        tags = self._tag_cache.get(key)
        if tags is None:
            tags = self._tag_cache[key] = tuple(self.tag(stage, name, stat) for stat in stats)
        return tags

    def _flat_tags(self, series: Series, stats: tuple[str, ...]) -> tuple[str, ...]:
        """The tags of ``stats`` of every module in ``series``, module by module (cached)."""
        stage, loader = series
        key = (stage, _EVERY if loader is None else f"{_EVERY}/{loader}", stats)
        tags = self._tag_cache.get(key)
        if tags is None:
            suffix = "" if loader is None else f"/dataloader_idx_{loader}"
            tags = tuple(
                t + suffix for module in self._streams for t in self._tags(stage, module, stats)
            )
            self._tag_cache[key] = tags
        return tags

    @override
    def _make_state_key(self) -> str:
        if self.name is not None:
            return self._generate_state_key(name=self.name)
        return self._generate_state_key(
            sources=[item_key(s) for s in self.sources],
            stages=self.stages,
            every_n_steps=self.every_n_steps,
            prefix=self.prefix,
        )

    # ------------------------------------------------------------------ lifecycle
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._needs_logger = False
        if not set(self.stages) & set(LOOP_STAGES.get(stage, STAGES)):
            # a loop of none of its stages (`predict` with the default stages): it writes
            # nothing there, and needs no logger
            super().setup(trainer, pl_module, stage)
            return
        # barebones turns logging off and refuses a logger: the advice of the checks below
        # (a cadence of its own, a logger) could not be followed there
        if getattr(trainer, "barebones", False):
            raise RecorderConfigError(
                f"Expected a Trainer that logs for {self!r} to write to, but it runs with "
                "barebones=True, which turns logging off (no logger, log_every_n_steps=0) and "
                "refuses a logger. Run without barebones=True, with a logger such as "
                "TensorBoardLogger."
            )
        super().setup(trainer, pl_module, stage)
        if self.every_n_steps is None:
            self._check_histogram_cadence(self._every, "the Trainer's `log_every_n_steps`")
        # Without a logger, the listeners get the reports: checked when the run starts, once
        # every callback's setup ran (HealthMonitor subscribes in its own).
        self._needs_logger = not trainer.loggers
        # fast_dev_run swaps the Trainer's loggers for one DummyLogger ("Logging and
        # checkpointing is suppressed"): no logger of the user's to check `logger_stats` against,
        # nor to warn about; the statistics still reach the listeners.
        loggers = [lg for lg in trainer.loggers if not isinstance(lg, DummyLogger)]
        present = set().union(*(logger_names(lg) for lg in loggers))
        for key in self.logger_stats if loggers else ():
            if key not in present:
                shown = sorted(type(lg).__name__ for lg in loggers)
                raise RecorderConfigError(
                    f"Expected the keys of `logger_stats` of {type(self).__name__} to name logger "
                    f"classes of the Trainer but got {key!r}. "
                    f"{suggestion(key, shown, 'logger classes')}"
                )
        able, others = histogram_loggers(loggers)
        wanted = [lg for lg in able if "histogram" in self._logger_filter(lg)]
        self._write_histograms = self.histograms and bool(wanted)
        wandb = [type(lg).__name__ for lg in wanted if isinstance(lg, WandbLogger)]
        if self._write_histograms and wandb and self.bins > WANDB_MAX_BINS:
            raise RecorderConfigError(
                f"Expected `bins` of {type(self).__name__} to be at most {WANDB_MAX_BINS} with "
                f"a {wandb[0]}, whose wandb.Histogram holds at most {WANDB_MAX_BINS} buckets, but "
                f"got {self.bins}; pass bins={WANDB_MAX_BINS} or fewer, or leave 'histogram' out "
                f"of `logger_stats` for {wandb[0]}."
            )
        # a logger whose `logger_stats` entry leaves "histogram" out asked for none
        unshown = [lg for lg in others if "histogram" in self._logger_filter(lg)]
        if self.histograms and unshown and not self._warned:
            self._warned = True
            self._warn_histograms_unshown(unshown)

    def _warn_histograms_unshown(self, loggers: list[Logger]) -> None:
        """Say that ``loggers`` cannot show histograms, and the two ways to silence it: the
        ``logger_stats`` entry of each without ``"histogram"`` (the other loggers keep theirs),
        or ``histograms=False`` (no histograms for any logger)."""
        names = [type(lg).__name__ for lg in loggers]
        verb = "gets" if len(names) == 1 else "get"
        listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
        offered = (*self.stats, *(PARAM_STATS if self._logs_parameters else ()))
        entries = {
            type(lg).__name__: [n for n in offered if n in self._logger_filter(lg)]
            for lg in loggers
        }
        rank_zero_warn(
            f"{type(self).__name__} writes histograms to TensorBoard and W&B loggers only; "
            f"{listed} {verb} the scalar statistics. To silence this warning, leave 'histogram' "
            f"out of `logger_stats` for {' and '.join(entries)} (logger_stats={entries!r}), "
            "which keeps the histograms of any other logger, or pass histograms=False for none "
            "at all."
        )

    @override
    @override
    def _configs_for(self, pl_module: pl.LightningModule) -> dict[str, dict[str, Any]]:
        """Every source but the module types the model does not have, so that one list, such as
        ``[nn.Conv2d, nn.Linear, nn.ReLU, nn.Tanh]``, serves any network. Names, patterns and
        bare class names that are not ``torch.nn``'s must match (a typo is an error there), and
        so must one of the types.

        Raises:
            UnknownSourceError: every source is a module type and the model has none of them.
        """
        modules = named_modules(pl_module)
        present = {
            key: config
            for key, config in self._configs.items()
            if not absent_module_type(config["source"], modules)
        }
        if present:
            return present
        if len(self._configs) == 1:  # one source: the recorder's own error names it
            return self._configs
        wanted = ", ".join(key.rsplit(".", 1)[-1] for key in self._configs)
        types = sorted({type(module).__name__ for name, module in modules.items() if name})
        raise UnknownSourceError(
            f"{type(self).__name__} found no module of any of the types of `sources` "
            f"({wanted}) in the model, so it would monitor nothing. Types present: "
            f"{', '.join(types)}. Name some of those, or modules by name or pattern."
        )

    def _on_attach(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._needs_logger and not self._listeners:
            raise RecorderConfigError(
                f"Expected the Trainer to have a logger for {self!r} to write to, but it has "
                "none (logger=False); pass a logger such as TensorBoardLogger, or subscribe a "
                "listener (`subscribe`) that reads the statistics without one."
            )
        # One stream per key: the module name, then "/" and the dotted path if there is one
        # (two paths into one module are two series; a second recorder of a key is not counted).
        streams: dict[str, RecordStream] = {}
        for recorder_name, stream in self.manager.streams():
            path = self._paths.get(recorder_name)
            streams.setdefault(stream.name if path is None else f"{stream.name}/{path}", stream)
        params = self._chosen_parameters(pl_module, streams) if self._logs_parameters else None
        self._check_tags_are_its_own(trainer, streams, params or {})
        self._streams = streams
        self._tag_cache.clear()  # the cached tags of every module follow these streams
        self._index = {id(stream): i for i, stream in enumerate(streams.values())}
        self._complex_warned.clear()
        self._empty_warned.clear()
        device = pl_module.device
        self._collector = Collector(len(streams), self.histogram_sample, device)
        self._channel_sizes, self._extremes_metric = {}, None
        self._sizes_agreed = False
        if self._selectors:
            modules = named_modules(pl_module)
            for index, (key, stream) in enumerate(streams.items()):
                module = modules.get(stream.name)
                for selector in self._selectors:
                    dim = None if module is None else selector(key, module)
                    if dim is not None and dim is not False:
                        self._collector.channels[index] = _channel_dim(dim, selector, key)
                        break
        self._metrics, self._eval_tables = {}, {}
        self._batch_states = StreamStates(len(streams)).to(device)
        self._bucket_counts = BucketCounts(len(streams), self.bins).to(device)
        self._trainer = trainer
        # Compile the statistics for the dtypes the outputs will have, now and in the
        # background: never inside a training step (eager until it is ready). Under
        # torch.use_deterministic_algorithms(True) (Trainer(deterministic=True)) the run waits
        # for it here: the eager and compiled kernels differ in the last bits, so which one a
        # step takes must not depend on how soon the background work ends.
        dtypes = {p.dtype for p in pl_module.parameters() if p.is_floating_point()}
        precision = str(getattr(trainer, "precision", "32"))
        dtypes |= {torch.float32}
        dtypes |= {d for k, d in _PRECISION_DTYPES.items() if precision.startswith(k)}
        deterministic = torch.are_deterministic_algorithms_enabled()
        warm_up(device, sorted(dtypes, key=str), wait=deterministic)
        # The statistics in the hook: each recorder's capture is the monitor's.
        self._in_hook = not (self.exact_histograms or is_compiled(pl_module))
        if self._in_hook:
            for name in dict.fromkeys(name for name, _ in self.manager.streams()):
                # an instance attribute shadows the method for this recorder only
                recorder = self.manager.get_recorder(name)
                recorder.capture = self._capture  # type: ignore[method-assign]
        if self._params is not None:
            self._params.close()
        self._params = None
        if params is not None:
            self._params = ParameterStats(params, any_sharded(params.values()))

    def _check_tags_are_its_own(
        self, trainer: pl.Trainer, streams: Mapping[str, Any], params: Mapping[str, Any]
    ) -> None:
        """Refuse a monitor that would write the same tags as another one of the Trainer (the
        same prefix, stage and module, or the same prefix and parameter, which nested sources
        such as ``"body"`` and ``"body.0"`` share): each would log its points into the other's
        series."""
        for other in trainer.callbacks:  # type: ignore[attr-defined]
            if other is self or not isinstance(other, FeatureStatsMonitor):
                continue
            if other.prefix != self.prefix:
                continue
            stages = [stage for stage in self.stages if stage in other.stages]
            shared = [name for name in streams if name in other._streams]
            if stages and shared:
                raise RecorderConfigError(
                    f"Expected {self!r} and {other!r} to write different tags but both write "
                    f"{self.tag(stages[0], shared[0], '...')!r} (stages {stages}, modules "
                    f"{shared[:5]}): each would log into the other's series. Give one of them "
                    "another `prefix`, or other `sources` or `stages`."
                )
            theirs = other._params.params if other._params is not None else {}
            both = [name for name in params if name in theirs]
            if both:
                raise RecorderConfigError(
                    f"Expected {self!r} and {other!r} to write different tags but both write "
                    f"{self.tag('train', both[0], 'norm')!r} (parameters {both[:5]}, inside "
                    "the modules of both): each would log into the other's series. Give one of "
                    "them another `prefix`, `parameters=False`, or `parameters` patterns that "
                    "leave the other's out."
                )

    def _chosen_parameters(
        self, pl_module: pl.LightningModule, streams: dict[str, RecordStream]
    ) -> dict[str, torch.nn.Parameter]:
        monitored = {s.name for s in streams.values()}
        every = named_parameters(pl_module)
        # A parameter shared with another module (tied weights: GPT-2's `lm_head.weight` is its
        # `transformer.wte.weight`) is inside by any of its names, and named by its first one.
        # Inside: a monitored module's name ends at one of its dots (a lookup per dot, not a
        # comparison with every monitored module).
        ids = set()
        for name, param in pl_module.named_parameters(remove_duplicate=False):
            name = canonical_name(name)
            if any(name[:k] in monitored for k, char in enumerate(name) if char == "."):
                ids.add(id(param))
        inside = {name: param for name, param in every.items() if id(param) in ids}
        if self._param_patterns is None:
            return inside
        chosen: set[str] = set()
        for pattern in self._param_patterns:
            try:
                chosen.update(select(inside, pattern, "parameter"))
            except UnknownSourceError as err:
                owner = type(self).__name__
                try:  # the second name of a tied parameter?
                    refuse_second_name(pl_module, pattern, "parameter", every)
                except UnknownSourceError as tied:
                    raise UnknownSourceError(f"`parameters` of {owner}: {tied}") from None
                try:  # parameters of the model, of modules that are not monitored?
                    outside = select(every, pattern, "parameter")
                except UnknownSourceError:
                    raise UnknownSourceError(
                        f"`parameters` of {owner} selects among the parameters of the monitored "
                        f"modules: {err}"
                    ) from None
                raise UnknownSourceError(unmonitored_parameters(pattern, outside, owner)) from None
        return {name: param for name, param in inside.items() if name in chosen}

    @override
    def _on_detach(self) -> None:
        if self._params is not None:
            self._params.close()  # its optimizers' step post-hooks
        self._streams, self._index, self._metrics, self._eval_tables = {}, {}, {}, {}
        self._collector, self._params, self._trainer = None, None, None
        self._batch_states, self._bucket_counts = None, None

    def _capture(self, stream: RecordStream, value: Any) -> None:
        """The recorders' capture while the statistics are computed in the hook: the packed
        state of each real tensor of ``value`` (and a sample of it for a histogram written from
        this batch), taken now, before a later in-place op can change it; nothing else kept."""
        stream.num_calls += 1
        if self._idle:  # a batch recorded only to keep the hooks' flag on (keep_hooks): no data
            return
        index = self._index.get(id(stream))
        collector = self._collector
        if index is None or collector is None:
            return  # a second recorder matching the same module (and path): counted once
        sample = self._wants_sample()
        # (no grad mode needed: the collector reads detached tensors only)
        if type(value) is Tensor:  # the common case: one plain tensor
            if not value.is_complex():
                collector.add(index, value, sample)
            elif index not in self._complex_warned:
                self._warn_complex(index, value)
            return
        found = False
        for tensor in value_tensors(value, self._complex_seen(index)):
            collector.add(index, tensor, sample)
            found = True
        if not found and index not in self._complex_warned:
            self._warn_no_tensor(index, value)

    def _warn_no_tensor(self, index: int, value: Any) -> None:
        """Say once per stream that an output held no tensor to read (an object of its own
        class, None), and what to monitor instead."""
        self._warn_once(
            self._empty_warned,
            index,
            lambda key: (
                f"an output of {key!r} holds no tensor the monitor can read (got "
                f"{type(value).__name__}; it looks inside tuples, lists, dicts, dataclasses and "
                "PackedSequence), so that output is not logged. Monitor a submodule whose "
                "output is a tensor, or return a tuple, dict or dataclass of tensors."
            ),
        )

    def _warn_once(self, told: set[int], index: int, message: Callable[[str], str]) -> None:
        """Warn with ``message(key)`` for stream ``index`` unless ``told`` holds it already."""
        if index in told:
            return
        told.add(index)
        key = tuple(self._streams)[index]
        rank_zero_warn(f"{self!r}: {message(key)} Reported once per module.")

    def _complex_seen(self, index: int) -> Callable[[Tensor], None] | None:
        """What to call on a complex tensor of stream ``index``: warn, the first time only."""
        if index in self._complex_warned:
            return None
        return lambda tensor: self._warn_complex(index, tensor)

    def _warn_complex(self, index: int, tensor: Tensor) -> None:
        """Say once per stream that its complex outputs are left out (no statistic is defined
        for them), and how to monitor them."""
        self._warn_once(
            self._complex_warned,
            index,
            lambda key: (
                f"an output of {key!r} is complex ({tensor.dtype}) and is left out: the "
                "statistics and histograms are of real values. To monitor it, record a real view "
                "of it: a module that returns torch.view_as_real(z) (its real and imaginary parts) "
                "or z.abs() (its magnitude)."
            ),
        )

    def _held_bytes(self) -> int:
        """Bytes of the tensors the monitor holds for the current batch (records or states)."""
        held = 0 if self._collector is None else self._collector.nbytes()
        for stream in self._streams.values():
            for record in stream.data_buffer:
                held += sum(t.numel() * t.element_size() for t in value_tensors(record))
        return held

    def _check_histogram_cadence(self, every: int, source: str) -> None:
        """Raise unless ``histogram_every_n_steps`` is a multiple of ``every``, the steps that
        log (named by ``source``)."""
        n = self.histogram_every_n_steps
        if n is None or n % every == 0:
            return
        lower, higher = n - n % every, n - n % every + every
        near = f"{lower} or {higher}" if lower else str(higher)
        raise RecorderConfigError(
            f"Expected `histogram_every_n_steps` of {type(self).__name__} to be a multiple of "
            f"the {every} steps between logged steps ({source}), so that every histogram lands "
            f"on a logged step, but got {n}; {near} would do."
        )

    def _train_histograms_due(self) -> bool:
        """Whether the current training step writes histograms (``histogram_every_n_steps``)."""
        n = self.histogram_every_n_steps
        return n is None or is_due(self._train_step, n)

    def _wants_sample(self) -> bool:
        """Whether this batch's outputs are sampled for a histogram written from it."""
        if not self._write_histograms:
            return False
        stage = self._active
        if stage == "train":
            return self._train_histograms_due()
        return stage is not None and self._series(stage) not in self._eval_tables

    def _series(self, stage: Stage) -> Series:
        """The series the current batch of ``stage`` belongs to (its dataloader's, when the loop
        has several and they are not pooled)."""
        if stage == "train" or self.pool_dataloaders:
            return (stage, None)
        trainer = self._trainer
        loaders = {"val": "num_val_batches", "test": "num_test_batches"}.get(
            stage, "num_predict_batches"
        )
        counts = getattr(trainer, loaders, None) if trainer is not None else None
        several = isinstance(counts, Sequence) and len(counts) > 1
        return (stage, self._loader if several else None)

    # ------------------------------------------------------------------ statistics
    @override
    def _after_batch(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: Stage, completes: bool
    ) -> None:
        collector = cast(Collector, self._collector)
        series = self._series(stage)
        kept: list[list[Tensor]] = []
        if not self._in_hook:  # records kept (exact histograms, compiled model): reduce now
            sample = self._wants_sample() and not self.exact_histograms
            with torch.no_grad():
                for index, stream in enumerate(self._streams.values()):
                    tensors = list(record_tensors(stream, self._complex_seen(index)))
                    if stream.data_buffer and not tensors and index not in self._complex_warned:
                        self._warn_no_tensor(index, stream.data_buffer[0])
                    for tensor in tensors:
                        collector.add(index, tensor, sample)
                    kept.append(tensors)
            self._check_records_size(kept)
        states = collector.states()
        metric = self._metrics.get(series)
        if metric is None:
            # a copy of the metric made at attach: making one on the host and moving it to the
            # device would synchronise with it (CUDA), inside the step
            template = cast(StreamStates, self._batch_states)
            metric = self._metrics[series] = cast(StreamStates, template.clone())
            metric.reset()
        metric.update(states)
        if stage == "train":
            if completes:
                self._log_train(trainer, states, kept)
        elif series not in self._eval_tables:  # the first batch of the evaluation epoch
            self._eval_tables[series] = self._histogram_table(states, kept)
        collector.clear()

    def _histogram_table(self, states: Tensor, kept: list[list[Tensor]]) -> Tensor | None:
        """The histograms of this batch (a collective under DDP, on every rank): one ``(m, 2 *
        bins + 6)`` table on the device, rows ``[num, sum, sum_squares, min, max, *edges,
        *counts]``; ``None`` without histograms to write."""
        if not self._write_histograms:
            return None
        device = states.device
        # over every rank by the metrics' declared reductions; one process: the values as such
        distributed = distributed_active()
        every = states  # this batch's states over every rank
        if distributed:
            merged = cast(StreamStates, self._batch_states)
            merged.reset()
            merged.update(states)
            every = merged.compute()
        bins = self.bins
        if self.exact_histograms:
            table = stream_table(every, self._exact_counts(kept, *ranges(every), device), bins)
        else:
            table = cast(Collector, self._collector).table(every, states, bins)
        if distributed:  # the counts summed over every rank
            summed = cast(BucketCounts, self._bucket_counts)
            summed.reset()
            summed.update(table[:, -bins:])
            table = torch.cat([table[:, :-bins], summed.compute()], 1)
        return table

    def _exact_counts(
        self, kept: list[list[Tensor]], lo: Tensor, hi: Tensor, device: torch.device
    ) -> Tensor:
        """Counts of every element of the kept records (``exact_histograms``), chunk by chunk."""
        found = torch.zeros(len(self._streams), self.bins, dtype=torch.int64, device=device)
        for index, tensors in enumerate(kept):
            for tensor in tensors:
                for piece in tensor.detach().reshape(-1).split(2**18):
                    # in the data's precision, as the sampled histograms: float32 holds the
                    # integers only up to 2**24, so integers and bool are bucketed in float64
                    dtype = torch.float32 if piece.dtype in _STAGED_32 else F64
                    values = piece.to(device, dtype)
                    part = slice(index, index + 1)
                    found[index] += row_counts(values.view(1, -1), lo[part], hi[part], self.bins)[0]
        return found.to(F64)

    def _check_records_size(self, kept: list[list[Tensor]]) -> None:
        """Warn once when a batch's kept records exceed ``_RECORDS_WARN_BYTES``."""
        if self._records_warned:
            return
        held = sum(t.numel() * t.element_size() for tensors in kept for t in tensors)
        if held > _RECORDS_WARN_BYTES:
            self._records_warned = True
            rank_zero_warn(
                f"{type(self).__name__} kept {held / 2**20:.0f} MiB of records in one batch "
                f"(more than {_RECORDS_WARN_BYTES // 2**20} MiB) because exact_histograms is "
                "set or the model is compiled; with exact_histograms=False on an uncompiled "
                "model the statistics are computed in the hooks and nothing is kept."
            )

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        params = self._params
        if self._active != "train" or params is None:
            return
        if trainer.is_global_zero or params.sharded:  # sharded norms: collectives on every rank
            # a fused optimizer under fp16 AMP: Lightning leaves the gradients scaled
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            params.before_step(optimizer, pending_grad_scale(optimizer, scaler))

    def _log_train(self, trainer: pl.Trainer, states: Tensor, kept: list[list[Tensor]]) -> None:
        """Log a training step: its histograms, statistics and parameter norms reach the host in
        one copy (the collectives under DDP run first, on every rank)."""
        step = step_axis(trainer)
        series: Series = ("train", None)
        table = self._histogram_table(states, kept) if self._train_histograms_due() else None
        metric = self._metrics[series]
        every = metric.compute()
        metric.reset()
        extremes = self._channel_extremes()  # a collective under DDP when channels are tracked
        params = self._params
        stepped: list[str] = []
        norms: list[Tensor] = []
        if params is not None and (trainer.is_global_zero or params.sharded):
            stepped, norms = params.tensors()
        if trainer.is_global_zero:
            report = self._host(series, step, every, table, norms, extremes)
            scalars, hists, values = report
            if params is not None:
                scalars.update(self._parameter_scalars(params, stepped, values.parameters))
            self._write(trainer, scalars, hists, step)
            self._tell(values, params, stepped)
        self.logged_steps += 1
        self.last_logged_step = step

    def _log_eval(self, trainer: pl.Trainer, stage: Stage) -> None:
        if stage not in self.stages or self._manager is None or trainer.sanity_checking:
            return
        for series in [s for s in self._metrics if s[0] == stage]:
            metric = self._metrics.pop(series)
            every = metric.compute()  # a collective under DDP: on every rank
            table = self._eval_tables.pop(series, None)
            if not trainer.is_global_zero:
                continue
            step = step_axis(trainer)
            scalars, hists, values = self._host(series, step, every, table, [], None)
            self._write(trainer, scalars, hists, step)
            self._tell(values, None, [])

    def _host(
        self,
        series: Series,
        step: int,
        states: Tensor,
        table: Tensor | None,
        norms: list[Tensor],
        extremes: Tensor | None,
    ) -> tuple[dict[str, float], Mapping[str, dict[str, Any]], _HostValues]:
        """The statistics, histograms, parameter norms and channel extremes of one series in one
        copy to the host (the step's one synchronisation): scalars by tag, histograms by tag,
        and the values for listeners."""
        columns = finalize(states, correction=1)
        chosen = self.stats if not self._listeners else STAT_NAMES
        parts = [torch.stack([columns[stat] for stat in chosen], 1), columns["numel"]]
        if table is not None:
            parts.append(table)
        if extremes is not None:
            parts.append(extremes)
        if norms:  # 0-d tensors, of one dtype unless some parameters are float64: one stack
            same = len({t.dtype for t in norms}) == 1
            parts.append(torch.stack(norms if same else [t.to(F64) for t in norms]))
        # one host copy (a new tensor: its numpy view is its own)
        found = torch.cat([t.reshape(-1).to(F64) for t in parts]).cpu().numpy()
        m, k = len(self._streams), len(chosen)
        at = m * k + m
        values = found[:at].tolist()
        stats: dict[str, list[float]] = {
            name: values[i : m * k : k] for i, name in enumerate(chosen)
        }
        numel = values[m * k : at]
        logged = [stats[name] for name in self.stats]
        flat = [v for row in zip(*logged, strict=True) for v in row]
        scalars = self._stat_scalars(series, [*flat, *numel])
        hists: Mapping[str, dict[str, Any]] = {}
        rows: np.ndarray | None = None
        if table is not None:
            rows = found[at : at + table.numel()]
            hists = self._host_table(series, rows, table.shape[1])
            at += table.numel()
        channels: list[float] = []
        if extremes is not None:
            channels = found[at : at + extremes.numel()].tolist()
            at += extremes.numel()
        stats["numel"] = numel
        host = _HostValues(series, step, stats, rows, channels, found[at:].tolist())
        return scalars, hists, host

    def _channel_extremes(self) -> Tensor | None:
        """The per-channel extremes ``(3, C)`` of the tracked modules in this step, side by side
        in stream order, combined over every rank (a collective: on every rank); ``None``
        without tracked modules. A module not called in the step contributes neutral values."""
        collector = self._collector
        if collector is None or not collector.channels:
            return None
        found = collector.extremes()
        if not distributed_active():
            for index, block in found.items():
                self._channel_sizes[index] = block.shape[1]
        elif not self._sizes_agreed:
            self._agree_channel_sizes(found)
        blocks = []
        for index in sorted(self._channel_sizes):
            got = found.get(index)
            if got is None:
                size = self._channel_sizes[index]
                inf = torch.full((size,), math.inf, dtype=F64, device=collector.device)
                got = torch.stack([inf, -inf, inf])
            blocks.append(got.to(F64))
        if not blocks:
            return None
        merged = torch.cat(blocks, 1)
        metric = self._extremes_metric
        if metric is None or metric.low.numel() != merged.shape[1]:
            metric = self._extremes_metric = ChannelExtremes.on(merged.shape[1], merged.device)
        metric.reset()
        metric.update(merged)
        return metric.compute()

    def _agree_channel_sizes(self, found: dict[int, Tensor]) -> None:
        """Under DDP, until every tracked stream's channel count is known: the counts over every
        rank (a collective on every rank), so that a rank whose module was not called yet lays
        out the same channels as the others (neutral values for its part)."""
        collector = cast(Collector, self._collector)
        tracked = sorted(collector.channels)
        known = self._channel_sizes
        local = [found[i].shape[1] if i in found else known.get(i, 0) for i in tracked]
        metric = ChannelCounts(len(tracked)).to(collector.device)
        metric.update(torch.tensor(local, dtype=F64))
        sizes = [int(n) for n in metric.compute().reshape(-1).tolist()]
        self._channel_sizes = {i: n for i, n in zip(tracked, sizes, strict=True) if n}
        self._sizes_agreed = all(sizes)

    def _tell(self, host: _HostValues, params: ParameterStats | None, stepped: list[str]) -> None:
        """Hand the listeners a :class:`StatsReport` of what was just logged (rank zero)."""
        if not self._listeners:
            return
        modules = tuple(self._streams)
        parameters: dict[str, dict[str, float]] = {}
        if params is not None and host.parameters:
            norm_of, stepped_of = params.values(stepped, host.parameters)
            for name, norm in norm_of.items():
                parameters[name] = {"norm": norm}
            for name, (grad, ratio) in stepped_of.items():
                parameters[name]["grad_norm"] = grad
                if ratio is not None:  # None: undefined (norm 0 before), or step skipped
                    parameters[name]["update_ratio"] = ratio
        channels: dict[str, np.ndarray] = {}
        if host.channels:
            table = np.asarray(host.channels, dtype=np.float64).reshape(3, -1)
            at = 0
            for index in sorted(self._channel_sizes):
                size = self._channel_sizes[index]
                channels[modules[index]] = table[:, at : at + size].copy()
                at += size
        histograms = None
        if host.histograms is not None:
            histograms = np.array(host.histograms, dtype=np.float64).reshape(len(modules), -1)
        numel = np.asarray(host.stats["numel"], dtype=np.float64)
        stats = {}
        for name, column in host.stats.items():
            values = np.asarray(column, dtype=np.float64)
            stats[name] = np.where(numel > 0, values, np.nan) if name != "numel" else values
        stage, loader = host.series
        report = StatsReport(
            stage, host.step, loader, modules, stats, parameters, channels, histograms
        )
        for listener in list(self._listeners):
            listener(report)

    def _stat_scalars(self, series: Series, values: list[float]) -> dict[str, float]:
        """The statistics by tag from the host values of :meth:`_stat_table`; modules that saw
        no element are left out."""
        k, m = len(self.stats), len(self._streams)
        found, numels = values[: m * k], values[m * k : m * k + m]
        tags = self._flat_tags(series, self.stats)
        if all(n > 0 for n in numels):  # the common case: every module called
            return dict(zip(tags, found, strict=True))
        scalars: dict[str, float] = {}
        for i, numel in enumerate(numels):
            if numel > 0:
                scalars.update(
                    zip(tags[i * k : (i + 1) * k], found[i * k : (i + 1) * k], strict=True)
                )
        return scalars

    def _host_table(self, series: Series, values: np.ndarray, width: int) -> HistogramTable:
        """The histograms of a host table (rows of ``width`` values, one a module), by tag."""
        return HistogramTable(
            values.reshape(-1, width), self.bins, self._flat_tags(series, _HISTOGRAM)
        )

    def _parameter_scalars(
        self, params: ParameterStats, stepped: list[str], values: list[float]
    ) -> dict[str, float]:
        norm_of, stepped_of = params.values(stepped, values)
        scalars = {self._tags("train", name, _NORM)[0]: v for name, v in norm_of.items()}
        for name, pair in stepped_of.items():
            for tag, value in zip(self._tags("train", name, _STEPPED), pair, strict=True):
                if value is not None:  # no ratio (undefined, or step skipped): not logged
                    scalars[tag] = value
        return scalars

    def _write(
        self,
        trainer: pl.Trainer,
        scalars: dict[str, float],
        hists: Mapping[str, dict[str, Any]],
        step: int,
    ) -> None:
        if not trainer.is_global_zero:
            return
        for logger in trainer.loggers:
            kept_scalars, kept_hists = scalars, hists
            allowed = self._logger_filter(logger)
            if allowed is not ALL:
                kept_scalars = {t: v for t, v in scalars.items() if _stat_of(t) in allowed}
                kept_hists = hists if "histogram" in allowed else {}
            if isinstance(logger, TensorBoardLogger):
                event = write_tensorboard(logger, kept_scalars, kept_hists, step)
                if event is not None and id(logger) not in self._checksums_checked:
                    self._checksums_checked.add(id(logger))  # the first event only
                    self._check_checksum(logger, event.ByteSize())
            elif isinstance(logger, WandbLogger):
                write_wandb(logger, kept_scalars, kept_hists, step)
            elif kept_scalars:
                logger.log_metrics(kept_scalars, step=step)

    def _check_checksum(self, logger: TensorBoardLogger, size: int) -> None:
        """Warn once when TensorBoard's own writer checksums the ``size`` bytes of a logged
        step's event in pure Python and that costs about 10 ms or more per logged step."""
        if size <= SLOW_CHECKSUM_BYTES or not checksummed_in_python(logger):
            return
        kib = size / 1024
        ms = kib * PURE_PYTHON_CHECKSUM_MS_PER_KIB
        rank_zero_warn(
            f"{self!r} writes {kib:.0f} KiB to TensorBoard per logged step through Lightning's "
            f"TensorBoardLogger, whose writer (TensorBoard's) checksums every record in pure "
            f"Python: up to about {ms:.0f} ms per logged step on its writer thread, holding the "
            "GIL the training step needs. lightning_recorder.TensorBoardLogger takes the same "
            "arguments, writes the same files and checksums in C with the google-crc32c wheel "
            '(pip install "lightning-recorder[fast-tensorboard]"); or log fewer values '
            "(`stats`, `logger_stats`, `histograms=False`) or less often (`every_n_steps`). "
            "Reported once.",
            category=PossibleUserWarning,
        )

    def _logger_filter(self, logger: Logger) -> frozenset[str]:
        """The statistics ``logger`` gets: those of ``logger_stats`` for its class (the most
        derived class named there), otherwise every one (:data:`ALL`)."""
        return stats_for(self.logger_stats, logger)

    # ------------------------------------------------------------------ evaluation epochs
    @override
    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start_eval("val")

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log_eval(trainer, "val")

    @override
    def on_test_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start_eval("test")

    @override
    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log_eval(trainer, "test")

    @override
    def on_predict_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._start_eval("predict")

    @override
    def on_predict_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log_eval(trainer, "predict")

    def _start_eval(self, stage: Stage) -> None:
        for series in [s for s in self._metrics if s[0] == stage]:
            del self._metrics[series]
        for series in [s for s in self._eval_tables if s[0] == stage]:
            del self._eval_tables[series]

    # ------------------------------------------------------------------ checkpointing
    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            **super().state_dict(),
            "logged_steps": self.logged_steps,
            "last_logged_step": self.last_logged_step,
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self.logged_steps = int(state_dict.get("logged_steps", self.logged_steps))
        self.last_logged_step = int(state_dict.get("last_logged_step", self.last_logged_step))

    def __repr__(self) -> str:
        sources = ", ".join(repr(item_key(s)) for s in self.sources)
        extra = "" if self.name is None else f", name={self.name!r}"
        return f"{type(self).__name__}([{sources}]{extra})"


def _channel_dim(dim: object, selector: Callable[..., Any], series: str) -> int | None:
    """What a ``track_channels`` selector returned (neither ``None`` nor ``False``) as the
    collector's channel dimension: ``None`` for ``True`` (the default dimension), else the int."""
    if dim is True:
        return None
    try:
        return operator.index(dim)  # type: ignore[arg-type]
    except TypeError:
        raise RecorderConfigError(
            f"Expected the `track_channels` selector {selector!r} to return True, False, None or "
            f"a dimension (an int) for {series!r} but got {type(dim).__name__} {dim!r}."
        ) from None


def _stat_of(tag: str) -> str:
    """The statistic a scalar tag ends with (before a ``/dataloader_idx_N`` suffix)."""
    head, _, last = tag.rpartition("/")
    return head.rpartition("/")[2] if last.startswith("dataloader_idx_") else last


def logger_stats_option(
    given: Mapping[str, Sequence[str]] | None,
    stats: tuple[str, ...],
    owner: str,
    histograms: bool = True,
    parameters: bool = True,
) -> dict[str, frozenset[str]]:
    """Validate ``logger_stats`` against the statistics the monitor computes (no
    ``"histogram"`` with ``histograms=False``, no parameter statistics with
    ``parameters=False``)."""
    computed = (
        *stats,
        *(PARAM_STATS if parameters else ()),
        *(("histogram",) if histograms else ()),
    )
    return logger_stats(given, computed, owner)
