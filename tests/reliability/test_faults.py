"""The fault matrix: faults injected into real fits with the package's callbacks attached.

Every case fits a tiny `ProbeNet` with `RecorderCallback`, `FeatureStatsMonitor` and
`FeatureDistillation` together, injects one fault (an exception in `training_step`, the forward,
the backward, the dataloader, `validation_step`, `optimizer.step` or another callback; a
`KeyboardInterrupt`), and then checks that nothing is left installed: no package hook or patch
(`live_hooks()`, `active_patches()`), no hook in any module's or parameter's hook dicts, the
teacher's flags restored. Each fault is followed by a second, clean fit with the same callbacks
whose logged values must equal a direct computation: a fault leaves no stale state behind.
Completed-run cases (SWA with the monitor, `fit` twice, fit -> validate -> test -> predict,
resume from a mid-epoch checkpoint) check the data the same way.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers.dist_exit import assert_no_c10d_threads_left
from helpers.models import QUIET, ProbeNet, features, reference_stats
from helpers.scripts import run_script
from lightning.pytorch.callbacks import ModelCheckpoint, StochasticWeightAveraging
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_recorder import FeatureDistillation, FeatureStatsMonitor, RecorderCallback
from lightning_recorder._core.hooks import live_hooks
from lightning_recorder._core.patching import active_patches

STEPS = 4  # training steps per fit (batches of 4 rows)
STATS = ("mean", "std", "min", "max", "abs_mean")


class Boom(Exception):
    """The injected fault."""


class Faulty(ProbeNet):
    """ProbeNet that raises at batch 1 of training (or validation) where ``fault`` says."""

    def __init__(self, fault: str | None = None) -> None:
        super().__init__()
        self.fault = fault

    def _due(self, where: str, batch_idx: int | None = None) -> bool:
        index = self.trainer.fit_loop.epoch_loop.batch_idx if batch_idx is None else batch_idx
        return self.fault == where and index == 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body[0](torch.nan_to_num(self.probe(x), 0.0, 0.0, 0.0))
        if self.training and self._due("forward"):
            raise Boom("forward")
        return self.body[2](self.body[1](h))

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        out = self(batch[0])
        if self._due("training_step", batch_idx):
            raise Boom("training_step")
        if self._due("backward", batch_idx):
            out.register_hook(self._fail_backward)
        loss = out.square().mean()
        self.log("train_loss", loss)
        return loss

    @staticmethod
    def _fail_backward(grad: torch.Tensor) -> torch.Tensor:
        raise Boom("backward")

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        if self._due("validation_step", batch_idx) and not self.trainer.sanity_checking:
            raise Boom("validation_step")
        self.log("val_loss", self(batch[0]).square().mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        model = self

        class FailingSGD(torch.optim.SGD):
            def step(self, closure: Any = None) -> Any:  # type: ignore[override]
                if model.fault == "optimizer.step" and model.global_step == 1:
                    if closure is not None:
                        closure()
                    raise Boom("optimizer.step")
                return super().step(closure)

        return FailingSGD(self.parameters(), lr=self.lr)


class FailingRows(Dataset):
    """Rows of ``x``; reading row ``bad`` raises (the dataloader fault)."""

    def __init__(self, x: torch.Tensor, bad: int | None) -> None:
        self.x, self.bad = x, bad

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor]:
        if i == self.bad:
            raise Boom("dataloader")
        return (self.x[i],)


class Batches(pl.Callback):
    """The training batch of each optimizer step, as the model received it."""

    def __init__(self) -> None:
        self.seen: dict[int, torch.Tensor] = {}

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, i: int) -> None:
        self.seen[trainer.global_step] = batch[0].clone()


class FailingCallback(pl.Callback):
    def __init__(self, error: BaseException) -> None:
        self.error = error

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == 2:
            raise self.error


class Records(pl.Callback):
    """After the package's callbacks: the recorded output of body.0 at each recorded batch."""

    def __init__(self) -> None:
        self.outputs: dict[tuple[str, int], torch.Tensor] = {}

    def _grab(self, trainer: pl.Trainer, stage: str, batch_idx: int) -> None:
        cb = RecorderCallback.of(trainer, name="rec")
        if cb.recording:
            self.outputs[(stage, batch_idx)] = cb.get_record_data("feat").detach().clone()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._grab(trainer, "train", trainer.global_step - 1)

    def on_validation_batch_end(self, trainer: pl.Trainer, *args: Any, **kw: Any) -> None:
        self._grab(trainer, "val", args[3])

    def on_test_batch_end(self, trainer: pl.Trainer, *args: Any, **kw: Any) -> None:
        self._grab(trainer, "test", args[3])

    def on_predict_batch_end(self, trainer: pl.Trainer, *args: Any, **kw: Any) -> None:
        self._grab(trainer, "predict", args[3])


