"""HealthMonitor's evidence bundles for tensors that are not ordinary dense ones (nested,
sparse), and a bundle that cannot be written: training goes on in every case."""

from __future__ import annotations

import errno
import json
import math
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import safetensors.torch
import torch
from helpers.models import QUIET
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor, nn

from lightning_recorder import HealthMonitor, NonFiniteError, RecorderConfigError

STEPS = 3
BAD_STEP = 1


def _nested(layout: torch.layout) -> Callable[[list[Tensor]], Tensor]:
    return lambda parts: torch.nested.nested_tensor(parts, layout=layout)


# how each kind of batch tensor is made from its dense components
KINDS: dict[str, Callable[[list[Tensor]], Tensor]] = {
    "nested strided": _nested(torch.strided),
    "nested jagged": _nested(torch.jagged),
    "sparse_coo": lambda parts: torch.cat(parts).to_sparse(),
    "sparse_csr": lambda parts: torch.cat(parts).to_sparse_csr(),
}


def _parts(step: int, bad: float | None) -> list[Tensor]:
    """Three components of 2, 3 and 5 rows of 4 features, some entries zero; ``bad`` at [1][0, 1]
    of the bad step."""
    g = torch.Generator().manual_seed(step)
    parts = [
        torch.randn(n, 4, generator=g) * (torch.rand(n, 4, generator=g) > 0.4) for n in (2, 3, 5)
    ]
    if bad is not None and step == BAD_STEP:
        parts[1][0, 1] = bad
    return parts


class Pooled(pl.LightningModule):
    """A batch of variable-length (nested) or sparse rows, projected and pooled per component."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        if x.is_nested:  # the module takes the nested tensor itself
            parts = list(self.proj(x).unbind())
        else:  # sparse: the components' rows, concatenated
            parts = list(self.proj(x.to_dense()).split([2, 3, 5]))
        pooled = torch.stack([p.mean(0) for p in parts])
        return ((self.head(pooled).squeeze(-1) - y) ** 2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(monitor: HealthMonitor, batches: list[Any], *others: pl.Callback) -> None:
    trainer = pl.Trainer(
        **{**QUIET, "logger": False, "max_steps": STEPS}, callbacks=[monitor, *others]
    )
    trainer.fit(Pooled(), torch.utils.data.DataLoader(batches, batch_size=None))
    assert trainer.global_step == STEPS  # the bad step did not stop training


def _batches(kind: str, bad: float) -> list[tuple[Tensor, Tensor]]:
    make = KINDS[kind]
    return [(make(_parts(s, bad)), _target(s)) for s in range(STEPS)]


def _target(step: int) -> Tensor:
    return torch.randn(3, generator=torch.Generator().manual_seed(100 + step))


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_bad_batch_that_is_not_dense_is_stored_as_its_parts(kind: str, tmp_path: Path) -> None:
    monitor = HealthMonitor("skip", evidence_dir=tmp_path, rules=())
    _fit(monitor, _batches(kind, math.inf))
    (event,) = monitor.events
    assert (event.step, event.module, event.action) == (BAD_STEP, None, "skipped")
    assert event.counts == {"nan": 0, "posinf": 1, "neginf": 0}
    nested = kind.startswith("nested")
    assert event.shape == ((3, -1, 4) if nested else (10, 4))  # -1: the ragged dimension
    bundle = Path(event.evidence)
    assert bundle == tmp_path / f"step{BAD_STEP:08d}-rank0"
    meta = json.loads((bundle / "event.json").read_text())
    tensors = load_file(str(bundle / "tensors.safetensors"))
    # the batch described with its layout; the index says where its values are
    assert meta["batch"][0] == {
        "tensor": "torch.float32",
        "shape": [3, -1, 4] if nested else [10, 4],
        "layout": kind,
    }
    entry = meta["tensors"]["batch.0"]
    assert (entry["layout"], entry["posinf"], entry["nan"]) == (kind, 1, 0)
    expected = _parts(BAD_STEP, math.inf)
    if nested:
        assert entry["stored_as"] == ["batch.0.0", "batch.0.1", "batch.0.2"]
        for i, part in enumerate(expected):  # the same values stored, not recomputed
            assert torch.equal(tensors[f"batch.0.{i}"], part)
    else:
        assert entry["stored_as"] == ["batch.0.indices", "batch.0.values"]
        rebuilt = torch.sparse_coo_tensor(
            tensors["batch.0.indices"], tensors["batch.0.values"], (10, 4)
        ).to_dense()
        assert torch.equal(rebuilt, torch.cat(expected))
    assert "batch.0" not in tensors and torch.equal(tensors["batch.1"], _target(BAD_STEP))
    assert meta["omitted"] == {}


class NestedOut(nn.Module):
    """A projection of each component of a nested input, returned as a nested tensor; on the bad
    step it makes a NaN in its second component itself."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.poison = False

    def forward(self, x: Tensor) -> Tensor:
        parts = [self.proj(p) for p in x.unbind()]
        if self.poison:
            parts[1] = parts[1] * torch.tensor([1.0, math.nan, 1.0, 1.0])
        return torch.nested.as_nested_tensor(parts)


