"""The health benchmarks work: the false-alarm count and the cost of the rules and the view (tiny
runs; neither the alarms of so short a run nor the timings are judged)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.benchmarks import load_benchmark


def test_false_alarm_run_counts_steps_checks_and_events(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = load_benchmark("health_false_alarms")
    out = tmp_path / "alarms.json"
    results = bench.main(["--steps", "30", "--every", "10", "--json", str(out)])
    assert [r["run"] for r in results] == list(bench.RUNS)
    for r in results:
        assert r["steps"] == 30 and r["every"] == 10
        assert r["checks"] == 3  # steps 9, 19, 29
        assert r["events"] == sum(r["by_rule"].values())
        assert r["per_10k"] == pytest.approx(1e4 * r["events"] / 30)
        assert 0.0 <= r["accuracy"] <= 1.0 and r["wall_s"] > 0
        assert r["nonfinite"] == 0 and r["lightning_spikes"] >= 0
    assert json.loads(out.read_text()) == results
    printed = capsys.readouterr().out
    rows = [line for line in printed.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + len(results) + 1  # header, a row per run, all
    assert "(budget <= 1)" in rows[-1]


def test_false_alarm_run_rejects_an_unknown_run() -> None:
    bench = load_benchmark("health_false_alarms")
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--runs", "lstm"])
    assert exit_info.value.code == 2


def test_cost_benchmark_quick_run_measures_every_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load_benchmark("bench_health_rules")
    result = bench.main(["--quick", "--default-malloc", "--models", "CNN (digits)"])
    figures = result["models"]["CNN (digits)"]
    assert set(figures["ratio"]) == {label for label, *_ in bench.RATIOS}
    assert all(ratio > 0 for ratio in figures["ratio"].values())
    assert figures["redraws_in_window"] >= 2  # logged steps 10 and 20 (and any rule firing)
    assert figures["redraw_alone_ms"] > 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| CNN")]
    assert len(rows) == len(bench.RATIOS) + 1
    assert "<= 1.05" in rows[0]
