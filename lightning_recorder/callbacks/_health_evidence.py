"""The evidence bundle of a health event: tensors in safetensors, everything else in JSON.

A bundle is one directory, ``<root>/step<step:08d>-rank<rank>/``, holding

* ``tensors.safetensors`` — the batch's tensors (``batch.<path>``), the offending module's
  inputs and outputs as the replay saw them (``<module>.input.<arg>``, ``<module>.output...``)
  and the random generators' states at the step's start (``rng.cpu``, ``rng.cuda.<device>``);
* ``event.json`` — the event, a description of everything in the batch that is not a tensor,
  an index of the tensors (role, dtype, shape, NaN/+inf/-inf counts), what was left out and
  why, the per-module summary of the replay, step, batch index, rank and library versions.

A tensor that safetensors cannot hold as it is is stored as the dense tensors that hold its
values, named in its index entry (``stored_as``): a nested tensor as its components
(``<key>.0``, ``<key>.1``, ...), a sparse one as the ``<key>.indices`` and ``<key>.values`` of
its coalesced COO form, a quantized one dequantized (``<key>``). Its shape in the index is that
of :func:`.._core.structures.shape_of` (``-1`` for a nested tensor's ragged dimensions) and its
``layout`` is named.

Both are standard formats (``safetensors.torch.load_file`` and ``json.load``): no
``lightning_recorder`` is needed to read them. A bundle is written under a temporary name and
renamed when complete, so a directory that exists is whole. All bundles of a fit share one
budget of bytes (``max_bytes``), ``event.json`` and the safetensors header included: tensors
that do not fit (in the order given, the most important first) are left out and described
instead; when nothing but the description fits, only ``event.json`` is written; when not even
that fits, nothing is.

Evidence is best-effort: a bundle (or the evidence checkpoint) that cannot be written (a full
disk, a folder made read-only or removed, safetensors missing) leaves nothing half-written,
training goes on, and one warning per kind of evidence and fit (:meth:`Evidence.failed`, rank
zero) says where, why and what to do.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn

from .._core.structures import shape_of
from ._health_trace import tensor_paths
from ._health_verdict import exact_counts

__all__ = ["Evidence", "describe_batch"]

_FILE_BYTES = 16  # a safetensors file's header length and the header's padding
_OVER = "over the evidence budget"


def layout_of(t: torch.Tensor) -> str | None:
    """The layout of a tensor that is not an ordinary dense one (``"nested"`` with its layout,
    ``"sparse_coo"``, ``"sparse_csr"``, ...); ``None`` for a dense tensor (a quantized one too:
    its dtype says so)."""
    if t.is_nested:
        return f"nested {_name(t.layout)}"
    return None if t.layout == torch.strided else _name(t.layout)


def _name(layout: torch.layout) -> str:
    return str(layout).removeprefix("torch.")


def describe_tensor(t: torch.Tensor) -> dict[str, Any]:
    """A tensor as JSON: ``{"tensor": dtype, "shape": [...]}``, and its ``layout`` if it is not
    an ordinary dense one."""
    info: dict[str, Any] = {"tensor": str(t.dtype), "shape": list(shape_of(t))}
    layout = layout_of(t)
    if layout is not None:
        info["layout"] = layout
    return info


def describe_batch(batch: Any) -> Any:
    """The batch as JSON: tensors by dtype and shape, other values by type and a short repr."""
    if isinstance(batch, torch.Tensor):
        return describe_tensor(batch)
    if isinstance(batch, Mapping):
        return {str(k): describe_batch(v) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return [describe_batch(v) for v in batch]
    if hasattr(batch, "__dataclass_fields__"):
        return {f: describe_batch(getattr(batch, f, None)) for f in batch.__dataclass_fields__}
    if batch is None or isinstance(batch, (bool, int, float, str)):
        return batch
    text = repr(batch)
    return {"type": type(batch).__qualname__, "repr": text[:200] + ("…" if len(text) > 200 else "")}


def stored_as(key: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """The dense tensors that hold the values of ``t`` in a bundle, by key: ``{key: t}`` for a
    dense tensor, its components for a nested one, the indices and values of its coalesced COO
    form for a sparse one, its values for a quantized one."""
    t = t.detach()
    if t.is_nested:
        return {f"{key}.{i}": part for i, part in enumerate(t.unbind())}
    if t.layout != torch.strided:
        coo = (t if t.layout == torch.sparse_coo else t.to_sparse_coo()).coalesce()
        return {f"{key}.indices": coo.indices(), f"{key}.values": coo.values()}
    return {key: t.dequantize() if t.is_quantized else t}


def _header_bytes(key: str, part: torch.Tensor) -> int:
    """No less than what ``part`` adds to the header of a safetensors file: its name, dtype,
    shape and offsets, in JSON."""
    entry = {key: {"dtype": "F8_E4M3", "shape": list(part.shape), "data_offsets": [2**64] * 2}}
    return len(json.dumps(entry))


def _json(meta: dict[str, Any]) -> str:
    """``event.json``'s text."""
    return json.dumps(meta, indent=1, default=str)


def _storable(t: torch.Tensor) -> torch.Tensor:
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.to("cpu").contiguous().clone()  # no storage shared between entries


def _taken(path: Path) -> bool:
    """Whether something is at ``path``; ``False`` where it cannot even be looked up (a folder
    this process may no longer read): writing there fails next, and says why."""
    try:
        return path.exists()
    except OSError:
        return False


