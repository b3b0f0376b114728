#!/usr/bin/env python3
"""Run make targets in lanes: the targets of one lane one after another, the lanes at the same time.

    python scripts/lanes.py "checks=test-unit test-ascend" "e2e=e2e-0.30.0 e2e-0.32.0"
    python scripts/lanes.py --jobs 1 "checks=..." "e2e=..."   # the lanes one after another

Why: one end-to-end stage keeps about one core busy (a vLLM engine process on the CPU build, mostly
single-threaded start-up and compilation), and the machines ``make test`` runs on have two. Every line a
target prints is passed through as it comes, tagged with its lane; every target runs even after one fails
(a CI run reports all its failures), and a table of each target's minutes and verdict ends the run. A target
that passes but printed a line starting ``SKIPPED:`` (e.g. test-native without nvcc) is shown as skipped, with
that line's reason, never as ok. Exit status: 0 only if every target passed.

The caller makes every environment first (``make venvs``): lanes then never install into a venv another
lane is running tests in.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

_PRINT = threading.Lock()
SKIPPED = "SKIPPED:"  # a target's line saying it did not do its work, and why


@dataclass
class Stage:
    target: str
    seconds: float = 0.0
    returncode: int | None = None  # None: not run
    skipped: str = ""  # the reason of its SKIPPED: line, if it printed one

    @property
    def verdict(self) -> str:
        if self.returncode is None:
            return "not run"
        if self.returncode != 0:
            return "FAILED"
        return f"skipped ({self.skipped})" if self.skipped else "ok"


@dataclass
class Lane:
    name: str
    stages: list[Stage] = field(default_factory=list)


def parse_lane(text: str) -> Lane:
    name, sep, targets = text.partition("=")
    if not sep or not name.strip() or not targets.split():
        raise argparse.ArgumentTypeError(f"{text!r}: a lane is NAME=TARGET [TARGET ...]")
    return Lane(name.strip(), [Stage(target) for target in targets.split()])


def say(lane: str, line: str) -> None:
    with _PRINT:
        sys.stdout.write(f"[{lane}] {line}\n")
        sys.stdout.flush()


def run_lane(lane: Lane, make: list[str], started: float) -> None:
    for stage in lane.stages:
        say(lane.name, f"== make {stage.target} (at {(time.monotonic() - started) / 60:.1f} min)")
        began = time.monotonic()
        proc = subprocess.Popen(
            [*make, stage.target],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        )
        assert proc.stdout is not None
        for line in proc.stdout:
            say(lane.name, line.rstrip("\n"))
            if line.startswith(SKIPPED) and not stage.skipped:
                stage.skipped = line[len(SKIPPED) :].strip()
        stage.returncode = proc.wait()
        stage.seconds = time.monotonic() - began


def summary(lanes: list[Lane], wall: float) -> list[str]:
    lines = [f"lanes: {wall / 60:.1f} min in all"]
    for lane in lanes:
        total = sum(stage.seconds for stage in lane.stages)
        lines.append(f"  {lane.name}: {total / 60:.1f} min")
        for stage in lane.stages:
            lines.append(f"    {stage.target:<28} {stage.seconds / 60:6.1f} min  {stage.verdict}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("lanes", nargs="+", type=parse_lane, metavar="NAME=TARGETS")
    parser.add_argument("--jobs", type=int, default=2, help="lanes at once (1: one after another)")
    parser.add_argument("--make", default=os.environ.get("MAKE", "make"), help="the make to run targets with")
    args = parser.parse_args(argv)
    lanes: list[Lane] = args.lanes
    make = [args.make, "--no-print-directory"]
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for done in [pool.submit(run_lane, lane, make, started) for lane in lanes]:
            done.result()
    for line in summary(lanes, time.monotonic() - started):
        print(line, flush=True)
    return 0 if all(stage.returncode == 0 for lane in lanes for stage in lane.stages) else 1


if __name__ == "__main__":
    sys.exit(main())
