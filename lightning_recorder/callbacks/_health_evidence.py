"""The evidence bundle of a health event: tensors in safetensors, everything else in JSON.

A bundle is one directory, ``<root>/step<step:08d>-rank<rank>/``, holding

* ``tensors.safetensors`` — the batch's tensors (``batch.<path>``), the offending module's
  inputs and outputs as the replay saw them (``<module>.input.<arg>``, ``<module>.output...``)
  and the random generators' states at the step's start (``rng.cpu``, ``rng.cuda.<device>``);
* ``event.json`` — the event, a description of everything in the batch that is not a tensor,
  an index of the tensors (role, dtype, shape, NaN/+inf/-inf counts), what was left out and
  why, the per-module summary of the replay, step, batch index, rank and library versions.

Both are standard formats (``safetensors.torch.load_file`` and ``json.load``): no
``lightning_recorder`` is needed to read them. A bundle is written under a temporary name and
renamed when complete, so a directory that exists is whole. All bundles of a run share one
budget of bytes (``max_bytes``): tensors that do not fit are left out, largest first, and
described instead; when nothing but the description fits, only ``event.json`` is written; when
the budget is spent, nothing is.
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

from ._health_trace import tensor_paths
from ._health_verdict import exact_counts

__all__ = ["Evidence", "describe_batch"]

_JSON_RESERVE = 1 << 20  # bytes kept for event.json


def describe_batch(batch: Any) -> Any:
    """The batch as JSON: tensors by dtype and shape, other values by type and a short repr."""
    if isinstance(batch, torch.Tensor):
        return {"tensor": str(batch.dtype), "shape": list(batch.shape)}
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


def _storable(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.to("cpu").contiguous().clone()  # no storage shared between entries


class Evidence:
    """Writes bundles under ``root`` within a budget of ``max_bytes`` for the whole run."""

    def __init__(self, root: Path | None, max_bytes: int) -> None:
        self.root, self.max_bytes = root, max_bytes
        self.used = 0

    @property
    def enabled(self) -> bool:
        return self.root is not None and self.max_bytes > 0

    def path(self, step: int, rank: int) -> Path | None:
        """Where the bundle of ``step`` on ``rank`` goes (``None`` when evidence is off)."""
        if not self.enabled or self.used >= self.max_bytes:
            return None
        assert self.root is not None
        return self.root / f"step{step:08d}-rank{rank}"

    def write(
        self, path: Path, tensors: Mapping[str, tuple[str, torch.Tensor]], meta: dict[str, Any]
    ) -> Path | None:
        """Write one bundle: ``tensors`` is ``{key: (role, tensor)}``, in order of importance.

        Returns the bundle's directory, or ``None`` when the budget is spent or writing failed
        (the reason is in ``meta["not_written"]`` — evidence never stops training).
        """
        left = self.max_bytes - self.used - _JSON_RESERVE
        if left < 0:
            return None
        kept: dict[str, torch.Tensor] = {}
        index: dict[str, Any] = {}
        omitted: dict[str, Any] = {}
        rows = exact_counts([t for _, t in tensors.values()])
        for (key, (role, t)), row in zip(tensors.items(), rows, strict=True):
            size = t.numel() * t.element_size()
            info = {
                "role": role,
                "dtype": str(t.dtype),
                "shape": list(t.shape),
                "nan": row[0],
                "posinf": row[1],
                "neginf": row[2],
            }
            if size <= left:
                kept[key] = _storable(t)
                left -= size
                index[key] = info
            else:
                omitted[key] = {**info, "bytes": size, "why": "over the evidence budget"}
        meta = {**meta, "tensors": index, "omitted": omitted}
        final = path
        while final.exists():  # e.g. a resumed run reaching the same step again
            final = final.with_name(f"{path.name}-{uuid.uuid4().hex[:6]}")
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
        try:
            tmp.mkdir(parents=True, exist_ok=False)
            if kept:
                from safetensors.torch import save_file

                save_file(kept, str(tmp / "tensors.safetensors"))
            with open(tmp / "event.json", "w", encoding="utf-8") as f:
                json.dump(meta, f, indent=1, default=str)
            written = sum(p.stat().st_size for p in tmp.iterdir())
            os.replace(tmp, final)
        except (OSError, RuntimeError, ValueError) as err:
            shutil.rmtree(tmp, ignore_errors=True)
            meta["not_written"] = f"{type(err).__name__}: {err}"
            return None
        self.used += written
        return final


def batch_tensors(batch: Any) -> dict[str, tuple[str, torch.Tensor]]:
    """``{"batch.<path>": ("batch", tensor)}`` for the batch's tensors."""
    return {(f"batch.{path}" if path else "batch"): ("batch", t) for path, t in tensor_paths(batch)}