class NestedModel(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = NestedOut()
        self.head = nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        self.body.poison = self.trainer.global_step == BAD_STEP
        pooled = torch.stack([p.mean(0) for p in self.body(x).unbind()])
        return ((self.head(pooled).squeeze(-1) - y) ** 2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_module_that_makes_a_nan_in_a_nested_output_is_named_with_its_parts(
    tmp_path: Path,
) -> None:
    monitor = HealthMonitor("skip", evidence_dir=tmp_path, rules=())
    batches = [(KINDS["nested strided"](_parts(s, None)), _target(s)) for s in range(STEPS)]
    trainer = pl.Trainer(**{**QUIET, "logger": False, "max_steps": STEPS}, callbacks=[monitor])
    trainer.fit(NestedModel(), torch.utils.data.DataLoader(batches, batch_size=None))
    (event,) = monitor.events
    assert (event.step, event.module, event.direction, event.action) == (
        BAD_STEP,
        "body",
        "forward",
        "skipped",
    )
    assert event.counts == {"nan": 3, "posinf": 0, "neginf": 0}  # a column of 3 rows
    assert event.shape == (3, -1, 4)
    bundle = Path(event.evidence)
    meta = json.loads((bundle / "event.json").read_text())
    tensors = load_file(str(bundle / "tensors.safetensors"))
    entry = meta["tensors"]["body.output"]
    assert entry["layout"] == "nested strided" and entry["nan"] == 3
    assert entry["stored_as"] == ["body.output.0", "body.output.1", "body.output.2"]
    assert [tuple(tensors[k].shape) for k in entry["stored_as"]] == [(2, 4), (3, 4), (5, 4)]
    assert tensors["body.output.1"][:, 1].isnan().all()
    assert not tensors["body.output.0"].isnan().any() and not tensors["body.output.2"].isnan().any()


class _Blocks(pl.Callback):
    """Puts a file where the bundles' folder would be once training has started (the folder
    could be written to when the run started)."""

    def __init__(self, blocker: Path) -> None:
        self.blocker = blocker

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.blocker.write_text("a file where the bundles' directory would be")


def test_a_bundle_that_cannot_be_written_warns_and_training_goes_on(tmp_path: Path) -> None:
    blocker = tmp_path / "not_a_directory"
    monitor = HealthMonitor("skip", evidence_dir=blocker, rules=())
    dense = [(torch.cat(_parts(s, math.nan)), _target(s)) for s in range(STEPS)]
    batches = [(x.to_sparse(), y) for x, y in dense]
    with pytest.warns(UserWarning, match=r"could not write the evidence bundle .*not_a_directory"):
        _fit(monitor, batches, _Blocks(blocker))
    (event,) = monitor.events
    assert event.action == "skipped" and event.evidence is None
    assert "no evidence written" in event.message
    assert blocker.read_text().startswith("a file")  # left as it was, nothing beside it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["not_a_directory"]


def test_a_disk_that_fails_while_a_bundle_is_written_warns_and_leaves_no_part_of_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full_disk(tensors: dict[str, Tensor], filename: str, **kwargs: Any) -> None:
        Path(filename).write_bytes(b"\0" * 64)  # a part written, then the disk is full
        raise SafetensorError("Error while serializing: I/O error: No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    evidence = tmp_path / "evidence"
    monitor = HealthMonitor("skip", evidence_dir=evidence, rules=())
    batches = [(torch.cat(_parts(s, math.nan)), _target(s)) for s in range(STEPS)]
    with pytest.warns(UserWarning, match=r"could not write the evidence bundle .*No space left"):
        _fit(monitor, batches)  # training went on
    (event,) = monitor.events
    assert event.action == "skipped" and event.evidence is None
    assert list(evidence.iterdir()) == []  # no half-written bundle


def _full_disk(written: Path) -> OSError:
    """What a disk that fills up while ``written`` is written raises, once a part of it is."""
    written.write_bytes(b"\0" * 64)
    return OSError(errno.ENOSPC, "No space left on device", str(written))


def _fit_on_full_disk(monitor: HealthMonitor) -> list[warnings.WarningMessage]:
    """Steps 1 and 2 with a NaN in the batch: a fit that must go on, or end in the monitor's own
    ``NonFiniteError`` under "raise"; the warnings it gave."""
    batches = []
    for s in range(STEPS):
        x = torch.cat(_parts(s, None))
        if s >= BAD_STEP:
            x[4, 1] = math.nan
        batches.append((x, _target(s)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if monitor.on_nonfinite == "raise":
            failed = r"could not be written \(OSError: \[Errno 28\]"
            with pytest.raises(NonFiniteError, match=failed):
                _fit(monitor, batches)
        else:
            _fit(monitor, batches)  # training went on
    return [w for w in caught if "HealthMonitor could not write" in str(w.message)]


@pytest.mark.parametrize("policy", ["warn", "skip", "raise"])
def test_a_disk_that_fills_up_under_a_bundle_lets_training_go_on_with_one_warning(
    policy: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An OSError (a full disk) while bundles are written, after a part of one was: no part of
    any is left, training goes on ("raise" raises its own error), one warning a fit says where,
    why and what to do, and each event says its bundle could not be written."""

    def full_disk(tensors: dict[str, Tensor], filename: str, **kwargs: Any) -> None:
        raise _full_disk(Path(filename))

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    evidence = tmp_path / "evidence"
    monitor = HealthMonitor(policy, evidence_dir=evidence, rules=())
    (warned,) = _fit_on_full_disk(monitor)
    text = str(warned.message)
    assert f"evidence bundle {evidence / 'step00000001-rank0'} (OSError: [Errno 28]" in text
    assert "Free space there, pass another `evidence_dir`, or pass evidence_max_bytes=0" in text
    # "skip" wrote (tried) a bundle on both bad steps; "warn" on the first of the run only
    loud = {"warn": 1, "skip": 2, "raise": 1}[policy]
    assert [e.step for e in monitor.events] == [1, 2][: 1 if policy == "raise" else 2]
    for event in monitor.events[:loud]:
        assert event.evidence is None
        assert event.details["evidence_error"].startswith("OSError: [Errno 28] No space left")
        assert "no evidence written: the bundle could not be written (OSError" in event.message
    assert list(evidence.iterdir()) == []  # no half-written bundle


@pytest.mark.parametrize("policy", ["warn", "skip", "raise"])
def test_a_disk_that_fills_up_under_the_evidence_checkpoint_lets_training_go_on(
    policy: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An OSError while the checkpoint before the bad update is written, after a part of it
    was: no file is left, training goes on ("raise" raises its own error, not the OSError), one
    warning says so, and the event and its bundle say the checkpoint could not be written."""
    import lightning.fabric.plugins.io.torch_io as torch_io

    def full_disk(checkpoint: dict[str, Any], filepath: Any) -> None:
        raise _full_disk(Path(filepath))

    monkeypatch.setattr(torch_io, "_atomic_save", full_disk)
    evidence = tmp_path / "evidence"
    monitor = HealthMonitor(policy, evidence_dir=evidence, rules=(), evidence_checkpoint=True)
    (warned,) = _fit_on_full_disk(monitor)
    text = str(warned.message)
    path = evidence / f"step{BAD_STEP:08d}-before-update.ckpt"
    assert f"evidence checkpoint {path} (OSError: [Errno 28] No space left" in text
    assert "pass another `evidence_dir`, or pass evidence_checkpoint=False to write" in text
    assert list(evidence.glob("*.ckpt")) == []  # the part written is gone
    event = monitor.events[0]
    assert event.step == BAD_STEP and event.evidence is not None  # the bundle is written
    assert event.details["checkpoint_error"].startswith("OSError: [Errno 28] No space left")
    assert "the checkpoint before the update could not be written (OSError" in event.message
    meta = json.loads((Path(event.evidence) / "event.json").read_text())
    assert meta["checkpoint"] is None and meta["checkpoint_error"].startswith("OSError: [Errno 28]")


class _Unreadable(pl.Callback):
    """Once training has started, ``folder`` can no longer be looked into nor written in, as a
    folder whose permissions were taken away (which do not stop root: ``Path`` is patched)."""

    def __init__(self, folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.folder, self.monkeypatch = folder, monkeypatch

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        def denied(original: Callable[..., Any]) -> Callable[..., Any]:
            def call(path: Path, *args: Any, **kwargs: Any) -> Any:
                if path.is_relative_to(self.folder):
                    raise PermissionError(errno.EACCES, "Permission denied", str(path))
                return original(path, *args, **kwargs)

            return call

        for method in ("exists", "mkdir"):
            self.monkeypatch.setattr(Path, method, denied(getattr(Path, method)))


def test_a_folder_that_can_no_longer_be_read_lets_training_go_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    evidence = tmp_path / "evidence"
    monitor = HealthMonitor("skip", evidence_dir=evidence, rules=())
    batches = [(torch.cat(_parts(s, math.nan)), _target(s)) for s in range(STEPS)]
    with pytest.warns(UserWarning, match=r"could not write the evidence bundle .*Permission"):
        _fit(monitor, batches, _Unreadable(evidence, monkeypatch))  # training went on
    (event,) = monitor.events
    assert event.evidence is None and event.details["evidence_error"].startswith("PermissionError")


def test_a_folder_that_cannot_hold_bundles_is_refused_when_the_run_starts(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    batches = _batches("sparse_coo", math.nan)
    for given in (blocker, blocker / "health"):
        monitor = HealthMonitor("skip", evidence_dir=given, rules=())
        with pytest.raises(RecorderConfigError, match=r"`evidence_dir` .* but .*a_file is a file"):
            _fit(monitor, batches)
    # evidence off: nothing to write, nothing checked
    _fit(HealthMonitor("skip", evidence_dir=blocker, evidence_max_bytes=0, rules=()), batches)
    # the default folder (under the Trainer's log folder): a warning, and training goes on
    monitor = HealthMonitor("skip", rules=())
    trainer = pl.Trainer(
        **{**QUIET, "logger": False, "max_steps": STEPS, "default_root_dir": blocker},
        callbacks=[monitor],
    )
    with pytest.warns(UserWarning, match=r"cannot write evidence bundles in .*a_file is a file"):
        trainer.fit(Pooled(), torch.utils.data.DataLoader(batches, batch_size=None))
    assert trainer.global_step == STEPS
    assert blocker.read_text() == "not a folder"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


class Quantized(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x, y = batch
        return ((self.proj(x.dequantize()).squeeze(-1) - y) ** 2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_quantized_batch_tensor_is_stored_dequantized(tmp_path: Path) -> None:
    def batch(step: int) -> tuple[Tensor, Tensor]:
        x = torch.quantize_per_tensor(
            torch.cat(_parts(step, None)).clamp(-3, 3), 0.05, 0, torch.qint8
        )
        y = torch.randn(10, generator=torch.Generator().manual_seed(step))
        if step == BAD_STEP:
            y[4] = math.nan  # the quantized tensor cannot hold one: its neighbour does
        return x, y

    monitor = HealthMonitor("skip", evidence_dir=tmp_path, rules=())
    trainer = pl.Trainer(**{**QUIET, "logger": False, "max_steps": STEPS}, callbacks=[monitor])
    trainer.fit(
        Quantized(), torch.utils.data.DataLoader([batch(s) for s in range(STEPS)], batch_size=None)
    )
    (event,) = monitor.events
    assert event.action == "skipped" and event.counts == {"nan": 1, "posinf": 0, "neginf": 0}
    bundle = Path(event.evidence)
    meta = json.loads((bundle / "event.json").read_text())
    tensors = load_file(str(bundle / "tensors.safetensors"))
    entry = meta["tensors"]["batch.0"]
    assert (entry["dtype"], entry["shape"], entry["stored_as"]) == (
        "torch.qint8",
        [10, 4],
        ["batch.0"],
    )
    assert "layout" not in entry and meta["batch"][0] == {"tensor": "torch.qint8", "shape": [10, 4]}
    assert tensors["batch.0"].dtype == torch.float32
    assert torch.equal(tensors["batch.0"], batch(BAD_STEP)[0].dequantize())
    assert meta["tensors"]["batch.1"]["nan"] == 1


def test_a_second_run_into_the_same_directory_names_its_own_bundle(tmp_path: Path) -> None:
    """Two runs flag the same step with different values (a NaN, then an infinity): each event
    names the bundle of its own run, and the first run's bundle is left as it was."""
    events = []
    for bad in (math.nan, math.inf):
        monitor = HealthMonitor("skip", evidence_dir=tmp_path, rules=())
        _fit(monitor, [(torch.cat(_parts(s, bad)), _target(s)) for s in range(STEPS)])
        events.extend(monitor.events)
    first, second = events
    assert first.evidence != second.evidence
    for event in events:
        meta = json.loads((Path(event.evidence) / "event.json").read_text())
        assert meta["event"]["counts"] == event.counts
        assert meta["event"]["evidence"] == event.evidence
        assert event.evidence in event.message
    assert first.counts["nan"] == 1 and second.counts["posinf"] == 1
    assert Path(first.evidence) == tmp_path / f"step{BAD_STEP:08d}-rank0"
    assert Path(second.evidence).name.startswith(f"step{BAD_STEP:08d}-rank0-")


@pytest.mark.parametrize("evidence_dir", [None, "bundles"])
def test_fast_dev_run_writes_no_bundle_and_says_so(
    evidence_dir: str | None, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Lightning's smoke test writes no logs or checkpoints: the monitor still reports the bad
    step, but writes no bundle and no checkpoint, in the default folder or a given one."""
    caplog.set_level("INFO", logger="lightning.pytorch.utilities.rank_zero")
    root = tmp_path / "runs"
    given = root / evidence_dir if evidence_dir is not None else None
    monitor = HealthMonitor("skip", evidence_dir=given, rules=(), evidence_checkpoint=True)
    batches = [(torch.cat(_parts(s, math.nan)), _target(s)) for s in range(STEPS)]
    trainer = pl.Trainer(**QUIET, default_root_dir=root, fast_dev_run=STEPS, callbacks=[monitor])
    trainer.fit(Pooled(), torch.utils.data.DataLoader(batches, batch_size=None))
    (event,) = monitor.events
    assert (event.step, event.action, event.evidence) == (BAD_STEP, "skipped", None)
    assert not [p for p in tmp_path.rglob("*") if p.is_file()]
    told = [r for r in caplog.records if "no evidence bundles or checkpoints" in r.message]
    assert len(told) == 1
