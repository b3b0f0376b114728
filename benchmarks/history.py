#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The guard on ``make bench``: every run's medians recorded with its commit, and a check that compares the newest
run with the one before it (same benchmark, vLLM release and machine type).

    python benchmarks/history.py check [--kind overhead|versus] [--vllm 0.30.0] [--file F]
    python benchmarks/history.py import results/versus-vllm-0.30.0.json   # a summary written before the history

``overhead.py`` and ``overhead_versus.py`` append one line to ``results/history.jsonl`` per run (``record``): the
benchmark, the vLLM release, the machine (``overhead_engine.machine``), the commit (``+dirty`` where the work tree
had changes), the time, each median ratio, and the run's A/A noise band (``noise_band``), from the rounds of the
control engine against its twin (``control/off``, or ``vllm-control/vllm`` per compilation setting; the larger of
the settings'). Two identical engines differ by that much in that run, so only a move of a median beyond the
larger of the two runs' bands says something changed. A run without ``--control`` has no band: ``check`` then
names the ratios that moved but judges none.

``check`` exits 1 when a plugin ratio got worse beyond the noise, 0 otherwise (also when there is nothing to
compare yet). Not a test: timings on a shared 2-core machine have no place in ``make test``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
HISTORY = RESULTS / "history.jsonl"
ROOT = Path(__file__).resolve().parent.parent


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
    parser.add_argument("command", choices=["check", "import"])
    parser.add_argument("summaries", nargs="*", type=Path, help="import: summaries of make bench")
    parser.add_argument("--kind", choices=["overhead", "versus"], default=None, help="default: both")
    parser.add_argument("--vllm", default=None, help="a vLLM release (default: the newest run's)")
    parser.add_argument("--file", type=Path, default=HISTORY)
    args = parser.parse_args(argv)
    if args.command == "import":
        for summary_file in args.summaries:
            import_summary(summary_file, args.file)
        return 0
    kinds = [args.kind] if args.kind else ["overhead", "versus"]
    return max(check(kind, args.vllm, args.file) for kind in kinds)


if __name__ == "__main__":
    sys.exit(main())
