"""The package's on/off environment switches (``switched_on``)."""

from __future__ import annotations

import warnings

import pytest

from lightning_recorder._core import checks
from lightning_recorder.errors import RecorderConfigError
from lightning_recorder.stats import compile_status

SWITCH = "LIGHTNING_RECORDER_SWITCH_OF_THIS_TEST"


@pytest.mark.parametrize(
    ("value", "on"),
    [("0", False), (" Off ", False), ("false", False), ("NO", False), ("1", True), ("yes", True)],
)
def test_a_switch_reads_the_documented_values_without_a_word(
    value: str, on: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SWITCH, value)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert checks.switched_on(SWITCH) is on


def test_a_value_that_is_neither_on_nor_off_is_taken_as_on_with_one_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # `LIGHTNING_RECORDER_COMPILE=of` kept compiling without a word
    monkeypatch.setattr(checks, "_TOLD", set())
    monkeypatch.setenv("LIGHTNING_RECORDER_COMPILE", "of")
    with pytest.warns(UserWarning, match=r"LIGHTNING_RECORDER_COMPILE='of' is neither on .* off"):
        status = compile_status()
    assert not status.startswith("off")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per value
        assert checks.switched_on("LIGHTNING_RECORDER_COMPILE")


def test_a_misspelt_name_gets_the_closest_valid_ones() -> None:
    """Where a message lists what is valid, a misspelt name also gets its close matches."""
    with pytest.raises(RecorderConfigError, match=r"'float61'\. Closest dtype names: 'float64'"):
        checks.parse_dtype("float61")
    with pytest.raises(RecorderConfigError, match=r"got 3\.$"):  # no name: nothing to match
        checks.parse_dtype(3)  # type: ignore[arg-type]
    assert checks.closest_hint("stdd", ["std", "mean"], "names") == " Closest names: 'std'."
    assert checks.closest_hint("zzz", ["std", "mean"], "names") == ""
