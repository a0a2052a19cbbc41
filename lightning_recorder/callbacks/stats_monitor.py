"""`FeatureStatsMonitor`: feature, parameter and gradient statistics of chosen layers, logged."""

from __future__ import annotations

import ctypes
import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.loggers import Logger, TensorBoardLogger, WandbLogger
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn
from typing_extensions import override

from .._core.checks import check_bool, check_positive_int, suggestion
from .._core.compat import distributed_active, foreach_copy_, foreach_sub_, is_compiled
from .._core.names import named_parameters, select
from .._core.structures import iter_tensors, parse_path
from ..errors import RecorderConfigError, UnknownSourceError
from ..recorders import RecordStream
from ..stats import STAT_NAMES, StatName
from ..stats.batched import (
    HistogramRow,
    Workspace,
    change_norms,
    copy_with_norms,
    empty_state,
    finalize,
    flatten_segments,
    foreach_norms,
    fused_kernels,
    gather_merged,
    histogram_rows_cpu,
    histograms_device,
    host_floats,
    merge,
    merged,
    native_histogram_table,
    native_segmented_histograms,
    native_segmented_table,
    native_segments,
    native_state,
    raw_table,
    sample_of,
    sampled_row,
    segmented_histograms,
    segmented_states,
    upcast,
)
from ..stats.sharded import any_sharded, full_values, is_sharded, shard_for_stats
from ._lightning import (
    HistogramTable,
    Stage,
    histogram_loggers,
    logger_names,
    native_checksums,
    restore_checksums,
    step_axis,
    write_tensorboard,
    write_wandb,
)
from .recorder import RecorderCallback

__all__ = ["FeatureStatsMonitor"]

ModuleSource = str | type[nn.Module]

_DEFAULT_STATS: tuple[StatName, ...] = (
    "mean",
    "std",
    "min",
    "max",
    "abs_mean",
    "zero_fraction",
    "nonfinite",
)
_PARAM_STATS = ("norm", "grad_norm", "update_ratio")


class _Everything(frozenset[str]):
    """Every statistic: what a logger without a ``logger_stats`` entry gets."""

    def __contains__(self, item: object) -> bool:
        return True


_ALL: frozenset[str] = _Everything()


def _parameter_patterns(parameters: object, owner: str) -> tuple[str, ...] | None:
    """``None`` for ``parameters=True``/``False``, else the name patterns as a tuple."""
    if isinstance(parameters, bool):
        return None
    items = (parameters,) if isinstance(parameters, str) else parameters
    if (
        not isinstance(items, Sequence)
        or not items
        or not all(isinstance(p, str) and p for p in items)
    ):
        raise RecorderConfigError(
            f"Expected `parameters` of {owner} to be a bool, a parameter name or pattern, or a "
            f"non-empty list of them, but got {parameters!r}."
        )
    return tuple(items)


def _logger_stats(
    logger_stats: object, allowed: Sequence[str], owner: str
) -> dict[str, frozenset[str]]:
    """Validate ``logger_stats``: logger class name -> statistics that the monitor computes."""
    if logger_stats is None:
        return {}
    if not isinstance(logger_stats, Mapping):
        raise RecorderConfigError(
            f"Expected `logger_stats` of {owner} to be a mapping from logger class names to "
            f"statistics but got {logger_stats!r}."
        )
    found: dict[str, frozenset[str]] = {}
    for key, names in logger_stats.items():
        items = (names,) if isinstance(names, str) else names
        if not isinstance(key, str) or not key or not isinstance(items, Sequence):
            raise RecorderConfigError(
                f"Expected `logger_stats` of {owner} to map logger class names to lists of "
                f"statistics but got {key!r}: {names!r}."
            )
        for name in items:
            if name not in allowed:
                raise RecorderConfigError(
                    f"Expected `logger_stats[{key!r}]` of {owner} to hold only statistics the "
                    f"monitor computes ({', '.join(map(repr, allowed))}) but got {name!r}."
                )
        found[key] = frozenset(items)
    return found


def _source_key(source: ModuleSource) -> str:
    if isinstance(source, type):
        return f"{source.__module__}.{source.__qualname__}"
    return source


def _source_and_path(item: object, owner: str) -> tuple[ModuleSource, str | None]:
    """The source of one item of ``sources`` and its path in dotted form (``None`` without)."""
    if isinstance(item, Mapping):
        for key in item:
            if key not in ("source", "path"):
                raise RecorderConfigError(
                    f"Expected the keys of each dict of `sources` of {owner} to be 'source' and "
                    f"'path' but got {key!r}. {suggestion(str(key), ['source', 'path'], 'keys')}"
                )
        if "source" not in item:
            raise RecorderConfigError(
                f"Expected each dict of `sources` of {owner} to have a 'source' key (a module "
                f"name, glob pattern or module type) but got {dict(item)!r}."
            )
        source = item["source"]
        parsed = parse_path(item.get("path"))
        path = None if parsed is None else ".".join(str(k) for k in parsed)
    else:
        source, path = item, None
    if not isinstance(source, (str, type)) or source == "":
        raise RecorderConfigError(
            f"Expected each of `sources` of {owner} to be a module name, glob pattern or "
            f"module type, or a dict {{'source': ..., 'path': ...}}, but got {item!r}."
        )
    return source, path


def _item_key(item: object) -> str:
    """The key of one (validated) item of ``sources``: ``source`` or ``source/path``."""
    if isinstance(item, Mapping):
        parsed = parse_path(item.get("path"))
        key = _source_key(item["source"])
        return key if parsed is None else f"{key}/{'.'.join(str(k) for k in parsed)}"
    return _source_key(cast(ModuleSource, item))


