# SPDX-License-Identifier: Apache-2.0
"""``benchmarks/history.py`` (make bench, make bench-check): which median moved beyond a run's A/A noise."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests import scripts

history = scripts.load("benchmarks/history.py", "_bench_history")


def overhead_summary(plugin: float, control_rounds: list[float] | None, vllm: str = "0.30.0") -> dict[str, Any]:
    medians = {"plugin": plugin}
    rounds: dict[str, list[float]] = {"plugin": [plugin]}
    if control_rounds is not None:
        medians["control"] = sorted(control_rounds)[len(control_rounds) // 2]
        rounds["control"] = control_rounds
    return {
        "vllm": vllm,
        "machine": "2 CPUs, AVX-512",
        "workload": {"model": "m", "requests": 64, "tokens": 128},
        "median_ratio_vs_off": medians,
        "round_ratios_vs_off": rounds,
        "median_ratio_plugin_vs_vllm": plugin + 0.01,
    }


def versus_summary(eager: float, control_rounds: list[float]) -> dict[str, Any]:
    def setting(plugin: float) -> dict[str, Any]:
        return {
            "runs": [],
            "plugin/vllm throughput": {"median": plugin, "rounds": [plugin]},
            "plugin/vllm tokens-per-CPU-second": {"median": 5.0, "rounds": [5.0]},
            "vllm-control/vllm throughput": {"median": 1.0, "rounds": control_rounds},
        }

    return {"vllm": "0.30.0", "machine": "x", "workload": {}, "settings": {"eager": setting(eager)}}


def test_noise_band_is_the_aa_medians_offset_plus_its_scatter() -> None:
    # median 1.02 (offset 0.02), deviations 0.02, 0.0, 0.01 -> MAD 0.01
    assert history.noise_band([1.0, 1.02, 1.03]) == pytest.approx(0.03)
    assert history.noise_band([1.0, 1.0, 1.0]) == 0.0


def test_medians_of_each_benchmark_kind() -> None:
    medians, noise = history.medians_of("overhead", overhead_summary(0.98, [0.99, 1.0, 1.01]))
    assert medians == {"plugin/off": 0.98, "control/off": 1.0, "plugin/vllm": pytest.approx(0.99)}
    assert noise == pytest.approx(0.01)
    medians, noise = history.medians_of("versus", versus_summary(1.02, [0.96, 1.0, 1.0]))
    # tokens-per-CPU-second ratios are not guarded (a core's wait is not the plugin's cost): throughput only
    assert medians == {"eager plugin/vllm": 1.02, "eager vllm-control/vllm": 1.0}
    assert noise == pytest.approx(0.0)
    assert history.medians_of("overhead", overhead_summary(0.98, None))[1] is None


def record_runs(path: Path, *summaries: dict[str, Any], kind: str = "overhead") -> None:
    for index, summary in enumerate(summaries):
        history.record(kind, summary, path, at=(f"c{index}", f"t{index}"))


def test_check_names_a_plugin_ratio_that_fell_beyond_the_noise(tmp_path: Path, capsys: Any) -> None:
    path = tmp_path / "history.jsonl"
    record_runs(path, overhead_summary(1.04, [0.99, 1.0, 1.01]), overhead_summary(0.98, [0.99, 1.0, 1.01]))
    assert history.check("overhead", None, path) == 1
    out = capsys.readouterr().out
    assert "plugin/off" in out and "1.0400 -> 0.9800 (-0.0600) MOVED beyond noise" in out
    assert "FAIL: worse beyond the A/A noise: plugin/off, plugin/vllm" in out


def test_check_passes_a_move_within_the_noise_and_a_gain(tmp_path: Path) -> None:
    path = tmp_path / "history.jsonl"
    record_runs(path, overhead_summary(1.00, [0.95, 1.0, 1.05]), overhead_summary(0.97, [0.95, 1.0, 1.05]))
    assert history.check("overhead", None, path) == 0  # band 0.05 > 0.03
    record_runs(path, overhead_summary(1.00, [1.0, 1.0, 1.0]), overhead_summary(1.10, [1.0, 1.0, 1.0]))
    assert history.check("overhead", None, path) == 0  # better is not a failure


def test_check_judges_nothing_without_a_control(tmp_path: Path, capsys: Any) -> None:
    path = tmp_path / "history.jsonl"
    record_runs(path, overhead_summary(1.04, None), overhead_summary(0.90, None))
    assert history.check("overhead", None, path) == 0
    assert "not judged" in capsys.readouterr().out


def test_check_compares_only_the_same_release_machine_and_workload(tmp_path: Path, capsys: Any) -> None:
    path = tmp_path / "history.jsonl"
    other_release = overhead_summary(1.5, [1.0, 1.0, 1.0], vllm="0.23.0")
    other_machine = {**overhead_summary(1.5, [1.0, 1.0, 1.0]), "machine": "16 CPUs"}
    record_runs(path, overhead_summary(1.0, [1.0, 1.0, 1.0]), other_release, other_machine)
    assert history.check("overhead", "0.30.0", path) == 0
    assert "nothing to compare" in capsys.readouterr().out  # the 16-CPU run has no earlier twin
    record_runs(path, overhead_summary(0.5, [1.0, 1.0, 1.0]))
    assert history.check("overhead", "0.30.0", path) == 1  # against the first run, not the 16-CPU one
    assert "c0 (t0) -> c0 (t0)" in capsys.readouterr().out  # record_runs numbers each call's runs from c0


def test_record_writes_the_commit_and_versus_runs_are_guarded(tmp_path: Path) -> None:
    path = tmp_path / "history.jsonl"
    entry = history.record("versus", versus_summary(1.02, [1.0, 1.0, 1.0]), path)
    assert entry["commit"] == history.commit() and entry["commit"] != "unknown"
    history.record("versus", versus_summary(0.95, [1.0, 1.0, 1.0]), path)
    assert [json.loads(line)["kind"] for line in path.read_text().splitlines()] == ["versus", "versus"]
    assert history.check("versus", None, path) == 1


def test_the_committed_history_reads_back() -> None:
    entries = history.load()
    assert entries, "benchmarks/results/history.jsonl holds the recorded runs"
    for entry in entries:
        assert set(entry) >= {"kind", "vllm", "machine", "commit", "time", "medians", "noise", "workload"}