def teacher() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))


def make_callbacks(distill_teacher: nn.Module) -> list[pl.Callback]:
    return [
        RecorderCallback(
            {
                "feat": {"type": "ModuleOutputs", "source": "body.0", "detach": True},
                "grad": {"type": "ParameterGrad", "source": "body.0.weight"},
            },
            stages=("train", "val", "test", "predict"),
            name="rec",
        ),
        FeatureStatsMonitor("probe", every_n_steps=1, stats=STATS, histograms=False),
        FeatureDistillation(distill_teacher, {"body.0": "0"}),
        Records(),
    ]


def data(n: int = 4 * STEPS, seed: int = 0) -> torch.Tensor:
    return features(n, seed=seed)


def loader(x: torch.Tensor, bad: int | None = None) -> DataLoader:
    return DataLoader(FailingRows(x, bad), batch_size=4, shuffle=False)


def trainer(tmp: Path, callbacks: list[pl.Callback], **kwargs: Any) -> pl.Trainer:
    options: dict[str, Any] = {
        **QUIET,
        "logger": CSVLogger(tmp, name="faults"),
        "max_steps": STEPS,
        "log_every_n_steps": 1,
        "num_sanity_val_steps": 0,
        "limit_val_batches": 2,
        "callbacks": callbacks,
    }
    options.update(kwargs)
    return pl.Trainer(**options)


def hooks_in(*models: nn.Module) -> list[str]:
    """Every hook left in the hook dicts of the modules and parameters of ``models``."""
    left = []
    for model in models:
        for name, module in model.named_modules():
            for kind in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks"):
                if getattr(module, kind):
                    left.append(f"{name or 'root'}.{kind}")
            if module._backward_pre_hooks:
                left.append(f"{name or 'root'}._backward_pre_hooks")
        for name, param in model.named_parameters():
            if param._backward_hooks or getattr(param, "_post_accumulate_grad_hooks", None):
                left.append(f"{name} (parameter)")
    return left


def assert_clean(model: nn.Module, distill_teacher: nn.Module) -> None:
    assert live_hooks() == []
    assert active_patches() == []
    assert hooks_in(model, distill_teacher) == []
    assert all(p.requires_grad for p in distill_teacher.parameters())  # flags restored
    assert distill_teacher.training


def logged(trainer: pl.Trainer) -> dict[int, dict[str, float]]:
    """The CSV logger's rows: {step: {name: value}}."""
    rows: dict[int, dict[str, float]] = {}
    path = Path(trainer.logger.log_dir) / "metrics.csv"  # type: ignore[union-attr]
    with open(path) as f:
        for row in csv.DictReader(f):
            step = rows.setdefault(int(row["step"]), {})
            step.update({k: float(v) for k, v in row.items() if v and k != "step"})
    return rows