def _record_tensors(stream: RecordStream) -> Iterator[Tensor]:
    """The real-valued tensors of every record of a stream (structured outputs flattened); of a
    ``DTensor``, the part this rank contributes (see ``stats.sharded.shard_for_stats``)."""
    for record in stream.data_buffer:
        for tensor in iter_tensors(record):
            if is_sharded(tensor):
                part = shard_for_stats(tensor)
                if part is None:
                    continue
                tensor = part
            if not tensor.is_complex():
                yield tensor


# The statistics of a parameter, and of a histogram, as tag suffixes (see FeatureStatsMonitor._tags)
_NORM, _STEPPED, _HISTOGRAM = ("norm",), ("grad_norm", "update_ratio"), ("histogram",)
# The name under which the tags of every module together are cached (no module's name: module
# names never hold a NUL; the root module's is "").
_EVERY = "\0every module"

# A step whose kept records (``exact_histograms``) exceed this many bytes warns once.
_RECORDS_WARN_BYTES = 256 * 2**20


# Outputs of at most _SMALL elements are copied in the hook and reduced at the batch's end, all
# modules at once (one flat buffer, a segment each); a module's copies are folded into a state
# and a sample once they exceed _SMALL_HELD elements.
_SMALL = 2**14
_SMALL_HELD = 2**16
_EMPTY = [0.0, 0.0, 0.0, math.inf, -math.inf, 0.0, 0.0, 0.0, 0.0]  # the state of no data


# Flat CPU tensors of a previous batch, by (numel, dtype), for the copies and samples of the next.
_Spare = dict[tuple[int, torch.dtype], list[Tensor]]


def _take(spare: _Spare | None, n: int, dtype: torch.dtype) -> Tensor:
    """A flat CPU tensor of ``n`` elements of ``dtype`` (contents undefined): a spare one if
    there is one."""
    if spare:
        kept = spare.get((n, dtype))
        if kept:
            return kept.pop()
    return torch.empty(n, dtype=dtype)


