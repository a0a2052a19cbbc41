"""`ActivationDataset`: the rows of an activation directory as a map-style torch Dataset."""

from __future__ import annotations

import numbers
import os
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from .._core.checks import closest_hint
from ..errors import NoRecordError, RecorderConfigError
from ._format import (
    INDEX_SUFFIX,
    SHARD_SUFFIX,
    Storage,
    as_index,
    iter_index,
    require_safetensors,
)

# Each filter of ActivationDataset and the provenance field it keeps rows by.
_FIELDS = {
    "runs": "run",
    "stages": "stage",
    "steps": "global_step",
    "epochs": "epoch",
    "ranks": "rank",
    "modules": "module",
    "sources": "source",
    "calls": "call",
    "dataloaders": "dataloader_idx",
}
_FILTERS = tuple(_FIELDS)
# The provenance fields of an item that its chunk holds (one value for all its rows).
_CHUNK_FIELDS = (
    "run",
    "stage",
    "global_step",
    "epoch",
    "batch_idx",
    "dataloader_idx",
    "rank",
    "source",
    "module",
    "call",
)


class _Shard:
    """The tensors of one shard, read by safetensors: memory-mapped (local; a tensor is a
    private copy-on-write view of the file's pages, read when touched) or from its bytes."""

    def __init__(self, storage: Storage, name: str) -> None:
        from safetensors import SafetensorError, safe_open  # imported when first read
        from safetensors.torch import load

        self._where = storage.join(name)
        self._cache: dict[str, torch.Tensor] = {}
        try:
            if storage.local:
                self._file: Any = safe_open(storage.join(name), framework="pt")
                self._keys = set(self._file.keys())
            else:  # every tensor of a remote shard is loaded
                self._file = None
                self._cache = load(storage.read(name))
                self._keys = set(self._cache)
        except (OSError, SafetensorError) as err:
            raise RecorderConfigError(
                f"Expected {storage.join(name)} to be a complete activation shard (safetensors) "
                f"but it cannot be read ({type(err).__name__}: {err}): it is missing, truncated "
                "or damaged. Restore it, or remove it and its index file to leave it out."
            ) from None

    def tensor(self, key: str) -> torch.Tensor:
        found = self._cache.get(key)
        if found is None:
            if key not in self._keys:
                raise RecorderConfigError(
                    f"Expected {self._where} to hold the tensor {key!r} that its index file "
                    "lists but it does not: the shard does not belong to its index file, or is "
                    "damaged. Restore both, or remove them to leave them out."
                )
            found = self._cache[key] = self._file.get_tensor(key)
        return found


def _index_name(shard: str) -> str:
    """The name of a shard's index file (the same stem)."""
    return shard.removesuffix(SHARD_SUFFIX) + INDEX_SUFFIX


def _as_set(value: object, name: str, integers: bool = False) -> set[Any] | None:
    """A filter's values as a set; ``integers``: each an int (``"0"`` or ``1.5`` would match no
    row and leave the dataset silently empty, so they are refused)."""
    if value is None:
        return None
    if isinstance(value, (str, numbers.Integral)):
        values: set[Any] = {value}
    elif isinstance(value, Iterable):
        values = set(value)
    else:
        raise RecorderConfigError(
            f"Expected `{name}` to be a value or a list of them but got {value!r}."
        )
    if integers:
        wrong = [v for v in values if isinstance(v, bool) or not isinstance(v, numbers.Integral)]
        if wrong:
            raise RecorderConfigError(
                f"Expected `{name}` to be an int or a list of ints but got "
                f"{type(wrong[0]).__name__} {wrong[0]!r}."
            )
        values = {int(v) for v in values}
    return values


def _names_none(key: str, owner: str, wanted: set[Any], have: set[Any]) -> str:
    """The message for the filter ``key`` whose values ``wanted`` name none of the values
    ``have`` of the directory's rows: the close matches of a misspelt name first (the values
    there may be many module names), then every value there."""
    pool = sorted(h for h in have if isinstance(h, str))
    near = "".join(closest_hint(w, pool, key) for w in sorted(wanted, key=str))
    if not near:
        return (
            f"Expected `{key}` of {owner} to name some of {sorted(have)} but got {sorted(wanted)}."
        )
    return (
        f"Expected `{key}` of {owner} to name some of the {key} written but got "
        f"{sorted(wanted)}.{near} All {key} written: {sorted(have)}."
    )


