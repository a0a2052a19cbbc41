"""FeatureStatsMonitor and the recorders on a torchvision-style ResNet, values read back."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from helpers.models import scalars
from lightning.pytorch.loggers import TensorBoardLogger
from realmodels.models import (
    QUIET,
    Bottleneck,
    ImageClassifier,
    StepCapture,
    image_loader,
    modules_of_type,
    resnet_basic,
    resnet_bottleneck,
    stats_of,
)
from torch import nn

from lightning_recorder import FeatureStatsMonitor, RecorderCallback, RecorderManager
from lightning_recorder.errors import RecorderConfigError, RecordModifiedError, UnknownSourceError

STATS = ("mean", "std", "min", "max", "abs_mean", "zero_fraction", "nonfinite")


def fit_monitored(
    tmp_path: Path,
    monitor: FeatureStatsMonitor,
    names: list[str],
    model: pl.LightningModule | None = None,
    **trainer: Any,
) -> tuple[dict[str, dict[int, float]], StepCapture, list[warnings.WarningMessage]]:
    """Fit 4 steps (statistics on steps 1 and 3), with a reference copying ``names``' outputs."""
    torch.manual_seed(0)
    model = model if model is not None else ImageClassifier(resnet_basic())
    reference = StepCapture(names)
    logger = TensorBoardLogger(tmp_path, name="run")
    options = {"max_steps": 4, "log_every_n_steps": 2, **trainer}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pl.Trainer(**QUIET, logger=logger, callbacks=[monitor, reference], **options).fit(
            model, image_loader()
        )
    return scalars(logger.log_dir), reference, caught


def check_logged(
    logged: dict[str, dict[int, float]],
    monitor: FeatureStatsMonitor,
    reference: StepCapture,
    names: list[str],
    steps: tuple[int, ...] = (1, 3),
    rtol: float = 1e-5,
) -> None:
    """Every statistic of every module at every logged step equals the direct computation.

    The monitor sums float32 data in float32 pairwise and TensorBoard stores float32: the
    documented error is about 1e-6 relative, so 1e-5 (and 1e-6 absolute, for values near 0)
    can only fail on a real difference; min, max and counts are float32-exact.
    """
    for step in steps:
        for name in names:
            expected = stats_of(reference.outputs[step][name])
            for stat in STATS:
                got = logged[monitor.tag("train", name, stat)][step]
                torch.testing.assert_close(
                    torch.tensor(got, dtype=torch.float64),
                    torch.tensor(expected[stat], dtype=torch.float64),
                    rtol=rtol,
                    atol=1e-6,
                    msg=lambda m, n=name, s=stat, k=step: f"{n} {s} step {k}: {m}",
                )


def norm_names(model: nn.Module) -> list[str]:
    return list(modules_of_type(model, nn.BatchNorm2d))


# ------------------------------------------------------------------ 1. in-place ReLU after BN
def test_monitor_defaults_log_batchnorm_outputs_before_inplace_relu(tmp_path: Path) -> None:
    model = ImageClassifier(resnet_basic())
    names = norm_names(model) + list(modules_of_type(model, nn.Conv2d))
    monitor = FeatureStatsMonitor([nn.Conv2d, "BatchNorm2d"])  # every default
    logged, reference, caught = fit_monitored(tmp_path, monitor, names, model)
    words = ("in place", "clone", "FeatureStatsMonitor", "BatchNorm", "net.")
    ours = [w for w in caught if any(word in str(w.message) for word in words)]
    assert len(ours) <= 1, [str(w.message) for w in ours]
    check_logged(logged, monitor, reference, names)


def test_monitor_with_clone_logs_batchnorm_outputs_before_inplace_relu(tmp_path: Path) -> None:
    model = ImageClassifier(resnet_basic())
    names = norm_names(model)
    monitor = FeatureStatsMonitor(["BatchNorm2d"], clone=True)
    logged, reference, _ = fit_monitored(tmp_path, monitor, names, model)
    # every BatchNorm output feeds an in-place op, so a stale record would have zero_fraction > 0
    assert all(logged[monitor.tag("train", n, "zero_fraction")][1] == 0.0 for n in names)
    check_logged(logged, monitor, reference, names)