def check_clean_run(tmp: Path, model: Faulty, distill_teacher: nn.Module) -> None:
    """A fresh fit with new callbacks on the same model: the data must equal a direct
    computation (statistics of the probe = statistics of the batch; records = the forward)."""
    model.fault = None
    callbacks = make_callbacks(distill_teacher)
    x = data(seed=3)
    fit = trainer(tmp / "again", callbacks)
    fit.fit(model, loader(x))
    rows = logged(fit)
    for step in range(STEPS):
        expected = reference_stats(x[4 * step : 4 * step + 4])
        for stat in STATS:
            # Float32 streaming statistics against a float64 reference on 16 numbers.
            torch.testing.assert_close(
                rows[step][f"stats/train/probe/{stat}"],
                expected[stat],
                rtol=1e-5,
                atol=1e-6,
            )
        assert "distill/body.0" in rows[step]
    assert_clean(model, distill_teacher)


FAULTS: dict[str, tuple[type[BaseException], dict[str, Any]]] = {
    "training_step": (Boom, {}),
    "forward": (Boom, {}),
    "backward": (Boom, {}),
    "dataloader": (Boom, {"bad": 9}),
    "validation_step": (Boom, {"val_check_interval": 2}),
    "optimizer.step": (Boom, {}),
    "another_callback": (Boom, {"callback": Boom("another callback")}),
    "keyboard_interrupt": (SystemExit, {"callback": KeyboardInterrupt()}),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_fault_leaves_nothing_installed_and_the_next_fit_is_right(
    fault: str, tmp_path: Path, restore_sigint: None
) -> None:
    error, options = FAULTS[fault]
    distill_teacher = teacher()
    model = Faulty(fault)
    callbacks = make_callbacks(distill_teacher)
    extra = options.get("callback")
    if extra is not None:
        callbacks.append(FailingCallback(extra))
    x = data()
    val = loader(data(8, seed=2)) if "val_check_interval" in options else None
    run = trainer(tmp_path, callbacks, val_check_interval=options.get("val_check_interval"))
    with pytest.raises(error):
        run.fit(model, loader(x, options.get("bad")), val)
    assert_clean(model, distill_teacher)
    check_clean_run(tmp_path, model, distill_teacher)


def test_swa_with_the_monitor_logs_the_batches_statistics(tmp_path: Path) -> None:
    distill_teacher = teacher()
    model = Faulty()
    swa = StochasticWeightAveraging(swa_lrs=0.05, swa_epoch_start=1, annealing_epochs=1)
    x = data(8)
    run = trainer(tmp_path, [*make_callbacks(distill_teacher), swa], max_steps=-1, max_epochs=3)
    run.fit(model, loader(x))
    rows = logged(run)
    for step in range(6):  # 2 batches per epoch, 3 epochs (the last two averaging weights)
        expected = reference_stats(x[4 * (step % 2) : 4 * (step % 2) + 4])
        torch.testing.assert_close(  # float32 streaming mean against a float64 reference
            rows[step]["stats/train/probe/mean"], expected["mean"], rtol=1e-5, atol=1e-6
        )
    assert_clean(model, distill_teacher)


def check_records(model: Faulty, records: Records, x: torch.Tensor, stage: str) -> int:
    """Each record of body.0 equals body.0 applied to its batch, with the weights then."""
    found = 0
    for (where, idx), out in records.outputs.items():
        if where != stage:
            continue
        batch = x[4 * idx : 4 * idx + 4]
        # The same Linear on the same rows with the same weights: float32 rounding only.
        torch.testing.assert_close(out, model.body[0](batch), rtol=1e-6, atol=1e-6)
        found += 1
    return found


def test_fit_twice_then_validate_test_predict(tmp_path: Path) -> None:
    distill_teacher = teacher()
    model = Faulty()
    callbacks = make_callbacks(distill_teacher)
    x = data()
    run = trainer(tmp_path, callbacks)
    run.fit(model, loader(x))
    assert_clean(model, distill_teacher)
    run2 = trainer(tmp_path / "second", callbacks, max_steps=2 * STEPS)
    run2.fit(model, loader(x))
    assert_clean(model, distill_teacher)
    records = callbacks[-1]
    assert isinstance(records, Records)
    for stage, call in (
        ("val", run2.validate),
        ("test", run2.test),
        ("predict", run2.predict),
    ):
        records.outputs.clear()
        with torch.no_grad():
            call(model, loader(x))
            expected = 2 if stage == "val" else STEPS  # limit_val_batches=2
            assert check_records(model, records, x, stage) == expected, stage
        assert_clean(model, distill_teacher)


def test_resume_from_a_mid_epoch_checkpoint(tmp_path: Path) -> None:
    distill_teacher = teacher()
    x = data(8 * STEPS)  # 8 batches per epoch; the checkpoint is taken at step 3
    ckpt = ModelCheckpoint(tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    first = trainer(
        tmp_path, [*make_callbacks(distill_teacher), ckpt], max_steps=3, enable_checkpointing=True
    )
    first.fit(Faulty(), loader(x))
    (path,) = sorted((tmp_path / "ckpt").glob("*.ckpt"))
    model = Faulty()
    batches = Batches()
    second = trainer(tmp_path / "resumed", [*make_callbacks(distill_teacher), batches], max_steps=6)
    second.fit(model, loader(x), ckpt_path=str(path))
    rows = logged(second)
    assert sorted(k for k in rows if "stats/train/probe/mean" in rows[k]) == [3, 4, 5]
    assert sorted(batches.seen) == [3, 4, 5]
    for step in (3, 4, 5):  # Lightning restarts a plain loader: compare with what was fed
        expected = reference_stats(batches.seen[step])
        torch.testing.assert_close(  # float32 streaming mean against a float64 reference
            rows[step]["stats/train/probe/mean"], expected["mean"], rtol=1e-5, atol=1e-6
        )
    rec = RecorderCallback.of(second, name="rec")
    assert rec.recorded_steps == 6  # 3 before the checkpoint (restored) + 3 after
    assert_clean(model, distill_teacher)


# --------------------------------------------------------------------------------- DDP
SCRIPT = Path(__file__).resolve().parent / "ddp_faults_script.py"


def ddp_run(out: Path, mode: str) -> list[dict[str, Any]]:
    run_script(SCRIPT, out, mode, timeout=400)
    # Both ranks exited with no thread of the process group left, after a failed fit too (see
    # helpers.dist_exit: a gloo thread still running as the interpreter finalizes can abort it).
    assert_no_c10d_threads_left(out)
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]


def assert_ranks_clean(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        assert rank["live_hooks"] == [] and rank["patches"] == []
        assert rank["module_hooks"] == []
        assert rank["teacher_requires_grad"]


@pytest.mark.slow
def test_ddp_uneven_last_batches_log_the_union_of_both_ranks(tmp_path: Path) -> None:
    ranks = ddp_run(tmp_path, "uneven")
    assert [r["status"] for r in ranks] == ["ok", "ok"]
    assert_ranks_clean(ranks)
    assert [len(r["batches"][1]) for r in ranks] == [1, 1]  # the uneven last batches
    rows = {}
    with open(tmp_path / "ddp" / "version_0" / "metrics.csv") as f:
        for row in csv.DictReader(f):
            rows.setdefault(int(row["step"]), {}).update({k: v for k, v in row.items() if v})
    for step in (0, 1):
        union = torch.cat([r["batches"][step] for r in ranks])
        expected = reference_stats(union)
        for stat in ("mean", "min", "max"):
            torch.testing.assert_close(  # float32 statistics synced over ranks vs float64
                float(rows[step][f"stats/train/probe/{stat}"]),
                expected[stat],
                rtol=1e-5,
                atol=1e-6,
            )


@pytest.mark.slow
def test_ddp_one_failing_rank_leaves_nothing_installed_on_either(tmp_path: Path) -> None:
    ranks = ddp_run(tmp_path, "fail")
    assert ranks[1]["status"].startswith("Boom"), ranks[1]["status"]
    # the other rank's all-reduce fails: rank 1 ended its process group (or, at the latest,
    # the collective's timeout)
    assert ranks[0]["status"] != "ok"
    assert_ranks_clean(ranks)
