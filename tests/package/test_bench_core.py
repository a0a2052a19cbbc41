"""The core benchmark and the benchmark runner work (a tiny run; timings are not checked)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from helpers.benchmarks import load_benchmark


def test_measure_times_every_variant_and_the_table_judges_the_targets() -> None:
    bench = load_benchmark("bench_core")
    results = bench.measure(rounds=2, steps=1, warmup=1)
    assert list(results) == [
        "none",
        "none, again",
        "hand hooks",
        "recorder",
        "recorder idle",
        "recorder suspended",
    ]
    for ms, ratios in results.values():
        assert ms > 0
        assert set(ratios) == set(results)
    assert results["none"][1]["none"] == 1.0
    lines = bench.table(results).splitlines()
    assert lines[0].split("|")[1].strip() == "variant"
    assert len(lines) == 2 + len(results)
    judged = {line.split("|")[1].strip(): line.split("|")[-2].strip() for line in lines[2:]}
    assert judged["none"] == "-"
    assert judged["recorder"] in ("pass", "FAIL")
    assert judged["recorder idle"] in ("pass", "FAIL")


def test_table_marks_a_missed_target() -> None:
    bench = load_benchmark("bench_core")
    names = ["none", "none, again", "hand hooks", "recorder", "recorder idle"]
    results = {n: (1.0, dict.fromkeys(names, 1.0)) for n in names}
    results["recorder"] = (1.1, {**dict.fromkeys(names, 1.1), "hand hooks": 1.05})
    rows = {r.split("|")[1].strip(): r for r in bench.table(results).splitlines()[2:]}
    assert rows["recorder"].split("|")[-2].strip() == "FAIL"
    assert rows["recorder idle"].split("|")[-2].strip() == "pass"


def test_runner_finds_the_benchmarks_and_rejects_unknown_names(
    capsys: pytest.CaptureFixture[str],
) -> None:
    runner = load_benchmark("run")
    assert "core" in runner.discover()
    with pytest.raises(SystemExit) as exit_info:
        runner.main(["--only", "no_such_benchmark"])
    assert exit_info.value.code == 2
    assert "unknown benchmark(s) 'no_such_benchmark'" in capsys.readouterr().err


def test_runner_calls_main_with_quick(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runner = load_benchmark("run")
    script = tmp_path / "bench_probe.py"
    out = tmp_path / "out.txt"
    script.write_text(
        "import sys\n"
        "def main(quick: bool = False) -> None:\n"
        f"    open({str(out)!r}, 'w').write(f'{{quick}} {{sys.argv[1:]}}')\n"
    )
    monkeypatch.setattr(sys, "argv", ["run.py", "--quick"])
    runner.call_main(script, quick=True)
    assert out.read_text() == "True []"
