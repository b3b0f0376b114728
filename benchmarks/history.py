#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The guard on ``make bench``: every run's medians recorded with its commit, and a check that compares the newest
run with the one before it (same benchmark, vLLM release and machine type).

    python benchmarks/history.py check [--kind overhead|versus] [--vllm 0.30.0] [--file F]
    python benchmarks/history.py import results/versus-vllm-0.30.0.json   # a summary written before the history
    python benchmarks/history.py pooled --kind versus --vllm 0.30.0 [--runs e28b583,02f011f,62ff0f1]  # rounds pooled

``overhead.py`` and ``overhead_versus.py`` append one line to ``results/history.jsonl`` per run (``record``): the
benchmark, the vLLM release, the machine (``overhead_engine.machine``), the commit (``+dirty`` where the work tree
had changes), the time, each median ratio, and the run's A/A noise band (``noise_band``), from the rounds of the
control engine against its twin (``control/off``, or ``vllm-control/vllm`` per compilation setting; the larger of
the settings'). Two identical engines differ by that much in that run, so only a move of a median beyond the
larger of the two runs' bands says something changed. A run without ``--control`` has no band: ``check`` then
names the ratios that moved but judges none.

``check`` exits 1 when a plugin ratio got worse beyond the noise, 0 otherwise (also when there is nothing to
compare yet). Not a test: timings on a shared 2-core machine have no place in ``make test``.

Each line also keeps the run's per-round ratios (``rounds``; the three fresh, primed compiled runs on 0.30.0 of
2026-11-27 got theirs from the summaries committed with them, 02f011f, 62ff0f1 and 27a66b1). ``pooled`` pools the
rounds of every run timed like the newest one (same benchmark, release, machine type and workload; ``--runs``: the
runs of those commits instead, which must be timed alike) and prints each
ratio's pooled median, the rounds at or above 1, and a bootstrap 95% interval of that median (``BOOTSTRAP`` resamples,
seeded: the same stored rounds print the same interval).
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
HISTORY = RESULTS / "history.jsonl"
ROOT = Path(__file__).resolve().parent.parent
BOOTSTRAP = 10_000  # resamples of ``pooled``'s interval


def commit() -> str:
    """``HEAD``'s commit, ``+dirty`` where tracked files differ from it (the results this run has just written
    excepted); ``unknown`` outside a git checkout."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode != 0:
        return "unknown"
    results = f":(exclude){RESULTS.relative_to(ROOT).as_posix()}"
    dirty = subprocess.run(["git", "diff", "--quiet", "HEAD", "--", ".", results], cwd=ROOT).returncode != 0
    return head.stdout.strip()[:12] + ("+dirty" if dirty else "")


def noise_band(rounds: list[float]) -> float:
    """How far a median of this run can sit from the truth by noise alone, from the A/A rounds: the A/A median's
    own distance from 1 (two identical engines that differ for the whole run) plus the rounds' median absolute
    deviation (their scatter round to round)."""
    middle = statistics.median(rounds)
    return abs(middle - 1.0) + statistics.median(abs(r - middle) for r in rounds)


def medians_of(kind: str, summary: dict[str, Any]) -> tuple[dict[str, float], float | None]:
    """The median ratios a summary holds, by name, and its A/A noise band (``None``: no control ran)."""
    medians: dict[str, float] = {}
    bands: list[float] = []
    if kind == "overhead":
        for mode, value in summary["median_ratio_vs_off"].items():
            medians[f"{mode}/off"] = value
        for key, name in (("median_ratio_plugin_vs_vllm", "plugin/vllm"), ("median_ratio_plugin_vs_unchecked",
                                                                            "plugin/unchecked")):  # fmt: skip
            if key in summary:
                medians[name] = summary[key]
        control = summary.get("round_ratios_vs_off", {}).get("control")
        if control:
            bands.append(noise_band(control))
    elif kind == "versus":
        for setting, result in summary["settings"].items():
            for name, value in result.items():
                if name == "runs" or "throughput" not in name:
                    continue
                ratio = name.split(" ")[0]
                medians[f"{setting} {ratio}"] = value["median"]
                if ratio.startswith("vllm-control/"):
                    bands.append(noise_band(value["rounds"]))
    else:
        raise ValueError(f"unknown benchmark kind {kind!r}")
    return medians, (max(bands) if bands else None)


def rounds_of(kind: str, summary: dict[str, Any]) -> dict[str, list[float]]:
    """The per-round ratios behind ``medians_of``'s medians, by the same names (where the summary holds them)."""
    if kind == "overhead":
        return {f"{mode}/off": list(rounds) for mode, rounds in summary.get("round_ratios_vs_off", {}).items()}
    if kind == "versus":
        return {
            f"{setting} {name.split(' ')[0]}": list(value["rounds"])
            for setting, result in summary["settings"].items()
            for name, value in result.items()
            if name != "runs" and "throughput" in name
        }
    raise ValueError(f"unknown benchmark kind {kind!r}")


