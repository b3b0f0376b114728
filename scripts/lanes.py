#!/usr/bin/env python3
"""Run make targets two at a time, from one queue, longest first.

    python scripts/lanes.py --jobs 2 --history ~/.cache/x/lanes.json test-unit e2e-0.30.0 e2e-0.32.0 ...
    python scripts/lanes.py --jobs 1 ...   # one after another

Why: one end-to-end stage keeps about one core busy (a vLLM engine process on the CPU build, mostly
single-threaded start-up and compilation), and the machines ``make test`` runs on have two. Each of ``--jobs``
workers takes the next target when its last one ends, so the run lasts about half the stages' sum, however their
minutes shift. The queue is ordered longest first by the minutes each target took last time (``--history``, a
JSON file this script rewrites after the run); a target with no recorded minutes goes first, in the order given.
``--apart`` groups never run at the same time. Every line a target prints is passed through as it comes, tagged
with its target; every target runs even after one fails (a CI run reports all its failures), and a table of each
worker's targets, minutes and verdicts ends the run. A target that passes but printed a line starting
``SKIPPED:`` (e.g. test-native without nvcc) is shown as skipped, with that line's reason, never as ok. After the
table, each failed target's pytest ``FAILED``/``ERROR`` lines (or its last lines) are printed again, so the end of
a CI log says what failed. Exit status: 0 only if every target passed.

The caller makes every environment first (``make venvs``): stages then never install into a venv another
stage is running tests in.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

_PRINT = threading.Lock()
SKIPPED = "SKIPPED:"  # a target's line saying it did not do its work, and why
# pytest's lines naming what failed (its short summary, -r fE, on by default): repeated after the table, because a
# CI log is often read from its end, and a failed stage's own lines lie tens of minutes of output above it.
FAILURE_PREFIXES = ("FAILED ", "ERROR ")
RECAP_TAIL = 15  # a failed stage that printed none of those: its last lines instead
RECAP_MAX = 40  # at most this many named failures per stage, the rest counted


@dataclass
class Stage:
    target: str
    seconds: float = 0.0
    returncode: int | None = None  # None: not run
    skipped: str = ""  # the reason of its SKIPPED: line, if it printed one
    failures: list[str] = field(default_factory=list)  # its lines naming a failed test, in order
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=RECAP_TAIL))  # its last lines

    @property
    def verdict(self) -> str:
        if self.returncode is None:
            return "not run"
        if self.returncode != 0:
            return "FAILED"
        return f"skipped ({self.skipped})" if self.skipped else "ok"


@dataclass
class Worker:
    name: str
    stages: list[Stage] = field(default_factory=list)


class Queue:
    """The targets not started yet, shared by the workers: each takes the next when its last one ends, skipping
    one that must not run beside a target running now (``apart``: groups of targets that share a resource, e.g.
    the per-user shared-memory segments of vLLM 0.20.x's store), and waiting while only such ones are left."""

    def __init__(self, stages: list[Stage], apart: list[set[str]] | None = None) -> None:
        self._waiting = list(stages)
        self._running: set[str] = set()
        self._apart = apart or []
        self._changed = threading.Condition()

    def _clashes(self, target: str) -> bool:
        return any(target in group and group & self._running for group in self._apart)

    def take(self) -> Stage | None:
        with self._changed:
            while self._waiting:
                stage = next((stage for stage in self._waiting if not self._clashes(stage.target)), None)
                if stage is not None:
                    self._waiting.remove(stage)
                    self._running.add(stage.target)
                    return stage
                self._changed.wait()
            return None

    def done(self, stage: Stage) -> None:
        with self._changed:
            self._running.discard(stage.target)
            self._changed.notify_all()


def longest_first(targets: list[str], history: dict[str, float]) -> list[str]:
    """``targets`` ordered by their last seconds, longest first; those never timed first, as given."""
    unknown = [target for target in targets if target not in history]
    timed = sorted((target for target in targets if target in history), key=lambda target: -history[target])
    return unknown + timed


def read_history(path: str) -> dict[str, float]:
    try:
        with open(path) as handle:
            recorded = json.load(handle)
    except (OSError, ValueError):
        return {}
    if not isinstance(recorded, dict):
        return {}
    return {str(target): float(seconds) for target, seconds in recorded.items() if isinstance(seconds, (int, float))}


def write_history(path: str, lanes: list[Worker]) -> None:
    recorded = read_history(path)
    recorded.update({stage.target: round(stage.seconds, 1) for lane in lanes for stage in lane.stages})
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as handle:
        json.dump(recorded, handle, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)


def say(lane: str, line: str) -> None:
    with _PRINT:
        sys.stdout.write(f"[{lane}] {line}\n")
        sys.stdout.flush()


def run_worker(worker: Worker, queue: Queue, make: list[str], started: float) -> None:
    """Take targets from ``queue`` until none is left; the worker's lane lists what it ran, in order."""
    while (stage := queue.take()) is not None:
        worker.stages.append(stage)
        try:
            run_stage(stage.target, stage, make, started, worker=worker.name)
        finally:
            queue.done(stage)


def run_stage(tag: str, stage: Stage, make: list[str], started: float, worker: str = "") -> None:
    where = f", {worker}" if worker else ""
    say(tag, f"== make {stage.target} (at {(time.monotonic() - started) / 60:.1f} min{where})")
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
        say(tag, line.rstrip("\n"))
        if line.startswith(SKIPPED) and not stage.skipped:
            stage.skipped = line[len(SKIPPED) :].strip()
        if line.startswith(FAILURE_PREFIXES):
            stage.failures.append(line.rstrip("\n"))
        stage.tail.append(line.rstrip("\n"))
    stage.returncode = proc.wait()
    stage.seconds = time.monotonic() - began


def summary(lanes: list[Worker], wall: float) -> list[str]:
    lines = [f"lanes: {wall / 60:.1f} min in all"]
    for lane in lanes:
        total = sum(stage.seconds for stage in lane.stages)
        lines.append(f"  {lane.name}: {total / 60:.1f} min")
        for stage in lane.stages:
            lines.append(f"    {stage.target:<28} {stage.seconds / 60:6.1f} min  {stage.verdict}")
    return lines


def recap(lanes: list[Worker]) -> list[str]:
    """What each failed stage said failed: pytest's FAILED/ERROR lines, or its last lines if it printed none."""
    lines: list[str] = []
    for stage in (stage for lane in lanes for stage in lane.stages):
        if stage.returncode in (None, 0):
            continue
        lines.append(f"{stage.target} failed (exit {stage.returncode}):")
        named = stage.failures[:RECAP_MAX]
        lines.extend(f"  {line}" for line in named or stage.tail)
        if len(stage.failures) > len(named):
            lines.append(f"  ... and {len(stage.failures) - len(named)} more")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("targets", nargs="+", metavar="TARGET", help="the make targets to run")
    parser.add_argument("--jobs", type=int, default=2, help="targets at once (1: one after another)")
    parser.add_argument("--history", default="", help="JSON of each target's last seconds: the queue's order")
    parser.add_argument(
        "--apart", action="append", default=[], metavar="T1,T2", help="targets never run at the same time (repeatable)"
    )
    parser.add_argument("--make", default=os.environ.get("MAKE", "make"), help="the make to run targets with")
    args = parser.parse_args(argv)
    jobs = max(1, args.jobs)
    make = [args.make, "--no-print-directory"]
    started = time.monotonic()
    history = read_history(args.history) if args.history else {}
    apart = [set(filter(None, group.split(","))) for group in args.apart]
    queue = Queue([Stage(target) for target in longest_first(args.targets, history)], apart)
    workers = [Worker(f"worker {number + 1}") for number in range(jobs)]
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for done in [pool.submit(run_worker, worker, queue, make, started) for worker in workers]:
            done.result()
    for line in [*summary(workers, time.monotonic() - started), *recap(workers)]:
        print(line, flush=True)
    if args.history:
        write_history(args.history, workers)
    return 0 if all(stage.returncode == 0 for worker in workers for stage in worker.stages) else 1


if __name__ == "__main__":
    sys.exit(main())
