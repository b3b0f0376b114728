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


def test_record_keeps_the_rounds_by_the_medians_names(tmp_path: Path) -> None:
    entry = history.record("versus", versus_summary(1.02, [0.96, 1.0, 1.0]), tmp_path / "h.jsonl", at=("c", "t"))
    assert entry["rounds"] == {"eager plugin/vllm": [1.02], "eager vllm-control/vllm": [0.96, 1.0, 1.0]}
    overhead = history.rounds_of("overhead", overhead_summary(0.98, [0.99, 1.0, 1.01]))
    assert overhead == {"plugin/off": [0.98], "control/off": [0.99, 1.0, 1.01]}


def test_the_bootstrap_interval_is_seeded_and_holds_the_median() -> None:
    values = [0.9, 0.95, 0.98, 1.0, 1.01, 1.02, 1.05, 1.1, 0.97, 1.03]
    low, high = history.bootstrap_median_interval(values, resamples=2000)
    assert history.bootstrap_median_interval(values, resamples=2000) == (low, high)
    assert 0.9 <= low < 1.005 < high <= 1.1  # the sample median, 1.005, inside; never beyond the data
    assert history.bootstrap_median_interval([1.0] * 5, resamples=100) == (1.0, 1.0)


def test_pooled_takes_the_runs_timed_like_the_newest(tmp_path: Path, capsys: Any) -> None:
    path = tmp_path / "history.jsonl"
    other = {**versus_summary(0.5, [0.5, 0.5]), "workload": {"engine": "another method"}}
    record_runs(path, versus_summary(1.1, [0.9, 1.0]), other, versus_summary(0.9, [1.0, 1.1, 1.2]), kind="versus")
    runs = history.pooled_runs(history.load(path), "versus", "0.30.0")
    assert [run["commit"] for run in runs] == ["c0", "c2"]  # the other workload's run is left out
    ratios = {ratio.name: ratio for ratio in history.pool(runs)}
    assert ratios["eager plugin/vllm"].rounds == [1.1, 0.9] and ratios["eager plugin/vllm"].at_or_above_1 == 1
    assert ratios["eager vllm-control/vllm"].median == 1.0
    assert history.pooled("versus", None, path, ["c0", "c2"]) == 0
    assert "eager plugin/vllm" in capsys.readouterr().out
    with pytest.raises(ValueError, match="not timed alike"):
        history.pooled_runs(history.load(path), "versus", None, ["c0", "c1"])
    with pytest.raises(ValueError, match="no versus run"):
        history.pooled_runs(history.load(path), "versus", None, ["c9"])


def test_the_pooled_numbers_in_the_docs_come_from_the_stored_rounds() -> None:
    """docs/performance.md and the README quote the three fresh, primed compiled runs on 0.30.0 pooled: this is the
    computation, on the rounds committed in benchmarks/results/history.jsonl."""
    runs = history.pooled_runs(history.load(), "versus", "0.30.0", ["e28b583", "02f011f", "62ff0f1"])
    ratios = {ratio.name: ratio for ratio in history.pool(runs)}
    plugin, control = ratios["compiled plugin/vllm"], ratios["compiled vllm-control/vllm"]
    low, high = history.bootstrap_median_interval(plugin.rounds)
    quoted = f"**{plugin.median:.4f}** ({plugin.at_or_above_1} of {len(plugin.rounds)} rounds ≥ 1; bootstrap 95% "
    quoted += f"interval of the median {low:.3f}–{high:.3f}) | {control.median:.4f} ({control.at_or_above_1} of 30 ≥ 1)"
    root = Path(__file__).resolve().parents[1]
    assert quoted in (root / "docs" / "performance.md").read_text()
    readme = " ".join((root / "README.md").read_text().split())
    quoted = f"(compiled, 30 rounds: ratio {plugin.median:.4f}, where vLLM against itself measured "
    quoted += f"{control.median:.4f};"
    assert quoted in readme