class ActivationDataset(Dataset[dict[str, Any]]):
    """The activations written by :class:`~lightning_recorder.activations.ShardWriter` (or the
    ``ActivationWriter`` callback), one item per row: one sample's activation of one source.

    Only complete shards are read (those with an index file). Local shards are memory-mapped:
    only the rows read are read from the file; an item's activation is a copy of its row, so
    writing to it changes no later read. Items are dicts::

        {"activation": tensor, "run": ..., "stage": ..., "global_step": ..., "epoch": ...,
         "batch_idx": ..., "dataloader_idx": ..., "rank": ..., "sample_index": ...,
         "source": ..., "module": ..., "call": ...}

    so a ``DataLoader`` collates them. Rows are ordered by run, stage, source, module, epoch,
    step, sample index, call, rank: under DDP the rows of one step come out in dataset order.

    Args:
        directory: the directory (a path or an ``fsspec`` URL).
        sources: keep these sources (names given to the writer).
        stages: keep only rows of these stages (one value or a list).
        steps: keep only rows of these global steps (one value or a list).
        epochs: keep only rows of these epochs (one value or a list).
        ranks: keep only rows written by these ranks (one value or a list).
        modules: keep only rows of these modules (one value or a list).
        runs: keep only rows of these runs (one value or a list).
        calls: keep only rows of these calls of their module in the forward (``0`` the first;
            one value or a list): a module called several times in one forward writes a chunk
            per call.
        dataloaders: keep only rows of these dataloaders (their ``dataloader_idx``; one value
            or a list): each of several dataloaders of a stage numbers its samples from 0.

    Raises:
        RecorderConfigError: the directory holds no activation index, or a filter is invalid
            or names none of the values of the directory's rows (a run id or a step never
            written), or the filters keep no row together.

    Examples:
        >>> import tempfile
        >>> import torch
        >>> from lightning_recorder.activations import ShardWriter
        >>> tmp = tempfile.TemporaryDirectory()
        >>> directory = tmp.name
        >>> with ShardWriter(directory) as writer:
        ...     _ = writer.write("feat", "fc", torch.arange(6.0).view(3, 2), sample_index=[7, 8, 9])
        >>> data = ActivationDataset(directory, sources="feat")
        >>> data[1]["activation"], data[1]["sample_index"]
        (tensor([2., 3.]), 8)
        >>> tmp.cleanup()
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        sources: str | Sequence[str] | None = None,
        *,
        stages: str | Sequence[str] | None = None,
        steps: int | Sequence[int] | None = None,
        epochs: int | Sequence[int] | None = None,
        ranks: int | Sequence[int] | None = None,
        modules: str | Sequence[str] | None = None,
        runs: str | Sequence[str] | None = None,
        calls: int | Sequence[int] | None = None,
        dataloaders: int | Sequence[int] | None = None,
    ) -> None:
        owner = type(self).__name__
        require_safetensors(owner)
        self.storage = Storage(directory, owner)
        entries = list(iter_index(self.storage))
        # The index file goes before its shard: one gone since it was read (a resumed run's
        # writer removing what followed its checkpoint) takes its shard out of the dataset.
        present = set(self.storage.names())
        entries = [e for e in entries if _index_name(e["shard"]) in present]
        if not entries:
            raise RecorderConfigError(
                f"Expected `directory` of {owner} to hold activation shards with index files "
                f"(*.index.json) but {self.storage.url!r} has none."
            )
        filters = {
            "runs": _as_set(runs, "runs"),
            "stages": _as_set(stages, "stages"),
            "steps": _as_set(steps, "steps", integers=True),
            "epochs": _as_set(epochs, "epochs", integers=True),
            "ranks": _as_set(ranks, "ranks", integers=True),
            "modules": _as_set(modules, "modules"),
            "sources": _as_set(sources, "sources"),
            "calls": _as_set(calls, "calls", integers=True),
            "dataloaders": _as_set(dataloaders, "dataloaders", integers=True),
        }
        self.filters = {k: v for k, v in filters.items() if v is not None}
        self._shards: dict[str, _Shard] = {}
        every = [
            {**chunk, "run": entry["run"], "rank": entry["rank"], "shard": entry["shard"]}
            for entry in entries
            for chunk in entry["chunks"]
        ]
        for key, wanted in self.filters.items():
            have = {c[_FIELDS[key]] for c in every}
            if wanted and not wanted & have:  # a typo, or a step never written: no row at all
                raise RecorderConfigError(_names_none(key, owner, wanted, have))
        chunks = [chunk for chunk in every if self._keep(chunk)]
        if not chunks and all(self.filters.values()):  # each filter keeps rows, not together
            others = "; ".join(
                f"`{key}` {sorted(wanted)} where the other filters keep "
                f"{sorted({c[_FIELDS[key]] for c in every if self._keep(c, but=key)})}"
                for key, wanted in self.filters.items()
            )
            raise RecorderConfigError(
                f"Expected the filters of {owner} together to keep some rows but no row "
                f"matches them all: {others}. Change one of them to a value the others keep."
            )
        #: Every chunk kept: one tensor of a shard (one source in one batch) with its provenance.
        self.chunks = chunks
        missing = sorted({c["shard"] for c in chunks} - present)
        if missing:
            raise RecorderConfigError(
                f"Expected the shards listed by the index files of {self.storage.url!r} to be "
                f"there but these are missing ({len(missing)}): {', '.join(missing[:3])}"
                f"{' …' if len(missing) > 3 else ''}. Restore them, or remove their index files "
                "(same name, .index.json) to leave their rows out."
            )
        rows = [
            (
                c["run"],
                c["stage"],
                c["source"],
                c["module"],
                c["epoch"],
                c["global_step"],
                s,
                c["call"],
                c["rank"],
                c["batch_idx"],
                n,
                r,
            )
            for n, c in enumerate(chunks)
            for r, s in enumerate(c["sample_index"])
        ]
        rows.sort()
        self._rows = [(row[-2], row[-1]) for row in rows]

    def _keep(self, chunk: dict[str, Any], but: str | None = None) -> bool:
        """Whether ``chunk`` passes every filter (those but ``but``)."""
        return all(chunk[_FIELDS[k]] in v for k, v in self.filters.items() if k != but)

    def __len__(self) -> int:
        return len(self._rows)

    def __getstate__(self) -> dict[str, Any]:
        # Memory maps do not pickle (DataLoader workers started by spawn): each copy reopens.
        return {**self.__dict__, "_shards": {}}

    def _shard(self, name: str) -> _Shard:
        shard = self._shards.get(name)
        if shard is None:
            shard = self._shards[name] = _Shard(self.storage, name)
        return shard

    def _chunk_tensor(self, chunk: dict[str, Any]) -> torch.Tensor:
        return self._shard(chunk["shard"]).tensor(chunk["key"])

    def _row_number(self, idx: object) -> int:
        """``idx`` as an int (an int, a NumPy integer, an integer 0-d tensor), else an error: a
        slice, a list or a float would fail deep in the row lookup, a bool read row 0 or 1."""
        found = as_index(idx)
        if found is not None:
            return found
        raise RecorderConfigError(
            f"Expected the index of a row of {type(self).__name__} to be an int (a negative one "
            f"counts from the end) but got {type(idx).__name__} {repr(idx)[:80]}. Take several "
            "rows with torch.utils.data.Subset(dataset, indices) or a DataLoader, or one source's "
            "rows as one tensor with dataset.concat(source)."
        )

    def __getitem__(self, idx: int) -> dict[str, Any]:
        idx = self._row_number(idx)
        if not -len(self._rows) <= idx < len(self._rows):
            raise NoRecordError(
                f"Expected an index in [-{len(self._rows)}, {len(self._rows)}) (a negative one "
                f"counts from the end) but got {idx}."
            )
        number, row = self._rows[idx]
        chunk = self.chunks[number]
        return {
            # a copy: the chunk's tensor is kept, so a view would carry a change to later reads
            "activation": self._chunk_tensor(chunk)[row].clone(),
            **{k: chunk[k] for k in _CHUNK_FIELDS},
            "sample_index": chunk["sample_index"][row],
        }

    @property
    def sample_indices(self) -> torch.Tensor:
        """The sample index of every row, in row order (``-1`` where unknown)."""
        return torch.tensor(
            [self.chunks[n]["sample_index"][r] for n, r in self._rows], dtype=torch.long
        )

    def provenance(self) -> list[dict[str, Any]]:
        """The provenance of every row (an item without its activation, with the row's
        ``shape``), in row order."""
        out = []
        for n, r in self._rows:
            chunk = self.chunks[n]
            row = {k: chunk[k] for k in _CHUNK_FIELDS}
            row["sample_index"] = chunk["sample_index"][r]
            row["shape"] = chunk["shape"][1:]
            out.append(row)
        return out

    def concat(self, source: str | None = None) -> torch.Tensor:
        """The activations of one source (or module) as one tensor, rows in row order.

        Args:
            source: a source name, or a module name; may be left out when the dataset holds
                one source.

        Raises:
            RecorderConfigError: several sources and none chosen, an unknown name, or rows of
                different shapes.
        """
        sources = {self.chunks[n]["source"] for n, _ in self._rows}
        modules = {self.chunks[n]["module"] for n, _ in self._rows}
        if source is None:
            if len(sources) != 1:
                raise RecorderConfigError(
                    f"Expected `source` to choose one of {sorted(sources)} but got None."
                )
            field, source = "source", next(iter(sources))
        elif source in sources:
            field = "source"
        elif source in modules:
            field = "module"
        else:
            raise RecorderConfigError(
                f"Expected `source` to be one of the sources {sorted(sources)} or modules "
                f"{sorted(modules)} but got {source!r}."
                f"{closest_hint(source, sources | modules, 'sources and modules')}"
            )
        rows = [(n, r) for n, r in self._rows if self.chunks[n][field] == source]
        shapes = {tuple(self.chunks[n]["shape"][1:]) for n, _ in rows}
        if len(shapes) > 1:
            raise RecorderConfigError(
                f"Expected the rows of {source!r} to share one shape to be concatenated but got "
                f"{sorted(shapes)}; filter the dataset, or read the rows one by one."
            )
        # Runs of consecutive rows of one chunk are copied as slices, not row by row.
        pieces: list[torch.Tensor] = []
        start = 0
        while start < len(rows):
            n, r = rows[start]
            end = start + 1
            while end < len(rows) and rows[end] == (n, r + end - start):
                end += 1
            pieces.append(self._chunk_tensor(self.chunks[n])[r : r + end - start])
            start = end
        return torch.cat(pieces)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.storage.url!r}, rows={len(self)})"


def concat_activations(
    directory: str | os.PathLike[str], source: str | None = None, **filters: Any
) -> torch.Tensor:
    """One source's activations in ``directory`` as one tensor (when it fits in memory).

    ``filters`` are those of :class:`ActivationDataset` (``stages=``, ``steps=``, ``ranks=`` …);
    rows come in its order (for one predict run: by sample index).

    Examples:
        >>> import tempfile
        >>> import torch
        >>> from lightning_recorder.activations import ShardWriter
        >>> tmp = tempfile.TemporaryDirectory()
        >>> directory = tmp.name
        >>> with ShardWriter(directory) as writer:
        ...     _ = writer.write("feat", "fc", torch.ones(2, 3), sample_index=[1, 0])
        >>> concat_activations(directory, "feat").shape
        torch.Size([2, 3])
        >>> tmp.cleanup()
    """
    unknown = sorted(set(filters) - set(_FILTERS) - {"sources"})
    if unknown:
        raise RecorderConfigError(
            f"Expected filters among {', '.join(_FILTERS)} but got {', '.join(unknown)}."
        )
    return ActivationDataset(directory, **filters).concat(source)
