"""The options of :class:`~lightning_recorder.FeatureStatsMonitor`: validation and names.

Each check raises :class:`~lightning_recorder.errors.RecorderConfigError` at construction,
naming the option, what was given and what would be right.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import cast

from torch import Tensor, nn

from .._core.checks import listing, suggestion
from .._core.names import check_regex, is_glob
from .._core.structures import iter_tensors, parse_path
from ..errors import RecorderConfigError
from ..recorders import RecordStream
from ..stats import STAT_NAMES, StatName
from ..stats.sharded import is_sharded, shard_for_stats

ModuleSource = str | type[nn.Module]

DEFAULT_STATS: tuple[StatName, ...] = (
    "mean",
    "std",
    "min",
    "max",
    "abs_mean",
    "zero_fraction",
    "nonfinite",
)
PARAM_STATS = ("norm", "grad_norm", "update_ratio")


class Everything(frozenset[str]):
    """Every statistic: what a logger without a ``logger_stats`` entry gets."""

    def __contains__(self, item: object) -> bool:
        return True


ALL: frozenset[str] = Everything()


def parameter_patterns(parameters: object, owner: str) -> tuple[str, ...] | None:
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
    for pattern in items:
        check_regex(pattern)
    return tuple(items)


def unmonitored_parameters(pattern: str, names: Sequence[str], owner: str) -> str:
    """The message for an entry of ``parameters`` that selects no parameter of the monitored
    modules but ``names``, parameters of modules that are not monitored: whose they are, and
    what would be right (monitor those modules, or drop the entry)."""
    shown = 5
    owners = list(dict.fromkeys(name.rpartition(".")[0] for name in names))
    of = listing([repr(m) if m else "the LightningModule itself" for m in owners], shown)
    head = f"`parameters` of {owner} selects among the parameters of the monitored modules, but "
    if is_glob(pattern):
        listed = listing([repr(name) for name in names], shown)
        head += (
            f"the pattern {pattern!r} matches only parameters of modules that are not monitored: "
            f"{listed} (of {of})."
        )
    else:
        head += f"{pattern!r} is a parameter of {of}, which is not monitored."
    modules = [m for m in owners if m]
    if not modules:  # parameters of the LightningModule itself: no source names the root
        return (
            f"{head} No source can name the LightningModule itself; leave {pattern!r} out of "
            "`parameters`."
        )
    added = ", ".join(map(repr, modules[:shown])) + (" and more" if len(modules) > shown else "")
    return (
        f"{head} Add {added} to `sources` to get {'its' if len(names) == 1 else 'their'} "
        f"statistics, or leave {pattern!r} out of `parameters`."
    )


def logger_stats(
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


def stats_for(per_logger: Mapping[str, frozenset[str]], logger: object) -> frozenset[str]:
    """The statistics ``logger`` gets under a validated ``logger_stats`` (:func:`logger_stats`):
    those of the most derived of its classes named there, otherwise every one (:data:`ALL`)."""
    for cls in type(logger).__mro__:
        found = per_logger.get(cls.__name__)
        if found is not None:
            return found
    return ALL


def source_key(source: ModuleSource) -> str:
    if isinstance(source, type):
        return f"{source.__module__}.{source.__qualname__}"
    return source


def source_and_path(item: object, owner: str) -> tuple[ModuleSource, str | None]:
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


def item_key(item: object) -> str:
    """The key of one (validated) item of ``sources``: ``source`` or ``source/path``."""
    if isinstance(item, Mapping):
        parsed = parse_path(item.get("path"))
        key = source_key(item["source"])
        return key if parsed is None else f"{key}/{'.'.join(str(k) for k in parsed)}"
    return source_key(cast(ModuleSource, item))


def stat_names(stats: object, owner: str) -> tuple[StatName, ...]:
    """Validate ``stats``: a non-empty list of names from ``STAT_NAMES`` (order kept, no
    repeats)."""
    valid = ", ".join(map(repr, STAT_NAMES))
    if not isinstance(stats, (str, Sequence)) or isinstance(stats, bytes):
        raise RecorderConfigError(
            f"Expected `stats` of {owner} to be a non-empty list of {valid} but got {stats!r}."
        )
    if not stats:
        raise RecorderConfigError(
            f"Expected `stats` of {owner} to hold at least one of {valid} but got {stats!r}."
        )
    names = [cast(StatName, stats)] if isinstance(stats, str) else list(stats)
    for stat in names:
        if stat not in STAT_NAMES:
            raise RecorderConfigError(
                f"Expected `stats` of {owner} to hold only {valid} but got {stat!r}."
            )
    return tuple(dict.fromkeys(names))


def value_tensors(
    value: object, complex_seen: Callable[[Tensor], None] | None = None
) -> Iterator[Tensor]:
    """The real-valued tensors of a recorded value (structured outputs flattened); of a
    ``DTensor``, the part this rank contributes (see ``stats.sharded.shard_for_stats``). Each
    complex tensor left out is handed to ``complex_seen``."""
    for tensor in iter_tensors(value):
        if is_sharded(tensor):
            part = shard_for_stats(tensor)
            if part is None:
                continue
            tensor = part
        if not tensor.is_complex():
            yield tensor
        elif complex_seen is not None:
            complex_seen(tensor)


def record_tensors(
    stream: RecordStream, complex_seen: Callable[[Tensor], None] | None = None
) -> Iterator[Tensor]:
    """The real-valued tensors of every record of a stream (:func:`value_tensors` of each)."""
    for record in stream.data_buffer:
        yield from value_tensors(record, complex_seen)