def record(
    kind: str, summary: dict[str, Any], history: Path = HISTORY, at: tuple[str, str] | None = None
) -> dict[str, Any]:
    """Appends one run's line to the history and returns it; ``at``: (commit, time) of a run recorded later
    (``import``), else the checkout's and now."""
    medians, noise = medians_of(kind, summary)
    made_at = at or (commit(), datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    entry = {
        "kind": kind,
        "vllm": summary["vllm"],
        "machine": summary["machine"],
        "commit": made_at[0],
        "time": made_at[1],
        "workload": summary.get("workload", {}),
        "medians": medians,
        "noise": noise,
        "rounds": rounds_of(kind, summary),
    }
    history.parent.mkdir(parents=True, exist_ok=True)
    with history.open("a") as file:
        file.write(json.dumps(entry, sort_keys=True) + "\n")
    print(f"recorded in {history}: {kind} {entry['vllm']} at {entry['commit']}")
    return entry


def kind_of(summary_file: Path) -> str:
    """``overhead-vllm-X.json`` -> ``overhead``, ``versus-vllm-X.json`` -> ``versus``."""
    kind = summary_file.name.split("-vllm-")[0]
    if kind not in ("overhead", "versus"):
        raise SystemExit(f"{summary_file}: not a make bench summary (overhead-vllm-X.json or versus-vllm-X.json)")
    return kind


def import_summary(summary_file: Path, history: Path = HISTORY) -> dict[str, Any]:
    """Records a summary written before the history existed, at the commit that last wrote the file."""
    last = subprocess.run(
        ["git", "log", "-1", "--format=%h %cI", "--", summary_file.resolve()], cwd=ROOT, capture_output=True, text=True
    ).stdout.split()
    at = (last[0], last[1]) if len(last) == 2 else ("unknown", "unknown")
    return record(kind_of(summary_file), json.loads(summary_file.read_text()), history, at)


def load(history: Path = HISTORY) -> list[dict[str, Any]]:
    if not history.exists():
        return []
    return [json.loads(line) for line in history.read_text().splitlines() if line.strip()]


@dataclass(frozen=True)
class Move:
    """One median compared between two runs."""

    name: str
    before: float
    after: float
    noise: float | None  # the larger A/A band of the two runs; None: neither had a control

    @property
    def delta(self) -> float:
        return self.after - self.before

    @property
    def beyond_noise(self) -> bool | None:
        return None if self.noise is None else abs(self.delta) > self.noise

    @property
    def plugin_worse(self) -> bool:
        """A plugin ratio (plugin/x: higher is better) that fell beyond the noise."""
        return self.name.split(" ")[-1].startswith("plugin/") and bool(self.beyond_noise) and self.delta < 0


def compare(before: dict[str, Any], after: dict[str, Any]) -> list[Move]:
    """The medians both runs hold, compared against the larger of their two noise bands."""
    bands = [band for band in (before.get("noise"), after.get("noise")) if band is not None]
    noise = max(bands) if bands else None
    shared = [name for name in after["medians"] if name in before["medians"]]
    return [Move(name, before["medians"][name], after["medians"][name], noise) for name in shared]


def last_pair(
    entries: list[dict[str, Any]], kind: str, vllm: str | None
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The newest run of ``kind`` (for ``vllm`` where given) and the run before it on the same release, machine
    type and workload; ``None`` when there is no earlier one."""
    runs = [e for e in entries if e["kind"] == kind and (vllm is None or e["vllm"] == vllm)]
    if not runs:
        return None
    newest = runs[-1]
    earlier = [
        e
        for e in runs[:-1]
        if e["vllm"] == newest["vllm"] and e["machine"] == newest["machine"] and e["workload"] == newest["workload"]
    ]
    return (earlier[-1], newest) if earlier else None


def bootstrap_median_interval(values: list[float], resamples: int = BOOTSTRAP, seed: int = 0) -> tuple[float, float]:
    """The 2.5th and 97.5th percentiles of the medians of ``resamples`` resamples (with replacement) of ``values``."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


@dataclass(frozen=True)
class Pooled:
    """One ratio's rounds over several runs timed the same way."""

    name: str
    rounds: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.rounds)

    @property
    def at_or_above_1(self) -> int:
        return sum(r >= 1.0 for r in self.rounds)


def pooled_runs(
    entries: list[dict[str, Any]], kind: str, vllm: str | None, commits: list[str] | None = None
) -> list[dict[str, Any]]:
    """Every run of ``kind`` (on ``vllm``, default the newest run's) with stored rounds timed like the newest such run:
    the same release, machine type and workload; with ``commits`` (prefixes), the runs of those commits.

    Raises:
        ValueError: the runs of ``commits`` were not timed alike, or a commit names no run.
    """
    runs = [e for e in entries if e["kind"] == kind and e.get("rounds") and (vllm is None or e["vllm"] == vllm)]
    if commits is not None:
        runs = [e for e in runs if any(e["commit"].startswith(prefix) for prefix in commits)]
        missing = [prefix for prefix in commits if not any(e["commit"].startswith(prefix) for e in runs)]
        if missing:
            raise ValueError(f"no {kind} run with per-round ratios at {', '.join(missing)}")
    if not runs:
        return []
    newest = runs[-1]
    alike = [e for e in runs if (e["vllm"], e["machine"], e["workload"]) == (newest["vllm"], newest["machine"],
                                                                               newest["workload"])]  # fmt: skip
    if commits is not None and len(alike) != len(runs):
        raise ValueError(f"the runs at {', '.join(commits)} were not timed alike (release, machine, workload)")
    return alike


def pool(runs: list[dict[str, Any]]) -> list[Pooled]:
    """Each ratio every run holds rounds of, its rounds concatenated in run order."""
    names = [name for name in runs[0]["rounds"] if all(name in run["rounds"] for run in runs)] if runs else []
    return [Pooled(name, [r for run in runs for r in run["rounds"][name]]) for name in names]


def pooled(kind: str, vllm: str | None, history: Path = HISTORY, commits: list[str] | None = None) -> int:
    runs = pooled_runs(load(history), kind, vllm, commits)
    if not runs:
        print(f"bench pooled: {kind}: no recorded run with per-round ratios" + (f" of vLLM {vllm}" if vllm else ""))
        return 1
    first = runs[0]
    print(
        f"bench pooled: {kind}, vLLM {first['vllm']}, {first['machine']}, {first['workload'].get('engine', '')}: "
        f"{len(runs)} runs ({', '.join(run['commit'] for run in runs)})"
    )
    for ratio in pool(runs):
        low, high = bootstrap_median_interval(ratio.rounds)
        print(
            f"  {ratio.name:34s} median {ratio.median:.4f} over {len(ratio.rounds)} rounds ({ratio.at_or_above_1} "
            f">= 1); bootstrap 95% interval of the median {low:.3f}-{high:.3f}"
        )
    return 0


def check(kind: str, vllm: str | None, history: Path = HISTORY) -> int:
    pair = last_pair(load(history), kind, vllm)
    if pair is None:
        scope = f" of vLLM {vllm}" if vllm else ""
        print(f"bench check: {kind}: fewer than two recorded runs{scope} on one machine type and workload: nothing to "
              "compare")  # fmt: skip
        return 0
    before, after = pair
    print(
        f"bench check: {kind}, vLLM {after['vllm']}, {after['machine']}: "
        f"{before['commit']} ({before['time']}) -> {after['commit']} ({after['time']})"
    )
    moves = compare(before, after)
    noise = moves[0].noise if moves else None
    band = "none (no control engine in either run: nothing judged)" if noise is None else f"±{noise:.4f}"
    print(f"  A/A noise band: {band}")
    worse = []
    for move in moves:
        verdict = {None: "not judged", True: "MOVED beyond noise", False: "within noise"}[move.beyond_noise]
        print(f"  {move.name:34s} {move.before:.4f} -> {move.after:.4f} ({move.delta:+.4f}) {verdict}")
        if move.plugin_worse:
            worse.append(move.name)
    if worse:
        print(f"bench check: FAIL: worse beyond the A/A noise: {', '.join(worse)}")
        return 1
    print("bench check: ok")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("command", choices=["check", "import", "pooled"])
    parser.add_argument("summaries", nargs="*", type=Path, help="import: summaries of make bench")
    parser.add_argument("--kind", choices=["overhead", "versus"], default=None, help="default: both")
    parser.add_argument("--vllm", default=None, help="a vLLM release (default: the newest run's)")
    parser.add_argument("--file", type=Path, default=HISTORY)
    parser.add_argument("--runs", default=None, help="pooled: the runs' commits (prefixes, comma-separated)")
    args = parser.parse_args(argv)
    if args.command == "import":
        for summary_file in args.summaries:
            import_summary(summary_file, args.file)
        return 0
    kinds = [args.kind] if args.kind else ["overhead", "versus"]
    if args.command == "pooled":
        commits = args.runs.split(",") if args.runs else None
        return max(pooled(kind, args.vllm, args.file, commits) for kind in kinds)
    return max(check(kind, args.vllm, args.file) for kind in kinds)


if __name__ == "__main__":
    sys.exit(main())