def test_recorder_manager_raises_on_inplace_modified_batchnorm_output() -> None:
    model = resnet_basic().train()
    manager = RecorderManager({"bn": {"type": "ModuleOutputs", "source": "bn1"}})
    manager.initialize(model)
    with manager:
        model(torch.randn(2, 3, 16, 16))
    with pytest.raises(RecordModifiedError, match=r"'bn1'.*modified in place.*clone=True"):
        manager.get_recorder("bn").get_record_data()
    manager.release()


def test_recorder_callback_raises_on_inplace_modified_batchnorm_output() -> None:
    class Reader(ImageClassifier):
        def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            RecorderCallback.of(self).get_record_data("bn")
            return loss

    callback = RecorderCallback({"bn": {"type": "ModuleOutputs", "source": "net.layer1.0.bn2"}})
    trainer = pl.Trainer(**QUIET, logger=False, max_steps=1, callbacks=[callback])
    with pytest.raises(RecordModifiedError, match=r"net\.layer1\.0\.bn2.*modified in place"):
        trainer.fit(Reader(resnet_basic()), image_loader())


# ------------------------------------------------------------------ 2. bare class names
def test_bare_class_name_selects_blocks_defined_outside_torch_nn() -> None:
    model = ImageClassifier(resnet_bottleneck())
    manager = RecorderManager({"blocks": {"type": "ModuleOutputs", "source": "Bottleneck"}})
    manager.initialize(model)
    try:
        streams = [stream.name for _, stream in manager.streams()]
    finally:
        manager.release()
    assert streams == list(modules_of_type(model, Bottleneck))
    assert streams == [f"net.layer{i}.0" for i in range(1, 5)]


def test_unknown_name_error_lists_close_module_and_class_names() -> None:
    manager = RecorderManager({"blocks": {"type": "ModuleOutputs", "source": "Bottlenek"}})
    with pytest.raises(UnknownSourceError, match=r"(?s)module names.*class(es)?[^.]*'Bottleneck'"):
        manager.initialize(ImageClassifier(resnet_bottleneck()))


# ------------------------------------------------------------------ 4. glob semantics
def test_star_crosses_dots_as_documented() -> None:
    model = ImageClassifier(resnet_basic())
    manager = RecorderManager({"blocks": {"type": "ModuleOutputs", "source": "net.layer*.0"}})
    manager.initialize(model)
    try:
        streams = [stream.name for _, stream in manager.streams()]
    finally:
        manager.release()
    blocks = [f"net.layer{i}.0" for i in range(1, 5)]
    # `*` is fnmatch's: it matches dots too, so the downsample convs come along
    downsample = [f"net.layer{i}.0.downsample.0" for i in (2, 3)]
    assert sorted(streams) == sorted(blocks + downsample)


def test_regex_source_selects_one_level() -> None:
    model = ImageClassifier(resnet_basic())
    manager = RecorderManager(
        {"blocks": {"type": "ModuleOutputs", "source": r"re:net\.layer\d\.0"}}
    )
    manager.initialize(model)
    try:
        streams = [stream.name for _, stream in manager.streams()]
    finally:
        manager.release()
    assert streams == [f"net.layer{i}.0" for i in range(1, 5)]


def test_parameters_of_a_block_include_every_parameter_inside_it(tmp_path: Path) -> None:
    model = ImageClassifier(resnet_basic())
    monitor = FeatureStatsMonitor(["net.layer2.0"], histograms=False, clone=True)
    logged, _, _ = fit_monitored(tmp_path, monitor, [], model)
    inside = [n for n, _ in model.named_parameters() if n.startswith("net.layer2.0.")]
    assert len(inside) == 9  # 2 convs, 2 BN (weight, bias), downsample conv + BN
    got = {t.split("/")[2] for t in logged if t.endswith("/norm")}
    assert got == set(inside)
    expected = dict(model.named_parameters())
    for name in inside:  # the last logged step is the last step: norms of the final weights
        torch.testing.assert_close(
            torch.tensor(logged[monitor.tag("train", name, "norm")][3]),
            expected[name].detach().norm(),
            # The monitor's norm and `Tensor.norm` sum up to 64*64*3*3 squares in their own
            # (vectorised, cascade) orders: float32 error about log2(n)*eps ~ 1e-6 relative; 1e-5
            # leaves margin for any CPU's vector width and is far below a wrong step's change.
            rtol=1e-5,
            atol=0.0,
        )