class _Pending:
    """What the monitor's hooks computed for one module in the current batch: copies of its
    small outputs, the packed state of each large one (host rows from the fused CPU kernel,
    tensors otherwise), and strided samples of the large ones for the histogram."""

    __slots__ = ("held", "rows", "samples", "small", "small_held", "states", "weights")

    def __init__(self) -> None:
        self.small: list[Tensor] = []
        self.small_held = 0
        self.rows: list[list[float]] = []
        self.states: list[Tensor] = []
        self.samples: list[Tensor] = []
        self.weights: list[float] = []
        self.held = 0  # elements in the samples

    def add(self, x: Tensor, work: Workspace, sample: int, spare: _Spare | None = None) -> None:
        # Small CPU outputs are copied and reduced together at the end of the batch; off the
        # CPU the segmented reduction would need the segment sizes on the device (a host
        # synchronisation), so every output is reduced where it is, as a large one.
        # (``x`` may require grad: the fast paths read its memory, the others detach it)
        n = x.numel()
        if n <= _SMALL and x.is_cpu:
            copy = _take(spare, n, x.dtype)
            if type(x) is Tensor and x.is_contiguous():  # a plain memory copy, no dispatch
                ctypes.memmove(copy.data_ptr(), x.data_ptr(), n * x.element_size())
            else:
                copy.copy_(x.detach().reshape(-1))
            self.small.append(copy)
            self.small_held += n
            if self.small_held > _SMALL_HELD:  # fold: memory stays bounded on long steps
                joined, self.small, self.small_held = torch.cat(self.small), [], 0
                self.add_large(joined, work, sample, spare)
            return
        self.add_large(x, work, sample, spare)

    def add_large(
        self, x: Tensor, work: Workspace, sample: int, spare: _Spare | None = None
    ) -> None:
        # float32 CPU data: state and sample in one pass of the fused kernel, the state kept as
        # a host row (one tensor for every module at the end of the batch)
        fused = None
        if x.is_cpu:
            fused = sampled_row(x, work, sample, lambda n: _take(spare, n, torch.float32))
        kept: Tensor | None = None
        if fused is not None:
            row, kept, weight = fused
            self.rows.append(row)
        else:  # the kernel does not take x (already asked above): torch's passes
            x = x.detach()
            if sample > 0:
                kept, weight = sample_of(x, sample)
            self.states.append(native_state(x, work))
        if len(self.states) + len(self.rows) >= 64:  # a module called many times (an RNN cell)
            self.states = [self.state(x.device)]
            self.rows = []
        if kept is None:
            return
        self.samples.append(kept)
        self.weights.append(weight)
        self.held += kept.numel()
        if self.held > 2 * sample:
            self._thin()

    def state(self, device: torch.device) -> Tensor:
        """The merged state of the large outputs (rows and tensors) on ``device``."""
        parts = [s if s.device == device else s.to(device) for s in self.states]
        if self.rows:
            parts.extend(torch.tensor(self.rows, dtype=torch.float64, device=device).unbind())
        return merged(parts) if parts else empty_state(device)

    def _thin(self) -> None:
        """Join the samples of equal weight (calls of one shape) and keep every second element:
        the samples stay below ``2 * sample`` elements, in few tensors, however many calls."""
        groups: dict[float, list[Tensor]] = {}
        for tensor, weight in zip(self.samples, self.weights, strict=True):
            groups.setdefault(weight, []).append(tensor)
        self.samples, self.weights = [], []
        for weight, tensors in groups.items():
            joined = torch.cat(tensors) if len(tensors) > 1 else tensors[0]
            half = joined[::2]
            kept = torch.empty(half.shape, dtype=half.dtype, device=half.device).copy_(half)
            self.samples.append(kept)
            self.weights.append(weight * joined.numel() / kept.numel())
        self.held = sum(t.numel() for t in self.samples)

    def recycle(self, spare: _Spare) -> None:
        """Give this batch's copies and samples (the monitor's own CPU tensors) to ``spare``:
        the next batch writes into them instead of allocating (and faulting in) new memory."""
        for tensor in self.small:  # flat CPU copies, by construction
            spare.setdefault((tensor.numel(), tensor.dtype), []).append(tensor)
        for tensor in self.samples:
            if tensor.device.type == "cpu" and tensor.dim() == 1:
                spare.setdefault((tensor.numel(), tensor.dtype), []).append(tensor)

    def nbytes(self) -> int:
        tensors = (*self.small, *self.states, *self.samples)
        return sum(t.numel() * t.element_size() for t in tensors) + 72 * len(self.rows)


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
    ``||Δp|| / ||p||`` of the optimizer step.

    **Precision.** On the CPU, the statistics and histogram buckets of float32 (float16,
    bfloat16) outputs are computed in float32, the data's own precision and the one TensorBoard
    stores: mean, std and mean ``|x|`` within about ``1e-6`` (relative), min, max and counts
    exact, a value within rounding of a bucket edge possibly in the next bucket. Float64 outputs
    and other devices get float64 arithmetic. :mod:`lightning_recorder.stats` gives exact
    float64 results.

    **When.** Training statistics are logged every ``every_n_steps`` optimizer steps (default:
    the Trainer's ``log_every_n_steps``, so they land on the same steps as the loss); with
    gradient accumulation they cover every micro-batch of the logged step, the histogram its
    last micro-batch. Nothing is recorded on the other steps, and the monitor's hooks are
    removed from the model until the next logged step (kept on a compiled model, see
    ``keep_hooks``), so those steps run as they would without it. Evaluation statistics cover every
    batch of the epoch (the histogram its first batch) and are logged at the epoch's end, on
    Lightning's step axis. Nothing is recorded or written during the sanity check.

    **Tags** are ``{prefix}/{stage}/{module}/{stat}`` (e.g. ``stats/train/features.0/mean``,
    ``stats/val/classifier/zero_fraction``), ``{prefix}/{stage}/{module}/histogram``, and
    ``{prefix}/train/{parameter}/norm`` (``grad_norm``, ``update_ratio``); see :meth:`tag`. A
    source with a ``path`` adds it, dotted, after the module:
    ``stats/train/bert/hidden_states.2/mean``.

    **Structured outputs.** Without a ``path``, the statistics of a module that returns a tuple,
    a dict or a ``ModelOutput`` mix every tensor in it (a BERT model's ``last_hidden_state``
    with its ``pooler_output`` and every hidden state). Give the source a path,
    ``{"source": "bert", "path": "last_hidden_state"}``, to follow one of them; two paths into
    one module are two series.

    **Across processes** every statistic is over the data of all ranks: the streaming state and
    the histograms are synchronised on every rank and rank 0 writes. Parameters and gradients
    are replicated under DDP, so their norms are computed locally.

    Args:
        sources: module names from ``named_modules()`` of the LightningModule (the root
            excluded; ``"net.layer1"`` when the network is ``self.net``), glob patterns such as
            ``"features.*"`` (``*`` crosses dots), ``"re:"`` regular expressions matching whole
            names, or module types (``torch.nn.Conv2d``, ``"torch.nn.Conv2d"``, ``"Conv2d"``, or
            the bare name of a class defined elsewhere, ``"BertLayer"``) — one, or a list.
            An item may be a dict ``{"source": ..., "path": ...}`` to follow a path into the
            module's output: a tuple index (``0``), a key or attribute (``"last_hidden_state"``),
            or a dotted chain of them (``"hidden_states.2"``), as the ``path`` of
            :class:`~lightning_recorder.RecorderCallback`.
        every_n_steps: log training statistics every N optimizer steps; ``None`` follows the
            Trainer's ``log_every_n_steps``.
        stages: the loops to monitor: any of ``"train"``, ``"val"``, ``"test"``, ``"predict"``.
        stats: the statistics to log (``"numel"`` too, if wanted).
        histograms: also write histograms to TensorBoard loggers.
        bins: the number of histogram buckets (30 by default, as TensorBoard's own histogram
            summary, ``tensorboard.summary.histogram``).
        parameters: also log the norms, gradient norms and update ratios of the parameters
            inside the monitored modules: ``True`` every one of them, a name, glob or ``"re:"``
            pattern (or a list of them, names as in ``named_parameters()`` of the LightningModule)
            those it selects among them, ``False`` none.
        prefix: the first component of every tag.
        clone: record a copy of each output. Needed only where records are kept
            (``exact_histograms=True``, or a compiled model) and the model modifies a
            monitored output in place (e.g. ``ReLU(inplace=True)`` right after it): there such a
            change raises :class:`~lightning_recorder.RecordModifiedError` rather than logging
            wrong values. By default the statistics are taken in the hook, before any later
            in-place op, and no copy is needed.
        name: distinguishes two monitors with the same configuration.
        keep_hooks: keep the hooks installed between logged steps (see
            :class:`~lightning_recorder.RecorderCallback`); ``None`` keeps them on a compiled
            model only.
        logger_stats: ``{logger class name: statistic names}``: a logger whose class (or a base
            class) is named here gets only those statistics (names from ``stats``, ``"norm"``,
            ``"grad_norm"``, ``"update_ratio"``, ``"histogram"``); other loggers get all.
            Keeps tabular loggers such as ``CSVLogger`` readable.
        exact_histograms: keep every output until the batch ends and histogram all of its
            elements exactly (see the attribute of that name); by default the statistics are
            taken in the forward hook and the histogram over a strided sample.
        histogram_sample: the number of elements sampled from each larger output for the
            approximate histogram (see the attribute of that name).
        fast_checksums: while the monitor is attached, the event files of the Trainer's
            TensorBoard loggers (``torch.utils.tensorboard`` writers) checksum their records with
            the package's C CRC-32C instead of TensorBoard's pure-Python one, which costs about
            0.24 ms per KiB written and holds the GIL the training thread needs; the bytes
            written are the same. Nothing changes where the C code cannot be built. ``False``
            leaves the writers alone.

    Raises:
        RecorderConfigError: an argument is invalid (at construction); the Trainer has no logger,
            or ``logger_stats`` names no logger of it (at setup); a source matches no module, or
            a ``parameters`` pattern no parameter of the monitored modules (at the start of the
            run, naming the closest names).

    Example:
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

    #: Keep every output until the batch ends and histogram all of its elements exactly (the
    #: statistics are the same). By default (``False``) the statistics of each output are
    #: computed in the forward hook, while the output is intact (no ``clone`` needed before an
    #: in-place op, nothing held on long steps), and the histogram is taken over a strided
    #: sample of at most :attr:`histogram_sample` elements of each output. Given to
    #: ``__init__``; it needs ``clone=True`` where an in-place op follows a monitored module.
    #: Compiled models always keep their records.
    exact_histograms: bool = False
    #: Elements sampled from each output of more than ``2**14`` elements for the approximate
    #: histogram (smaller outputs are histogrammed whole): each bucket's fraction has a
    #: standard error of at most ``0.5 / sqrt(n)`` for ``n`` sampled values (0.004 for the
    #: default), for data in no particular order; the count, sums and range are exact.
    histogram_sample: int = 2**14

    _in_hook: bool
    _pending: dict[str, _Pending]
    _stepped: list[str]
    _records_warned: bool
    _segments: tuple[str, Tensor, Tensor] | None
    _keys: dict[int, str]

    def __init__(
        self,
        sources: ModuleSource | Mapping[str, Any] | Sequence[ModuleSource | Mapping[str, Any]],
        every_n_steps: int | None = None,
        stages: Stage | Sequence[Stage] = ("train", "val"),
        stats: Sequence[StatName] = _DEFAULT_STATS,
        histograms: bool = True,
        bins: int = 30,
        parameters: bool | str | Sequence[str] = True,
        prefix: str = "stats",
        clone: bool = False,
        name: str | None = None,
        keep_hooks: bool | None = None,
        logger_stats: Mapping[str, Sequence[str]] | None = None,
        exact_histograms: bool = False,
        histogram_sample: int = 2**14,
        fast_checksums: bool = True,
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
            source, path = _source_and_path(item, owner)
            key = _source_key(source)
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
        valid_stats = ", ".join(map(repr, STAT_NAMES))
        if not isinstance(stats, (str, Sequence)) or isinstance(stats, bytes):
            raise RecorderConfigError(
                f"Expected `stats` of {owner} to be a non-empty list of {valid_stats} but got "
                f"{stats!r}."
            )
        if not stats:
            raise RecorderConfigError(
                f"Expected `stats` of {owner} to hold at least one of {valid_stats} but got "
                f"{stats!r}."
            )
        stat_names = [cast(StatName, stats)] if isinstance(stats, str) else list(stats)
        for stat in stat_names:
            if stat not in STAT_NAMES:
                raise RecorderConfigError(
                    f"Expected `stats` of {owner} to hold only {', '.join(map(repr, STAT_NAMES))} "
                    f"but got {stat!r}."
                )
        check_positive_int(bins, "bins", owner)
        check_bool(exact_histograms, "exact_histograms", owner)
        check_positive_int(histogram_sample, "histogram_sample", owner)
        check_bool(fast_checksums, "fast_checksums", owner)
        if not isinstance(histograms, bool):
            raise RecorderConfigError(
                f"Expected `histograms` of {owner} to be a bool but got {histograms!r}."
            )
        patterns = _parameter_patterns(parameters, owner)
        per_logger = _logger_stats(logger_stats, (*stat_names, *_PARAM_STATS, "histogram"), owner)
        if not isinstance(prefix, str) or not prefix or prefix.endswith("/"):
            raise RecorderConfigError(
                f"Expected `prefix` of {owner} to be a non-empty str without a trailing '/' but "
                f"got {prefix!r}."
            )
        super().__init__(
            configs, stages=stages, every_n_steps=every_n_steps, name=name, keep_hooks=keep_hooks
        )
        self.sources = list(items)
        self.exact_histograms = exact_histograms
        self.histogram_sample = histogram_sample
        self.fast_checksums = fast_checksums
        self._tag_cache: dict[tuple[str, str, tuple[str, ...]], tuple[str, ...]] = {}
        # id of each TensorBoard logger written to -> the record writer given the C checksum
        self._checksummed: dict[int, Any] = {}
        self.stats: tuple[StatName, ...] = tuple(dict.fromkeys(stat_names))
        self.histograms = histograms
        self.bins = bins
        self.parameters = parameters
        self._param_patterns = patterns
        self.logger_stats = per_logger
        self.prefix = prefix
        self.clone = clone
        #: Training steps whose statistics were logged, and the step axis value of the last one.
        self.logged_steps = 0
        self.last_logged_step = -1
        self._write_histograms = False
        self._warned = False
        self._streams: dict[str, RecordStream] = {}
        self._keys = {}
        self._work: Workspace | None = None
        # Per stage, the packed streaming states of the monitored modules, one row each.
        self._states: dict[Stage, Tensor] = {}
        self._params: dict[str, nn.Parameter] = {}
        self._before: dict[str, Tensor] = {}
        self._grad_norms: dict[str, Tensor | float] = {}  # floats from the fused CPU kernel
        self._before_squares: dict[str, float] = {}  # squared norms taken with the copies
        self._sharded = False  # monitored parameters are DTensors (norms are collectives)
        self._eval_hists: Mapping[str, dict[str, Any]] | None = None

    def tag(self, stage: Stage, name: str, stat: str) -> str:
        """The tag of statistic ``stat`` of module or parameter ``name`` in ``stage``."""
        return f"{self.prefix}/{stage}/{name}/{stat}"

    def _tags(self, stage: Stage, name: str, stats: tuple[str, ...]) -> tuple[str, ...]:
        """:meth:`tag` of each of ``stats`` (cached: every logged step writes the same tags)."""
        key = (stage, name, stats)
        tags = self._tag_cache.get(key)
        if tags is None:
            tags = self._tag_cache[key] = tuple(self.tag(stage, name, stat) for stat in stats)
        return tags

    @override
    def _make_state_key(self) -> str:
        if self.name is not None:
            return self._generate_state_key(name=self.name)
        return self._generate_state_key(
            sources=[_item_key(s) for s in self.sources],
            stages=self.stages,
            every_n_steps=self.every_n_steps,
            prefix=self.prefix,
        )

    # ------------------------------------------------------------------ lifecycle
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if not trainer.loggers:
            raise RecorderConfigError(
                f"Expected the Trainer to have a logger for {self!r} to write to, but it has "
                "none (logger=False); pass a logger such as TensorBoardLogger."
            )
        present = set().union(*(logger_names(lg) for lg in trainer.loggers))
        for key in self.logger_stats:
            if key not in present:
                shown = sorted(type(lg).__name__ for lg in trainer.loggers)
                raise RecorderConfigError(
                    f"Expected the keys of `logger_stats` of {type(self).__name__} to name logger "
                    f"classes of the Trainer but got {key!r}. "
                    f"{suggestion(key, shown, 'logger classes')}"
                )
        able, others = histogram_loggers(trainer.loggers)
        wanted = [lg for lg in able if "histogram" in self._logger_filter(lg)]
        self._write_histograms = self.histograms and bool(wanted)
        if self.histograms and others and not self._warned:
            self._warned = True
            names = [type(lg).__name__ for lg in others]
            verb = "gets" if len(names) == 1 else "get"
            listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
            rank_zero_warn(
                f"{type(self).__name__} writes histograms to TensorBoard and W&B loggers only; "
                f"{listed} {verb} the scalar statistics. Pass histograms=False to silence this "
                "warning."
            )

    @override
    def _on_attach(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # One stream per key: the module name, then "/" and the dotted path if there is one
        # (two paths into one module are two series; a second recorder of a key is not counted).
        streams: dict[str, RecordStream] = {}
        for recorder_name, stream in self.manager.streams():
            path = self._paths.get(recorder_name)
            streams.setdefault(stream.name if path is None else f"{stream.name}/{path}", stream)
        self._streams = streams
        self._tag_cache.clear()  # the cached tags of every module follow these streams
        self._keys = {id(stream): key for key, stream in streams.items()}
        self._work = Workspace()
        self._spare: _Spare = {}
        if pl_module.device.type == "cpu":
            fused_kernels()  # built (once, cached on disk) now rather than in a logged step
        self._states = {}
        self._stepped, self._before, self._grad_norms = [], {}, {}
        self._before_squares = {}
        self._records_warned = getattr(self, "_records_warned", False)
        self._segments = None
        # The statistics in the hook: each recorder's capture is the monitor's.
        self._in_hook = not (self.exact_histograms or is_compiled(pl_module))
        self._pending = {name: _Pending() for name in streams} if self._in_hook else {}
        if self._in_hook:
            for name in dict.fromkeys(name for name, _ in self.manager.streams()):
                # an instance attribute shadows the method for this recorder only
                recorder = self.manager.get_recorder(name)
                recorder.capture = self._capture  # type: ignore[method-assign]
        if self.parameters is not False and "train" in self.stages:
            prefixes = tuple(dict.fromkeys(s.name + "." for s in streams.values()))
            inside = {
                name: param
                for name, param in named_parameters(pl_module).items()
                if name.startswith(prefixes)
            }
            if self._param_patterns is not None:
                chosen: set[str] = set()
                for pattern in self._param_patterns:
                    try:
                        chosen.update(select(inside, pattern, "parameter"))
                    except UnknownSourceError as err:
                        raise UnknownSourceError(
                            f"`parameters` of {type(self).__name__} selects among the parameters "
                            f"of the monitored modules: {err}"
                        ) from None
                inside = {name: param for name, param in inside.items() if name in chosen}
            self._params = inside
        self._sharded = any_sharded(self._params.values())  # FSDP2 / tensor parallel

    @override
    def _on_detach(self) -> None:
        self._streams, self._states, self._params, self._work = {}, {}, {}, None
        self._sharded = False
        self._before, self._grad_norms, self._eval_hists = {}, {}, None
        self._before_squares = {}
        self._pending, self._stepped, self._keys = {}, [], {}
        for record_writer in self._checksummed.values():
            if record_writer is not None:
                restore_checksums(record_writer)
        self._checksummed = {}

    def _capture(self, stream: RecordStream, value: Any) -> None:
        """The recorders' capture while the statistics are computed in the hook: the packed
        state of each real tensor of ``value`` (and a sample of it for a histogram written from
        this batch), taken now, before a later in-place op can change it; nothing else kept."""
        stream.num_calls += 1
        key = self._keys.get(id(stream))
        pending = None if key is None else self._pending.get(key)
        if pending is None:
            return  # a second recorder matching the same module (and path): counted once
        work = cast(Workspace, self._work)
        wanted = self._write_histograms and (self._active == "train" or self._eval_hists is None)
        sample = self.histogram_sample if wanted else 0
        if type(value) is Tensor:  # the common case: one plain tensor (nothing records a graph)
            if not value.is_complex():
                pending.add(value, work, sample, self._spare)
            return
        with torch.no_grad():
            for tensor in iter_tensors(value):
                if is_sharded(tensor):  # a DTensor: the part this rank contributes
                    part = shard_for_stats(tensor)
                    if part is None:
                        continue
                    tensor = part
                if not tensor.is_complex():
                    pending.add(tensor.detach(), work, sample, self._spare)

    def _held_bytes(self) -> int:
        """Bytes of the tensors the monitor holds for the current batch (records or states)."""
        held = sum(p.nbytes() for p in self._pending.values())
        for stream in self._streams.values():
            for record in stream._records:
                held += sum(t.numel() * t.element_size() for t in iter_tensors(record))
        return held

    # ------------------------------------------------------------------ statistics
    @override
    def _after_batch(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: Stage, completes: bool
    ) -> None:
        device = pl_module.device
        parts: list[list[Tensor]] = []
        rows: list[Tensor] = []
        weights: list[list[float]] | None = None
        self._segments = None
        if self._in_hook:
            pendings = list(self._pending.values())
            self._pending = {name: _Pending() for name in self._pending}
            batch, parts, weights = self._hook_states(pendings, device)
            spare: _Spare = {}  # this batch's buffers serve the next one (after they are read)
            for pending in pendings:
                pending.recycle(spare)
        else:
            work = cast(Workspace, self._work)
            for stream in self._streams.values():
                tensors = list(_record_tensors(stream))
                states = [native_state(t, work) for t in tensors]
                rows.append(merged(states) if states else empty_state(device))
                parts.append(tensors)
            self._check_records_size(parts)
            batch = torch.stack([row if row.device == device else row.to(device) for row in rows])
        so_far = self._states.get(stage)
        self._states[stage] = batch if so_far is None else merge(torch.stack([so_far, batch]))
        if stage == "train":
            if completes:
                self._log_train(trainer, parts, batch, weights)
        elif self._eval_hists is None:  # the first batch of the evaluation epoch
            self._eval_hists = self._histograms(trainer, stage, parts, batch, weights)
        if self._in_hook:
            self._spare = spare

    def _hook_states(
        self, pendings: list[_Pending], device: torch.device
    ) -> tuple[Tensor, list[list[Tensor]], list[list[float]]]:
        """The ``(modules, 9)`` states of a batch from what the hooks kept, and the tensors and
        weights of its histograms. The small copies of every module are reduced together
        (:func:`segmented_states`); when no module has a large output, their histograms are
        too (``self._segments``, read by :meth:`_histogram_table`)."""
        m = len(pendings)
        batch: Tensor | None = None
        if any(p.small for p in pendings):
            fused = None
            if device.type == "cpu":  # the states stay where the kernel wrote them
                small = [p.small for p in pendings]
                fused = native_segments(small, [p.small_held for p in pendings])
            if fused is not None:  # float32 on the CPU: one kernel call for every module
                values, offsets, batch = fused
                segments: tuple[str, Tensor, Tensor] = ("native", values, offsets)
            else:
                values, seg = flatten_segments([p.small for p in pendings], device)
                batch = segmented_states(values, seg, m)
                segments = ("torch", values, seg)
            if not any(p.samples for p in pendings):
                self._segments = segments
        large: Tensor | None = None
        if any(p.states for p in pendings):
            large = torch.stack([p.state(device) for p in pendings])
        elif any(p.rows for p in pendings):  # host rows only: one tensor for every module
            rows = [
                p.rows[0] if len(p.rows) == 1 else p.state(device).tolist() if p.rows else _EMPTY
                for p in pendings
            ]
            large = torch.tensor(rows, dtype=torch.float64, device=device)
        if large is not None and batch is not None:  # small and large outputs: both states
            small_only = [bool(p.small) and not (p.rows or p.states) for p in pendings]
            if any(bool(p.small) and bool(p.rows or p.states) for p in pendings):
                batch = merge(torch.stack([batch, large]))
            else:  # no module has both: each row is one of the two (merging with no data)
                pick = torch.tensor(small_only, device=device)[:, None]
                batch = torch.where(pick, batch, large)
        elif large is not None:
            batch = large
        if batch is None:
            batch = empty_state(device).repeat(m, 1)
        parts = [[*p.small, *p.samples] for p in pendings]
        weights = [[1.0] * len(p.small) + p.weights for p in pendings]
        return batch, parts, weights

    def _check_records_size(self, parts: list[list[Tensor]]) -> None:
        """Warn once when a batch's kept records exceed ``_RECORDS_WARN_BYTES``."""
        if self._records_warned:
            return
        held = sum(t.numel() * t.element_size() for tensors in parts for t in tensors)
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
        # Sharded parameters: their norms are collectives, so every rank computes them.
        if self._active != "train" or not (trainer.is_global_zero or self._sharded):
            return
        names = [
            n for n, p in self._params.items() if p.grad is not None and n not in self._grad_norms
        ]
        if not names:
            return
        with torch.no_grad():
            grads = [cast(Tensor, self._params[name].grad) for name in names]
            # persistent buffers (float32 at least), allocated on the first logged step only
            for name in names:
                param = self._params[name]
                buffer = self._before.get(name)
                if buffer is None or buffer.shape != param.shape or buffer.device != param.device:
                    dtype = param.dtype if param.dtype == torch.float64 else torch.float32
                    self._before[name] = torch.empty_like(param, dtype=dtype)
            buffers = [self._before[n] for n in names]
            params: list[Tensor] = [self._params[n] for n in names]
            # float32 CPU parameters: copy, parameter norm and gradient norm in one pass
            fused = None if self._sharded else copy_with_norms(buffers, params, grads)
            if fused is not None:
                sizes, grad_squares = fused
                self._before_squares.update(zip(names, sizes, strict=True))
                self._grad_norms.update(zip(names, map(math.sqrt, grad_squares), strict=True))
            else:
                norms = foreach_norms(grads)
                if self._sharded:
                    norms = full_values(norms)  # collectives, on every rank in the same order
                self._grad_norms.update(zip(names, norms, strict=True))
                if self._sharded:  # DTensor has no sharding rule for the foreach copy
                    for dst, src in zip(buffers, params, strict=True):
                        dst.copy_(src)
                else:
                    foreach_copy_(buffers, params)
            self._stepped.extend(names)

    def _histogram_table(
        self, parts: list[list[Tensor]], states: Tensor, weights: list[list[float]] | None = None
    ) -> Tensor | list[HistogramRow] | None:
        """The histograms of this batch's records (a collective under DDP): rows on the host from
        CPU data, one table still on the device otherwise (nothing read yet); ``None`` without
        histograms to write."""
        if not self._write_histograms:
            return None
        segments, self._segments = self._segments, None
        if segments is not None:  # every output small: one segmented pass for every module
            kind, values, index = segments
            if kind == "native" and not distributed_active(None):
                return native_segmented_table(values, index, states, self.bins)
            count = native_segmented_histograms if kind == "native" else segmented_histograms
            return raw_table(*count(values, index, states, self.bins, sync=True, group=None))
        # every rank; buckets in the data's precision, like the statistics
        if states.device.type == "cpu":
            if not distributed_active(None):  # one process: every module in one kernel call
                found = native_histogram_table(parts, states, self.bins, weights)
                if found is not None:
                    return found
            work = cast(Workspace, self._work)
            return histogram_rows_cpu(
                parts,
                states,
                self.bins,
                sync=True,
                group=None,
                work=work,
                exact=False,
                weights=weights,
            )
        return raw_table(
            *histograms_device(parts, states, self.bins, sync=True, group=None, weights=weights)
        )

    def _histograms(
        self,
        trainer: pl.Trainer,
        stage: Stage,
        parts: list[list[Tensor]],
        states: Tensor,
        weights: list[list[float]] | None = None,
    ) -> Mapping[str, dict[str, Any]]:
        """TensorBoard histograms of this batch's records (a collective under DDP)."""
        table = self._histogram_table(parts, states, weights)
        if table is None or not trainer.is_global_zero:
            return {}
        if isinstance(table, Tensor):
            if table.is_cpu:
                return self._host_table(stage, table)
            table = [HistogramRow.from_flat(row, self.bins) for row in table.tolist()]
        return self._histogram_kwargs(stage, table)

    def _host_table(self, stage: Stage, table: Tensor) -> HistogramTable:
        """The histograms of a host table of :func:`raw_table` rows, one a module, by tag."""
        key = (stage, _EVERY, _HISTOGRAM)  # every module's histogram tag, cached
        tags = self._tag_cache.get(key)
        if tags is None:
            tags = tuple(self._tags(stage, module, _HISTOGRAM)[0] for module in self._streams)
            self._tag_cache[key] = tags
        return HistogramTable(table.to(torch.float64).contiguous(), self.bins, tags)

    def _histogram_kwargs(
        self, stage: Stage, rows: list[HistogramRow]
    ) -> dict[str, dict[str, Any]]:
        """``add_histogram_raw`` keyword arguments by tag, from the host rows of the histograms."""
        hists: dict[str, dict[str, Any]] = {}
        for module, row in zip(self._streams, rows, strict=True):
            kwargs = row.raw_kwargs()
            if kwargs is not None:
                hists[self._tags(stage, module, _HISTOGRAM)[0]] = kwargs
        return hists

    def _gathered(self, trainer: pl.Trainer, stage: Stage) -> Tensor:
        """The ``(modules, 9)`` streaming states of ``stage`` over every rank, reset (a
        collective under DDP); still on the device."""
        state = self._states.pop(stage, None)
        if state is None:
            state = empty_state(trainer.lightning_module.device).repeat(len(self._streams), 1)
        return gather_merged(state)  # one gather for every module, on every rank

    def _compute(self, trainer: pl.Trainer, stage: Stage) -> dict[str, float]:
        """The statistics of ``stage`` by tag, reset; a collective under DDP, empty off rank 0.

        Modules that saw no element (not called) are left out.
        """
        state = self._gathered(trainer, stage)
        if not trainer.is_global_zero:
            return {}
        return self._stat_scalars(stage, host_floats(self._stat_table(state)))

    def _stat_table(self, state: Tensor) -> list[Tensor]:
        """The statistics of the ``(modules, 9)`` states where they are: a ``(modules, k)``
        tensor of :attr:`stats` (module by module), then the ``(modules,)`` element counts."""
        columns = finalize(state, correction=1)
        return [torch.stack([columns[stat] for stat in self.stats], 1), columns["numel"]]

    def _stat_scalars(self, stage: Stage, values: list[float]) -> dict[str, float]:
        """The statistics by tag from the host values of :meth:`_stat_table`; modules that saw
        no element are left out."""
        k, m = len(self.stats), len(self._streams)
        found, numels = values[: m * k], values[m * k : m * k + m]
        tags = self._flat_tags(stage)
        if all(n > 0 for n in numels):  # the common case: every module called
            return dict(zip(tags, found, strict=True))
        scalars: dict[str, float] = {}
        for i, numel in enumerate(numels):
            if numel > 0:
                scalars.update(
                    zip(tags[i * k : (i + 1) * k], found[i * k : (i + 1) * k], strict=True)
                )
        return scalars

    def _flat_tags(self, stage: Stage) -> tuple[str, ...]:
        """The tags of every module's statistics in ``stage``, module by module (cached)."""
        key = (stage, _EVERY, self.stats)  # every module's tags, cached
        tags = self._tag_cache.get(key)
        if tags is None:
            tags = tuple(
                t for module in self._streams for t in self._tags(stage, module, self.stats)
            )
            self._tag_cache[key] = tags
        return tags

    def _parameter_tensors(self) -> tuple[list[str], list[Tensor]]:
        """The names of the stepped parameters, and the tensors of :meth:`_parameter_scalars`
        (still on the device; one tensor from the fused CPU kernels' floats): the norm of every
        monitored parameter, then of each stepped one's value before the step and its change,
        then its gradient norm."""
        stepped = list(dict.fromkeys(self._stepped))
        before = [self._before[name] for name in stepped]
        grad_norms = [self._grad_norms[name] for name in stepped]
        if stepped and all(name in self._before_squares for name in stepped):
            fused = change_norms([self._params[name] for name in stepped], before)
            if fused is not None:  # one pass over each parameter and its copy, nothing written
                changes, after = fused
                norm_of = {n: math.sqrt(v) for n, v in zip(stepped, after, strict=True)}
                others = [name for name in self._params if name not in norm_of]
                if others:  # parameters without a gradient this step
                    with torch.no_grad():
                        rest = torch.stack(foreach_norms([self._params[n] for n in others]))
                    norm_of.update(zip(others, rest.tolist(), strict=True))
                sizes = [math.sqrt(self._before_squares[name]) for name in stepped]
                values = torch.tensor(
                    [
                        *(norm_of[name] for name in self._params),
                        *sizes,
                        *map(math.sqrt, changes),
                        *cast(list[float], grad_norms),  # floats: the fused kernel's
                    ],
                    dtype=torch.float64,
                )
                return stepped, [values]
        with torch.no_grad():  # two foreach norms, one in-place foreach difference
            norms = foreach_norms([*self._params.values(), *before])
            foreach_sub_(before, upcast([self._params[name] for name in stepped]))
            norms = [*norms, *foreach_norms(before)]  # ||before - after|| = ||change||
            if self._sharded:
                norms = full_values(norms)  # collectives, on every rank in the same order
        as_tensors = [g if isinstance(g, Tensor) else torch.tensor(g) for g in grad_norms]
        return stepped, [*norms, *as_tensors]

    def _parameter_scalars(self, stepped: list[str], values: list[float]) -> dict[str, float]:
        """Norms of the monitored parameters; gradient norms and update ratios of those stepped,
        from the host values of :meth:`_parameter_tensors`."""
        names = list(self._params)
        k, n = len(names), len(stepped)
        sizes, changes, grad_norms = (
            values[k : k + n],
            values[k + n : k + 2 * n],
            values[k + 2 * n :],
        )
        scalars = {
            self._tags("train", name, _NORM)[0]: value
            for name, value in zip(names, values[:k], strict=True)
        }
        for name, size, delta, grad in zip(stepped, sizes, changes, grad_norms, strict=True):
            grad_tag, ratio_tag = self._tags("train", name, _STEPPED)
            scalars[grad_tag] = grad
            scalars[ratio_tag] = delta / (size + 1e-12)
        return scalars

    def _log_train(
        self,
        trainer: pl.Trainer,
        parts: list[list[Tensor]],
        batch: Tensor,
        weights: list[list[float]] | None = None,
    ) -> None:
        """Log a training step: its histograms, statistics and parameter norms reach the host in
        one copy (the collectives under DDP run first, on every rank)."""
        step = step_axis(trainer)
        table = self._histogram_table(parts, batch, weights)
        state = self._gathered(trainer, "train")
        scalars: dict[str, float] = {}
        hists: Mapping[str, dict[str, Any]] = {}
        sharded_norms = self._parameter_tensors() if self._params and self._sharded else None
        if trainer.is_global_zero:
            if sharded_norms is not None:
                stepped, norms = sharded_norms
            else:
                stepped, norms = self._parameter_tensors() if self._params else ([], [])
            if isinstance(table, Tensor) and table.is_cpu:
                hists, table = self._host_table("train", table), None
            on_device = [table] if isinstance(table, Tensor) else []
            stat_table = self._stat_table(state)
            values = host_floats([*on_device, *stat_table, *norms])  # the step's one host copy
            at = 0
            if isinstance(table, Tensor):
                width = table.shape[1]
                at = table.numel()
                table = [
                    HistogramRow.from_flat(values[i : i + width], self.bins)
                    for i in range(0, at, width)
                ]
            if table is not None:
                hists = self._histogram_kwargs("train", table)
            scalars = self._stat_scalars("train", values[at:])
            if self._params:
                after = at + sum(t.numel() for t in stat_table)
                scalars.update(self._parameter_scalars(stepped, values[after:]))
        # the buffers in _before are kept
        self._stepped, self._grad_norms, self._before_squares = [], {}, {}
        self._write(trainer, scalars, hists, step)

        self.logged_steps += 1
        self.last_logged_step = step

    def _log_eval(self, trainer: pl.Trainer, stage: Stage) -> None:
        if stage not in self.stages or self._manager is None or trainer.sanity_checking:
            return
        scalars = self._compute(trainer, stage)
        hists, self._eval_hists = self._eval_hists if self._eval_hists is not None else {}, None
        self._write(trainer, scalars, hists, step_axis(trainer))

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
            if allowed is not _ALL:
                kept_scalars = {t: v for t, v in scalars.items() if t.rsplit("/", 1)[1] in allowed}
                kept_hists = hists if "histogram" in allowed else {}
            if isinstance(logger, TensorBoardLogger):
                if self.fast_checksums and id(logger) not in self._checksummed:
                    self._checksummed[id(logger)] = native_checksums(logger)
                write_tensorboard(logger, kept_scalars, kept_hists, step)
            elif isinstance(logger, WandbLogger):
                write_wandb(logger, kept_scalars, kept_hists, step)
            elif kept_scalars:
                logger.log_metrics(kept_scalars, step=step)

    def _logger_filter(self, logger: Logger) -> frozenset[str]:
        """The statistics ``logger`` gets: those of ``logger_stats`` for its class (the most
        derived class named there), otherwise every one (:data:`_ALL`)."""
        for cls in type(logger).__mro__:
            found = self.logger_stats.get(cls.__name__)
            if found is not None:
                return found
        return _ALL

    # ------------------------------------------------------------------ evaluation epochs
    @override
    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval_hists = None

    @override
    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log_eval(trainer, "val")

    @override
    def on_test_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval_hists = None

    @override
    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log_eval(trainer, "test")

    @override
    def on_predict_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._eval_hists = None

    @override
    def on_predict_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log_eval(trainer, "predict")

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
        sources = ", ".join(repr(_item_key(s)) for s in self.sources)
        extra = "" if self.name is None else f", name={self.name!r}"
        return f"{type(self).__name__}([{sources}]{extra})"
