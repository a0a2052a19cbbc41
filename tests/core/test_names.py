"""How string sources select modules: bare class names, ``re:`` regexes, the error messages."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from lightning_recorder import FeatureStatsMonitor, RecorderCallback, RecorderManager
from lightning_recorder._core.names import as_module_type, resolve_type, select
from lightning_recorder.bulk import ForwardOutputsCollector
from lightning_recorder.errors import RecorderConfigError, UnknownSourceError


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).relu()


class WideBlock(Block):
    """A subclass: selected by its base class name too."""


def other_block_class() -> type[nn.Module]:
    """A different class that is also named ``Block`` (as two libraries might define)."""

    class Block(nn.Module):  # the same name on purpose
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * 2

    return Block


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = Block()
        self.stages = nn.Sequential(Block(), WideBlock())
        self.head = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.stem(x)))


def selected(model: nn.Module, source: str) -> list[str]:
    manager = RecorderManager({"r": {"type": "ModuleOutputs", "source": source}})
    manager.initialize(model)
    try:
        return [stream.name for _, stream in manager.streams()]
    finally:
        manager.release()


def test_bare_class_name_selects_instances_and_subclasses() -> None:
    assert selected(Net(), "Block") == ["stem", "stages.0", "stages.1"]
    assert selected(Net(), "WideBlock") == ["stages.1"]


def test_bare_class_name_selects_every_class_of_that_name() -> None:
    model = Net()
    model.extra = other_block_class()()
    assert selected(model, "Block") == ["stem", "stages.0", "stages.1", "extra"]
    # the dotted path picks one of them
    assert selected(model, f"{__name__}.Block") == ["stem", "stages.0", "stages.1"]


def test_a_module_named_like_a_class_wins_over_the_class() -> None:
    model = Net()
    model.Block = nn.Linear(3, 3)  # an attribute spelled like the class
    assert selected(model, "Block") == ["Block"]


def test_torch_nn_names_keep_meaning_the_torch_nn_class() -> None:
    assert as_module_type("Linear") is nn.Linear
    assert selected(Net(), "Linear") == ["stem.proj", "stages.0.proj", "stages.1.proj", "head"]


def test_bulk_types_take_a_bare_class_name_defined_elsewhere() -> None:
    model = Net()
    with ForwardOutputsCollector().modules(model, types="WideBlock") as collector:
        model(torch.randn(2, 3))
        assert collector.names == ("stages.1",)


def test_resolve_type_rejects_a_name_no_class_has() -> None:
    with pytest.raises(RecorderConfigError, match=r"'Blokk'.*Closest module classes.*'Block'"):
        resolve_type("Blokk")


def test_resolve_type_names_a_missing_class_of_a_path_and_the_closest() -> None:
    with pytest.raises(
        RecorderConfigError, match=r"'torch\.nn' has no attribute 'Tanhh'.*Closest.*'Tanh'"
    ) as info:
        resolve_type("torch.nn.Tanhh")
    assert "NoneType" not in str(info.value)
    with pytest.raises(RecorderConfigError, match=r"torch\.nn\.functional\.tanh is a function"):
        resolve_type("torch.nn.functional.tanh")


def test_unknown_class_name_lists_close_module_and_class_names() -> None:
    with pytest.raises(
        UnknownSourceError,
        match=r"(?s)'WideBlok'.*module names include.*Closest class names: 'WideBlock'",
    ):
        selected(Net(), "WideBlok")


def test_regex_matches_whole_names_one_level() -> None:
    assert selected(Net(), r"re:stages\.\d") == ["stages.0", "stages.1"]
    assert selected(Net(), "stages.*") == [
        "stages.0",
        "stages.0.proj",
        "stages.1",
        "stages.1.proj",
    ]  # `*` crosses dots
    assert selected(Net(), "stages.[!.]") == ["stages.0", "stages.1"]


def test_regex_errors() -> None:
    with pytest.raises(RecorderConfigError, match=r"valid regular expression"):
        selected(Net(), "re:stages.(")
    with pytest.raises(UnknownSourceError, match=r"regular expression 're:stage\\\\\.\\\\d'"):
        selected(Net(), r"re:stage\.\d")


@pytest.mark.parametrize(
    "make",
    [
        lambda: RecorderManager({"r": {"type": "ModuleOutputs", "source": "re:stages.("}}),
        lambda: RecorderManager({"r": {"type": "ParameterGrad", "source": "re:stages.("}}),
        lambda: FeatureStatsMonitor(["re:stages.("]),
        lambda: FeatureStatsMonitor(["stages.0"], parameters=["stages.*", "re:stages.("]),
        lambda: RecorderCallback({"r": {"type": "ModuleInputs", "source": "re:stages.("}}),
    ],
    ids=["manager", "parameter", "monitor-sources", "monitor-parameters", "callback"],
)
def test_invalid_regex_is_refused_when_given(make: Callable[[], object]) -> None:
    """An invalid ``re:`` source fails where it is given, not when a run first matches it."""
    with pytest.raises(RecorderConfigError, match=r"'re:stages\.\(' to hold a valid regular"):
        make()


def test_unknown_name_says_names_are_relative() -> None:
    model = nn.Sequential()
    model.add_module("net", Net())
    with pytest.raises(
        UnknownSourceError, match=r"relative to the LightningModule.*'net\.stages\.0'"
    ):
        selected(model, "stages.0")
    with pytest.raises(UnknownSourceError, match=r"No parameter named 'head\.weight'"):
        select(dict(model.named_parameters()), "head.weight", "parameter")
