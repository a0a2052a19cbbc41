"""The lower bounds of ``pyproject.toml`` are honest: no bound is older than the first release of
an API that the package, or what an extra is for, calls.

The environments of the tests hold one release of each dependency, the newest, so an older
release named as a lower bound is never run here. Each rule below is a fact about the
dependency's releases (checked once by installing them) together with the code that relies on
it: where the code still uses the API, the bound must be at least that release.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, as a package
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


@dataclass(frozen=True)
class Rule:
    """Code matching ``pattern`` in ``files`` needs ``requirement`` >= ``since``, which
    ``group`` (``"dependencies"`` or an extra's name) must require."""

    requirement: str
    since: tuple[int, ...]
    group: str
    files: str
    pattern: str
    why: str
    # The code was changed not to need that release: the rule keeps it from coming back.
    guard: bool = False


RULES = (
    Rule(
        "torch",
        (2, 4),
        "dependencies",
        "lightning_recorder/**/*.py",
        r"torch\.is_autocast_enabled\(\s*\w",
        "torch.is_autocast_enabled takes a device type from torch 2.4 (2.3: 'takes no "
        "arguments'); the statistics engine calls it at every logging step",
    ),
    Rule(
        "torch",
        (2, 4),
        "dependencies",
        "lightning_recorder/**/*.py",
        r"torch\.amp\.is_autocast_available\(",
        "torch.amp.is_autocast_available is new in torch 2.4; the statistics engine calls it at "
        "every logging step",
    ),
    Rule(
        "torch",
        (2, 3),
        "dependencies",
        "lightning_recorder/**/*.py",
        r"from torch\.compiler import is_compiling",
        "torch.compiler.is_compiling is new in torch 2.3 (not in 2.1 or 2.2): there "
        "`import lightning_recorder` fails",
    ),
    Rule(
        "tensorboard",
        (2, 12),
        "fast-tensorboard",
        "lightning_recorder/**/*.py",
        r"from tensorboard\.compat\.proto\.event_pb2 import .*SourceMetadata",
        "event_pb2.SourceMetadata is new in TensorBoard 2.12: with 2.11 the package's "
        "TensorBoardLogger finds no C checksum and asks to install the extra installed",
    ),
    Rule(
        "torchmetrics",
        (1, 6),
        "dependencies",
        "lightning_recorder/**/*.py",
        r"super\(\)\.merge_state\(",
        "torchmetrics' Metric.merge_state is new in torchmetrics 1.6 (1.0 to 1.5: "
        "AttributeError); FeatureStats.merge_state adds the incoming state through it",
    ),
    Rule(
        "lightning",
        (2, 4),
        "dependencies",
        "examples/*.py",
        r"seed_everything\([^)]*verbose=",
        "seed_everything(verbose=...) is new in Lightning 2.4 (2.1: 'unexpected keyword "
        "argument'); the examples run with the package's own Lightning lower bound",
        guard=True,
    ),
)


def lower_bound(group: str, requirement: str) -> tuple[int, ...]:
    """The ``>=`` version of ``requirement`` in ``group`` of pyproject.toml."""
    project = PYPROJECT["project"]
    specs = (
        project["dependencies"]
        if group == "dependencies"
        else project["optional-dependencies"][group]
    )
    for spec in specs:
        found = re.fullmatch(rf"{re.escape(requirement)}(?:\[[^\]]*\])?>=([0-9.]+)", spec)
        if found:
            return tuple(int(part) for part in found.group(1).split("."))
    raise AssertionError(f"no lower bound of {requirement} in {group}: {specs}")


def users(rule: Rule) -> list[str]:
    """The files (relative to the root) whose code matches the rule's pattern."""
    pattern = re.compile(rule.pattern)
    return sorted(
        str(path.relative_to(ROOT))
        for path in ROOT.glob(rule.files)
        if pattern.search(path.read_text(encoding="utf-8"))
    )


def test_the_rules_still_find_the_code_they_were_written_for() -> None:
    """A rule whose code is gone says nothing: each (but a guard) must find its code."""
    for rule in RULES:
        assert rule.guard or users(rule), rule


@pytest.mark.parametrize("rule", RULES, ids=lambda r: f"{r.requirement}>={r.since}:{r.group}")
def test_no_lower_bound_is_older_than_an_api_the_code_calls(rule: Rule) -> None:
    where = users(rule)
    if not where:
        return  # the code no longer needs that release
    bound = lower_bound(rule.group, rule.requirement)
    shown = ".".join(map(str, bound))
    assert bound >= rule.since, (
        f"{rule.group}: {rule.requirement}>={shown}, but {', '.join(where)}: {rule.why}"
    )