class Evidence:
    """Writes bundles under ``root`` within a budget of ``max_bytes`` for the whole run."""

    def __init__(self, root: Path | None, max_bytes: int) -> None:
        self.root, self.max_bytes = root, max_bytes
        self.used = 0
        self.error: str | None = None  # why the last bundle could not be written
        self._warned: set[str] = set()  # the kinds of evidence a warning said failed this fit

    def start(self) -> None:
        """A new fit: its own budget, and a warning again for evidence it cannot write."""
        self.used, self.error = 0, None
        self._warned = set()

    def failed(self, kind: str, path: Path, err: BaseException) -> str:
        """Say (once per ``kind`` of evidence and fit, rank zero) that ``path`` could not be
        written and what to do; return the error as the event names it."""
        error = f"{type(err).__name__}: {str(err).strip()[:300]}"
        if kind in self._warned:
            return error
        self._warned.add(kind)
        if isinstance(err, ImportError):  # a dependency, missing or broken here
            fix = "Install safetensors (`pip install safetensors`), the format of its tensors, "
        else:
            fix = "Free space there, pass another `evidence_dir`, "
        off = "evidence_checkpoint=False" if kind == "checkpoint" else "evidence_max_bytes=0"
        rank_zero_warn(
            f"HealthMonitor could not write the evidence {kind} {path} ({error}); training goes "
            f"on without it, and this warning is not repeated for this fit. {fix}or pass "
            f"{off} to write none."
        )
        return error

    @property
    def enabled(self) -> bool:
        return self.root is not None and self.max_bytes > 0

    def path(self, step: int, rank: int) -> Path | None:
        """Where the bundle of ``step`` on ``rank`` goes (``None`` when evidence is off)."""
        if not self.enabled or self.used >= self.max_bytes:
            return None
        assert self.root is not None
        return self.root / f"step{step:08d}-rank{rank}"

    def unwritable(self) -> str | None:
        """Why no bundle could be written under ``root`` (its nearest existing folder is a file,
        or one this process may not write in), or ``None``: checked when a run starts, before
        a bundle is due. Nothing is created."""
        if not self.enabled:
            return None
        assert self.root is not None
        path = self.root.absolute()
        while not path.exists() and path.parent != path:
            path = path.parent
        if not path.is_dir():
            return f"{path} is a file, not a directory"
        if not os.access(path, os.W_OK | os.X_OK):
            return f"this process may not write in {path}"
        return None

    def free(self, path: Path) -> Path:
        """``path``, or a name beside it that no bundle has (a resumed run reaching the same
        step again, a second run into the same ``evidence_dir``), with the same extension
        (``.ckpt`` for a checkpoint)."""
        final = path
        while _taken(final):
            final = final.with_name(f"{path.stem}-{uuid.uuid4().hex[:6]}{path.suffix}")
        return final

    def write(
        self, path: Path, tensors: Mapping[str, tuple[str, torch.Tensor]], meta: dict[str, Any]
    ) -> Path | None:
        """Write one bundle: ``tensors`` is ``{key: (role, tensor)}``, in order of importance.

        Returns the bundle's directory, or ``None`` when the budget is spent or writing failed
        (then :attr:`error` says why, and :meth:`failed` warned: evidence never stops training).
        """
        self.error = None
        kept: dict[str, torch.Tensor] = {}
        index: dict[str, Any] = {}
        omitted: dict[str, Any] = {}
        rows = exact_counts([t for _, t in tensors.values()])
        entries = []
        for (key, (role, t)), row in zip(tensors.items(), rows, strict=True):
            parts = stored_as(key, t)
            size = sum(p.numel() * p.element_size() for p in parts.values())
            described = describe_tensor(t)
            info = {
                "role": role,
                "dtype": described.pop("tensor"),
                **described,
                "nan": row[0],
                "posinf": row[1],
                "neginf": row[2],
            }
            if list(parts) != [key] or t.is_quantized:
                info["stored_as"] = list(parts)
            entries.append((key, parts, size, info))
        # event.json with every tensor left out: the most it takes (a kept tensor's entry is
        # shorter), counted before any tensor
        every = {key: {**info, "bytes": size, "why": _OVER} for key, _, size, info in entries}
        description = len(_json({**meta, "tensors": {}, "omitted": every}))
        left = self.max_bytes - self.used - description - _FILE_BYTES
        if left < 0:
            return None
        for key, parts, size, info in entries:
            cost = size + sum(_header_bytes(k, p) for k, p in parts.items())
            if cost <= left:
                kept.update((k, _storable(p)) for k, p in parts.items())
                left -= cost
                index[key] = info
            else:
                omitted[key] = {**info, "bytes": size, "why": _OVER}
        meta = {**meta, "tensors": index, "omitted": omitted}
        final = self.free(path)
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
        try:
            tmp.mkdir(parents=True, exist_ok=False)
            if kept:
                from safetensors.torch import save_file

                save_file(kept, str(tmp / "tensors.safetensors"))
            (tmp / "event.json").write_text(_json(meta), encoding="utf-8")
            written = sum(p.stat().st_size for p in tmp.iterdir())
            os.replace(tmp, final)
        except BaseException as err:  # OSError, safetensors' SafetensorError (a full disk), ...
            shutil.rmtree(tmp, ignore_errors=True)  # a bundle is whole or absent
            if not isinstance(err, Exception):  # KeyboardInterrupt: the run stops
                raise
            self.error = self.failed("bundle", final, err)
            return None
        self.used += written
        return final


def batch_tensors(batch: Any) -> dict[str, tuple[str, torch.Tensor]]:
    """``{"batch.<path>": ("batch", tensor)}`` for the batch's tensors."""
    return {(f"batch.{path}" if path else "batch"): ("batch", t) for path, t in tensor_paths(batch)}