def test_parameters_can_be_limited_by_pattern(tmp_path: Path) -> None:
    monitor = FeatureStatsMonitor(
        ["net.layer2.0"], histograms=False, clone=True, parameters=["net.layer2.0.conv*.weight"]
    )
    logged, _, _ = fit_monitored(tmp_path, monitor, [])
    got = {t.split("/")[2] for t in logged if t.endswith("/norm")}
    assert got == {"net.layer2.0.conv1.weight", "net.layer2.0.conv2.weight"}


def test_parameters_option_rejects_other_values() -> None:
    with pytest.raises(RecorderConfigError, match=r"`parameters`.*bool, a parameter name"):
        FeatureStatsMonitor(["net.layer2.0"], parameters=3)  # type: ignore[arg-type]
    with pytest.raises(RecorderConfigError, match=r"`parameters`.*non-empty list"):
        FeatureStatsMonitor(["net.layer2.0"], parameters=[])


def test_parameter_pattern_outside_the_monitored_modules_is_an_error(tmp_path: Path) -> None:
    monitor = FeatureStatsMonitor(["net.layer2.0"], clone=True, parameters="net.fc.weight")
    trainer = pl.Trainer(
        **QUIET, max_steps=1, callbacks=[monitor], logger=TensorBoardLogger(tmp_path)
    )
    with pytest.raises(
        UnknownSourceError,
        match=r"`parameters`.*monitored modules, but 'net\.fc\.weight' is a parameter of "
        r"'net\.fc', which is not monitored\. Add 'net\.fc' to `sources`",
    ):
        trainer.fit(ImageClassifier(resnet_basic()), image_loader())


def test_unknown_name_suggests_the_name_under_the_lightning_module(tmp_path: Path) -> None:
    monitor = FeatureStatsMonitor(["layer1"])
    trainer = pl.Trainer(
        **QUIET, max_steps=1, callbacks=[monitor], logger=TensorBoardLogger(tmp_path)
    )
    with pytest.raises(UnknownSourceError, match=r"'layer1'.*'net\.layer1'"):
        trainer.fit(ImageClassifier(resnet_basic()), image_loader())


def test_unknown_name_error_says_names_are_relative_to_the_lightning_module(
    tmp_path: Path,
) -> None:
    monitor = FeatureStatsMonitor(["layer1"])
    trainer = pl.Trainer(
        **QUIET, max_steps=1, callbacks=[monitor], logger=TensorBoardLogger(tmp_path)
    )
    with pytest.raises(UnknownSourceError, match=r"relative to the LightningModule.*'net\.layer1'"):
        trainer.fit(ImageClassifier(resnet_basic()), image_loader())


# ------------------------------------------------------------------ 6. bf16-mixed on CPU
def test_bf16_mixed_statistics_finite_and_correct(tmp_path: Path) -> None:
    model = ImageClassifier(resnet_basic())
    names = [*modules_of_type(model, nn.Conv2d), "net.fc"]
    monitor = FeatureStatsMonitor([nn.Conv2d, "net.fc"], histograms=False)
    logged, reference, _ = fit_monitored(tmp_path, monitor, names, model, precision="bf16-mixed")
    assert reference.outputs[1]["net.conv1"][0].dtype == torch.bfloat16  # autocast was on
    values = torch.tensor([v for tag in logged for v in logged[tag].values()])
    assert torch.isfinite(values).all()
    # The reference holds the very bf16 values the monitor saw; the monitor upcasts them exactly
    # and sums in float32, so float32 tolerances (not bf16's 4e-3) apply to the statistics.
    check_logged(logged, monitor, reference, names)
