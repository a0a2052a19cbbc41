"""Both callbacks configured from YAML through LightningCLI, including the documented configs."""

from __future__ import annotations

import pydoc
import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import yaml
from helpers.distill_models import Student, loader
from helpers.models import DocsNet, TinyClassifier, TinyData, scalars, tiny_data_indices
from lightning.pytorch.cli import LightningCLI

from lightning_recorder import (
    ActivationDataset,
    ActivationWriter,
    DeadUnitsRule,
    FeatureStatsMonitor,
    HealthMonitor,
    RecorderCallback,
)

DOCS = Path(__file__).resolve().parents[2] / "docs"
TRAINER = {
    "max_steps": 4,
    "accelerator": "cpu",
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "enable_checkpointing": False,
    "log_every_n_steps": 2,
}


def run_cli(
    tmp_path: Path,
    config: dict[str, Any],
    model: type = TinyClassifier,
    data: type = TinyData,
) -> LightningCLI:
    config = {
        **config,
        "trainer": {**TRAINER, "default_root_dir": str(tmp_path), **config["trainer"]},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return LightningCLI(
        model,
        data,
        args=["fit", "--config", str(path)],
        save_config_kwargs={"overwrite": True},
    )


def writer_config(tmp_path: Path, sample_index: Any) -> dict[str, Any]:
    """A config of one ActivationWriter of ``body.1`` in training, with ``sample_index``."""
    init_args = {
        "sources": ["body.1"],
        "directory": str(tmp_path / "acts"),
        "stages": ["train"],
        "sample_index": sample_index,
    }
    writer = {"class_path": "lightning_recorder.ActivationWriter", "init_args": init_args}
    return {"trainer": {"callbacks": [writer]}}


def test_both_callbacks_from_yaml(tmp_path: Path) -> None:
    config = yaml.safe_load(
        """
        trainer:
          limit_train_batches: 4
          callbacks:
            - class_path: lightning_recorder.FeatureStatsMonitor
              init_args:
                sources: [torch.nn.Linear, body.1]
                every_n_steps: 2
                stages: [train, val]
                stats: [mean, zero_fraction]
                bins: 16
                prefix: feat
                keep_hooks: true
            - class_path: lightning_recorder.RecorderCallback
              init_args:
                recorders:
                  hidden: {type: ModuleOutputs, source: body.0, detach: true}
                every_n_steps: 1
                stages: train
                name: mine
        """
    )
    cli = run_cli(tmp_path, config)
    monitor = FeatureStatsMonitor.of(cli.trainer)
    recorder = RecorderCallback.of(cli.trainer, name="mine")
    assert monitor.sources == ["torch.nn.Linear", "body.1"]
    assert (monitor.every_n_steps, monitor.stats, monitor.bins) == (
        2,
        ("mean", "zero_fraction"),
        16,
    )
    assert monitor.stages == ("train", "val") and monitor.keep_hooks is True
    assert recorder.stages == ("train",) and recorder.recorded_steps == 4
    assert recorder.keep_hooks is None
    got = scalars(cli.trainer.logger.log_dir)
    assert sorted(got["feat/train/body.1/zero_fraction"]) == [1, 3]
    assert sorted(got["feat/val/body.2/mean"]) == [3]
    assert "feat/train/body.0.weight/update_ratio" in got


def test_bad_yaml_value_is_rejected(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = {
        "trainer": {
            "callbacks": [
                {
                    "class_path": "lightning_recorder.FeatureStatsMonitor",
                    "init_args": {"sources": ["body.0"], "stages": ["training"]},
                }
            ]
        }
    }
    with pytest.raises(SystemExit):
        run_cli(tmp_path, config)
    assert re.search(r"stages.*training", capsys.readouterr().err, re.S)


def test_invalid_regex_in_yaml_fails_before_the_run(tmp_path: Path) -> None:
    config = {
        "trainer": {
            "callbacks": [
                {
                    "class_path": "lightning_recorder.FeatureStatsMonitor",
                    "init_args": {"sources": ["body.0"], "parameters": "re:body.(0"},
                }
            ]
        }
    }
    with pytest.raises(ValueError, match=r"'re:body\.\(0' to hold a valid regular expression"):
        run_cli(tmp_path, config)
    assert not (tmp_path / "lightning_logs").exists()  # no run directory, no saved config


@pytest.mark.parametrize(
    ("callback", "explained"),
    [
        ("HealthMonitor", ["discards the update", "runs a flagged step's batch again"]),
        ("ActivationWriter", ["a function ``(batch, batch_idx) -> indices``"]),
    ],
)
def test_help_explains_every_option(
    callback: str, explained: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """``--help`` shows each argument's own entry of the docstring, without the text above it."""
    with pytest.raises(SystemExit) as exit_info:
        LightningCLI(
            TinyClassifier,
            TinyData,
            args=["fit", "--trainer.callbacks.help", f"lightning_recorder.{callback}"],
        )
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
    assert "see above" not in text
    for words in explained:
        assert words in text


def test_distillation_help_names_functions_that_exist(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        LightningCLI(
            TinyClassifier,
            TinyData,
            args=["fit", "--trainer.callbacks.help", "lightning_recorder.FeatureDistillation"],
        )
    text = "".join(capsys.readouterr().out.split())  # argparse breaks lines inside names too
    named = set(re.findall(r":func:`(lightning_recorder\.[\w.]+)`", text))
    assert named >= {"lightning_recorder.get_loss", "lightning_recorder.resolve_connector"}
    assert [name for name in sorted(named) if not callable(pydoc.locate(name))] == []


@pytest.mark.parametrize("where", [1, "labels"], ids=["position", "key"])
def test_activation_writer_sample_index_survives_the_saved_config(
    tmp_path: Path, where: int | str
) -> None:
    """The config LightningCLI saves holds the batch position or key given, and runs again."""

    class Keyed(TinyData):
        def train_dataloader(self) -> Any:
            samples = [{"x": x, "labels": y} for x, y in zip(self.x, self.y, strict=True)]
            return torch.utils.data.DataLoader(samples, batch_size=self.batch_size)  # type: ignore[arg-type]

    class KeyedClassifier(TinyClassifier):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return super().training_step((batch["x"], batch["labels"]), batch_idx)

    config = writer_config(tmp_path, where)
    model, data = (TinyClassifier, TinyData) if where == 1 else (KeyedClassifier, Keyed)
    cli = run_cli(tmp_path, config, model=model, data=data)
    saved = Path(cli.trainer.log_dir) / "config.yaml"
    (writer,) = yaml.safe_load(saved.read_text())["trainer"]["callbacks"]
    assert writer["init_args"]["sample_index"] == where
    labels = [int(y) for y in TinyData().y[:16]]  # 4 steps of 4 rows: the labels written
    rows = ActivationDataset(tmp_path / "acts").provenance()
    for step in range(4):  # (the rows of a batch are kept in the order of their indices)
        written = [row["sample_index"] for row in rows if row["global_step"] == step]
        assert sorted(written) == sorted(labels[4 * step : 4 * step + 4])
    again = LightningCLI(
        model,
        data,
        args=["fit", "--config", str(saved), "--trainer.max_steps=1"],
        save_config_kwargs={"overwrite": True},
    )
    assert again.trainer.callbacks[0].sample_index == where
    assert len(ActivationDataset(tmp_path / "acts")) == 16 + 4  # the run again wrote one batch


def test_saturation_bounds_from_yaml(tmp_path: Path) -> None:
    """YAML keys are strings: the classes of ``bounds`` are given by their import paths."""
    rule = {
        "class_path": "lightning_recorder.SaturationRule",
        "init_args": {"bounds": {"torch.nn.Tanh": [-0.9, 0.9], "torch.nn.Hardtanh": None}},
    }
    health = {"class_path": "lightning_recorder.HealthMonitor", "init_args": {"rules": [rule]}}
    cli = run_cli(tmp_path, {"trainer": {"callbacks": [health]}})
    (monitor,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, HealthMonitor)]
    (saturation,) = monitor.rules
    assert saturation.bounds == {torch.nn.Tanh: (-0.9, 0.9), torch.nn.Hardtanh: None}
    rule["init_args"] = {"bounds": {"torch.nn.Tanhh": [-0.9, 0.9]}}
    with pytest.raises(ValueError, match=r"keys of `bounds` of SaturationRule .* 'torch.nn.Tanhh'"):
        run_cli(tmp_path, {"trainer": {"callbacks": [health]}})


@pytest.mark.parametrize("page", ["recorder_callback.md", "feature_stats_monitor.md"])
def test_documented_yaml(page: str, tmp_path: Path) -> None:
    blocks = re.findall(r"```yaml\n(.*?)```", (DOCS / page).read_text(), re.S)
    assert len(blocks) == 1
    config = yaml.safe_load(blocks[0])
    cli = run_cli(tmp_path, config, model=DocsNet)
    names = {type(cb).__name__ for cb in cli.trainer.callbacks}
    assert {"RecorderCallback", "FeatureStatsMonitor"} & names


def test_single_statistic_names_from_yaml(tmp_path: Path) -> None:
    """One statistic name, as Python takes it, is taken from YAML too (not refused as no list)."""
    monitor = {
        "class_path": "lightning_recorder.FeatureStatsMonitor",
        "init_args": {
            "sources": ["body.1"],
            "stats": "zero_fraction",
            "logger_stats": {"TensorBoardLogger": "zero_fraction"},
        },
    }
    cli = run_cli(tmp_path, {"trainer": {"callbacks": [monitor]}})
    callback = FeatureStatsMonitor.of(cli.trainer)
    assert callback.stats == ("zero_fraction",)
    assert callback.logger_stats == {"TensorBoardLogger": frozenset({"zero_fraction"})}
    got = scalars(cli.trainer.logger.log_dir)
    assert sorted(got["stats/train/body.1/zero_fraction"]) == [1, 3]
    assert not any(tag.endswith("/mean") or tag.endswith("/norm") for tag in got)


def test_distillation_loss_function_by_import_path_from_yaml(tmp_path: Path) -> None:
    """A loss function in YAML is its import path: the function is the loss (no unknown name)."""
    distill = {
        "class_path": "lightning_recorder.FeatureDistillation",
        "init_args": {
            "teacher": {"class_path": "helpers.models.TinyClassifier", "init_args": {"hidden": 16}},
            "pairs": {"body.2": "body.2"},
            "loss": {"body.2": "torch.nn.functional.l1_loss"},
        },
    }
    config = {"trainer": {"callbacks": [distill], "log_every_n_steps": 1}, "model": {"lr": 0.0}}
    cli = run_cli(tmp_path, config)
    (callback,) = cli.trainer.callbacks[:1]
    got = scalars(cli.trainer.logger.log_dir)["distill/body.2"]
    x = TinyData().x.double()
    student, teacher = cli.model.double(), callback.teacher.double()  # lr=0: both as trained
    with torch.no_grad():
        want = [
            float(torch.nn.functional.l1_loss(student(x[i : i + 4]), teacher(x[i : i + 4])))
            for i in range(0, 16, 4)
        ]
    assert sorted(got) == [0, 1, 2, 3]
    assert [got[step] for step in range(4)] == pytest.approx(want, rel=1e-5)


def test_activation_writer_transform_by_import_path_from_yaml(tmp_path: Path) -> None:
    """A source's ``transform`` in YAML is the import path of the function, which is applied."""
    writer = {
        "class_path": "lightning_recorder.ActivationWriter",
        "init_args": {
            "sources": {"hidden": {"source": "body.1", "transform": "torch.neg"}},
            "directory": str(tmp_path / "acts"),
            "stages": ["train"],
        },
    }
    cli = run_cli(tmp_path, {"trainer": {"callbacks": [writer]}, "model": {"lr": 0.0}})
    rows = ActivationDataset(tmp_path / "acts")
    written = torch.stack([rows[i]["activation"] for i in range(len(rows))])
    with torch.no_grad():  # lr=0: the model as it ran; four steps of four rows
        want = -cli.model.body[:2](TinyData().x[:16])
    torch.testing.assert_close(written, want)


def test_activation_writer_sample_index_function_by_import_path(tmp_path: Path) -> None:
    """A ``sample_index`` function in YAML is its import path: the function gives the indices
    (the string is not taken for a batch key), and the saved config runs again."""
    config = writer_config(tmp_path, "helpers.models.tiny_data_indices")
    cli = run_cli(tmp_path, config)
    assert cli.trainer.callbacks[0].sample_index is tiny_data_indices
    rows = ActivationDataset(tmp_path / "acts").provenance()
    assert sorted(row["sample_index"] for row in rows) == list(range(100, 116))
    saved = Path(cli.trainer.log_dir) / "config.yaml"
    (writer,) = yaml.safe_load(saved.read_text())["trainer"]["callbacks"]
    assert writer["init_args"]["sample_index"] == "helpers.models.tiny_data_indices"
    again = LightningCLI(
        TinyClassifier,
        TinyData,
        args=["fit", "--config", str(saved), "--trainer.max_steps=1"],
        save_config_kwargs={"overwrite": True},
    )
    assert again.trainer.callbacks[0].sample_index is tiny_data_indices


def test_activation_writer_dotted_sample_index_that_names_no_function_is_a_key(
    tmp_path: Path,
) -> None:
    for key in ("meta.index", "torch.float32", "torch.nn", "torch.nn.Linear"):
        assert ActivationWriter(["body.1"], tmp_path, sample_index=key).sample_index == key


def test_one_health_rule_and_one_dead_units_type_from_yaml(tmp_path: Path) -> None:
    """One rule for ``rules`` and one class for ``types``, as Python takes them, from YAML."""
    rule = {
        "class_path": "lightning_recorder.DeadUnitsRule",
        "init_args": {"window": 2, "types": "torch.nn.ReLU"},
    }
    health = {"class_path": "lightning_recorder.HealthMonitor", "init_args": {"rules": rule}}
    monitor = {
        "class_path": "lightning_recorder.FeatureStatsMonitor",
        "init_args": {"sources": "body.*"},
    }
    cli = run_cli(tmp_path, {"trainer": {"callbacks": [monitor, health]}})
    (dead,) = cli.trainer.callbacks[1].rules
    assert isinstance(dead, DeadUnitsRule)
    assert (dead.window, dead.types) == (2, (torch.nn.ReLU,))


@pytest.mark.parametrize(
    "factory",
    ["helpers.models.linear_connector", "lightning_recorder.build_connector"],
)
@pytest.mark.parametrize("per_pair", [False, True], ids=["one", "per-pair"])
def test_distillation_connector_factory_by_import_path_from_yaml(
    tmp_path: Path, factory: str, per_pair: bool
) -> None:
    """A connector factory in YAML is its import path, also one annotated to return a module."""
    distill = {
        "class_path": "lightning_recorder.FeatureDistillation",
        "init_args": {
            "teacher": {"class_path": "helpers.models.TinyClassifier", "init_args": {"hidden": 16}},
            "pairs": {"body.0": "body.0"},
            "connectors": {"body.0": factory} if per_pair else factory,
        },
    }
    cli = run_cli(tmp_path, {"trainer": {"callbacks": [distill]}})
    (connector,) = cli.trainer.callbacks[0].connectors.values()
    assert isinstance(connector, torch.nn.Linear) and connector.bias is None
    assert (connector.in_features, connector.out_features) == (8, 16)
    saved = Path(cli.trainer.log_dir) / "config.yaml"
    (callback,) = yaml.safe_load(saved.read_text())["trainer"]["callbacks"]
    assert callback["init_args"]["connectors"] == distill["init_args"]["connectors"]


def test_wrong_localize_names_the_values_it_takes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        LightningCLI(
            TinyClassifier,
            TinyData,
            args=[
                "fit",
                "--trainer.callbacks+=lightning_recorder.HealthMonitor",
                "--trainer.callbacks.localize=never",
            ],
        )
    err = capsys.readouterr().err
    assert re.search(r"localize.*Literal\['replay', 'always'\].*Literal\[False\]", err, re.S)


@pytest.mark.parametrize(
    "delivery",
    [
        {"type": "FunctionOutputs", "source": "helpers.distill_models.jitter"},
        {
            "class_path": "lightning_recorder.FunctionOutputsDelivery",
            "init_args": {"source": "helpers.distill_models.jitter"},
        },
    ],
    ids=["type-key", "class-path"],
)
def test_distillation_delivery_from_yaml(tmp_path: Path, delivery: dict[str, Any]) -> None:
    """A delivery in YAML as a config dict or as a class path: the student gets the teacher's
    augmentation either way."""
    distill = {
        "class_path": "lightning_recorder.FeatureDistillation",
        "init_args": {
            "teacher": {
                "class_path": "helpers.distill_models.Teacher",
                "init_args": {"use_jitter": True},
            },
            "pairs": {"head": "head"},
            "deliveries": {"noise": delivery},
        },
    }
    config = {"trainer": {**TRAINER, "default_root_dir": str(tmp_path), "callbacks": [distill]}}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    cli = LightningCLI(Student, args=["--config", str(path), "--model.use_jitter=true"], run=False)
    same: list[bool] = []
    teacher = cli.trainer.callbacks[0].teacher

    class SameInput(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, module: Any, *args: Any) -> None:
            same.append(torch.equal(teacher.last_input, module.last_input))

    cli.trainer.callbacks.append(SameInput())
    cli.trainer.fit(cli.model, loader())
    assert same == [True] * 4
