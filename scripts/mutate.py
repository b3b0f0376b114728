#!/usr/bin/env python3
"""The mutation lane: plant each catalogued fault in a scratch copy of the checkout and make sure a test fails.

    python scripts/mutate.py --fast                 # the CI subset (make test-mutate): dev-venv unit tests only
    python scripts/mutate.py                        # every mutation (make mutate), vLLM venvs and engines too
    python scripts/mutate.py --only sentinel-strict-off replay-check-whole-block
    python scripts/mutate.py --list                 # the catalogue, nothing run

The catalogue is ``tests/mutations/*.toml`` (one file per area of the package), each entry a ``[[mutation]]``:
a small, realistic patch (``find`` must occur exactly once in ``file``; it becomes ``replace``), the claim it
breaks, the tests that must catch it (pytest node ids or files), ``fast`` (whether CI runs it) and, for the full
lane only, the ``venv`` it needs (``scripts/venv.py`` names: ``0.30.0``...) or ``engine = true`` (a vLLM engine
starts: wrapped in ``--engine-wrapper``). ``pending = true``: its test file is still to come; while it is
missing the mutation is reported as "pending test", not as a failure.

Each mutation is applied, alone, to a copy of the checkout's files (``git ls-files``: tracked and untracked,
not ignored), never to the working tree (other stages import the checkout); its tests run there with ``-x``
(stop at the first failure) and the file is restored. Before any mutation, every selected test runs once on
the unmutated copy: a test that fails there would "catch" anything. The run fails unless every mutation made
at least one of its tests fail: a survivor is a missing test, a ``find`` no longer in its file (the code moved)
a catalogue to update. Every catalogued mutation's patch is checked to apply, the ones not run included.

Standard library only; pytest runs in each mutation's venv (``--python`` for the dev one: the python given,
else ``scripts/venv.py dev --print``). The catalogue and the scratch copy: ``mutate_catalogue.py``; running pytest
(fresh, or forked from a server that imported torch once): ``mutate_run.py``.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The two halves of the lane beside this file (scripts/ is no package).
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from mutate_catalogue import (  # noqa: E402
    DEV,
    ROOT,
    CatalogueError,
    Mutation,
    apply_problem,
    load_catalogue,
    missing_tests,
    mutated,
    scratch_copy,
)
from mutate_run import PRELOAD, ForkServer, RunResult, run_tests  # noqa: E402

__all__ = ["CatalogueError", "load_catalogue", "missing_tests", "mutated", "scratch_copy"]  # used by its tests

# Verdicts; only CAUGHT, PENDING and NOT_RUN pass.
CAUGHT = "caught"
SURVIVED = "SURVIVED"
DOES_NOT_APPLY = "DOES NOT APPLY"
PENDING = "pending test"
NOT_RUN = "not run"
ERROR = "ERROR"
PASSING = (CAUGHT, PENDING, NOT_RUN)


@dataclass
class Outcome:
    mutation: Mutation
    verdict: str
    seconds: float = 0.0
    caught_by: list[str] = field(default_factory=list)
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.verdict in PASSING


def judge(mutation: Mutation, run: RunResult) -> Outcome:
    """Caught: a test failed (pytest's exit status 1). Survived: tests ran and all passed. Anything else (nothing
    collected, every test skipped, an internal error, a mutation that breaks an import) is an error to look at."""
    tail = "\n".join(run.output.strip().splitlines()[-15:])
    if run.timed_out:
        return Outcome(mutation, CAUGHT, run.seconds, ["(its tests hung: timed out)"], tail)
    if run.returncode == 1 and run.failed:
        return Outcome(mutation, CAUGHT, run.seconds, list(run.failed))
    if run.returncode == 0 and run.counts.get("passed", 0) > 0:
        return Outcome(mutation, SURVIVED, run.seconds, [], "every test passed with the fault in place")
    if run.returncode == 0:
        return Outcome(mutation, ERROR, run.seconds, [], f"its tests ran nothing but skips here: {run.counts}")
    return Outcome(mutation, ERROR, run.seconds, [], f"pytest exit status {run.returncode}:\n{tail}")


# ---- the lane ----


@dataclass
class Options:
    fast: bool = False
    only: tuple[str, ...] = ()
    python: str | None = None  # the dev venv's python
    engine_wrapper: tuple[str, ...] = ()
    stop_first: bool = True
    fork: bool = True  # runs in children of a fork server (engine and ``fresh`` mutations never)
    preload: tuple[str, ...] = PRELOAD  # what the fork server imports once


def venv_python(venv: str, options: Options) -> str:
    if venv == DEV and options.python:
        return options.python
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "venv.py"), venv, "--print"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if done.returncode != 0 or not done.stdout.strip():
        raise RuntimeError(f"scripts/venv.py {venv} --print failed:\n{done.stdout}{done.stderr}")
    return done.stdout.strip().splitlines()[-1]


def selected(catalogue: list[Mutation], options: Options) -> list[Mutation]:
    unknown = sorted(set(options.only) - {m.name for m in catalogue})
    if unknown:
        raise CatalogueError(f"no mutation named {', '.join(unknown)} (see --list)")
    if options.only:
        return [m for m in catalogue if m.name in options.only]
    return [m for m in catalogue if m.fast or not options.fast]


class _Runner:
    """Runs a mutation's tests where its catalogue entry says: its venv, forked or fresh, behind the engine
    wrapper for engine mutations."""

    def __init__(self, root: Path, scratch: Path, mutations: list[Mutation], options: Options) -> None:
        self.scratch, self.options = scratch, options
        self.pythons = {venv: venv_python(venv, options) for venv in sorted({m.venv for m in mutations})}
        self.servers: dict[str, ForkServer] = {}

    def forked(self, mutation: Mutation) -> bool:
        return self.options.fork and not mutation.engine and not mutation.fresh

    def run(self, mutation: Mutation, tests: Sequence[str], stop_first: bool, timeout: int) -> RunResult:
        server = None
        if self.forked(mutation):
            if mutation.venv not in self.servers:
                python = self.pythons[mutation.venv]
                self.servers[mutation.venv] = ForkServer(python, self.scratch, self.options.preload)
            server = self.servers[mutation.venv]
        return run_tests(
            self.pythons[mutation.venv],
            self.scratch,
            tests,
            stop_first=stop_first,
            environment=mutation.environment,
            wrapper=self.options.engine_wrapper if mutation.engine else (),
            timeout=timeout,
            server=server,
        )

    def close(self) -> None:
        for server in self.servers.values():
            server.close()


def run_lane(root: Path, options: Options, say: Any = print) -> list[Outcome]:
    """Every mutation of the catalogue judged: applied and tested where selected, else only checked to apply."""
    catalogue = load_catalogue(root)
    chosen = selected(catalogue, options)
    outcomes: dict[str, Outcome] = {}
    for mutation in catalogue:
        problem = apply_problem(root, mutation)
        if problem:
            outcomes[mutation.name] = Outcome(mutation, DOES_NOT_APPLY, detail=problem)
        elif mutation not in chosen:
            why = "not selected" if options.only else "full lane only (make mutate)"
            outcomes[mutation.name] = Outcome(mutation, NOT_RUN, detail=why)
        elif mutation.pending and missing_tests(root, mutation):
            outcomes[mutation.name] = Outcome(
                mutation, PENDING, detail=f"waiting for {', '.join(missing_tests(root, mutation))}"
            )
        elif missing_tests(root, mutation):
            outcomes[mutation.name] = Outcome(
                mutation, ERROR, detail=f"its tests {', '.join(missing_tests(root, mutation))} do not exist"
            )
    to_run = [m for m in chosen if m.name not in outcomes]
    with tempfile.TemporaryDirectory(prefix="mutate-") as folder:
        scratch = Path(folder)
        scratch_copy(root, scratch)
        runner = _Runner(root, scratch, to_run, options)
        try:
            broken = baseline(runner, to_run, say)
            for mutation in to_run:
                if mutation.name in broken:
                    outcomes[mutation.name] = Outcome(mutation, ERROR, detail=broken[mutation.name])
                    continue
                with mutated(scratch, mutation):
                    run = runner.run(mutation, mutation.tests, options.stop_first, mutation.timeout)
                outcome = judge(mutation, run)
                outcomes[mutation.name] = outcome
                say(f"  {mutation.name}: {outcome.verdict} ({outcome.seconds:.1f} s)")
        finally:
            runner.close()
    return [outcomes[m.name] for m in catalogue]


def baseline(runner: _Runner, mutations: list[Mutation], say: Any) -> dict[str, str]:
    """The selected tests on the unmutated copy, once per way of running them (venv, forked or not, engine,
    environment): a test that fails there would catch every mutation. Returns, per mutation whose tests failed
    there, why."""
    broken: dict[str, str] = {}
    groups: dict[tuple[Any, ...], list[Mutation]] = {}
    for mutation in mutations:
        key = (mutation.venv, runner.forked(mutation), mutation.engine, mutation.environment)
        groups.setdefault(key, []).append(mutation)
    for (venv, *_), members in groups.items():
        tests = list(dict.fromkeys(test for m in members for test in m.tests))
        say(f"baseline: the {len(tests)} test selection(s) of {len(members)} mutation(s) (venv {venv}), unmutated")
        run = runner.run(members[0], tests, False, sum(m.timeout for m in members))
        say(f"baseline: {run.counts} in {run.seconds:.1f} s")
        if run.returncode == 0:
            continue
        failing = set(run.failed)
        for mutation in members:
            if failing:
                hit = sorted(f for f in failing if any(_within(f, t) for t in mutation.tests))
                if hit:
                    broken[mutation.name] = f"its tests fail without the mutation: {', '.join(hit)}"
                continue
            # Nothing failed by name (a node id not found, a collection error): find whose selection broke it.
            alone = runner.run(mutation, mutation.tests, False, mutation.timeout)
            if alone.returncode != 0:
                tail = "\n".join(alone.output.strip().splitlines()[-15:])
                broken[mutation.name] = f"its tests do not pass without the mutation:\n{tail}"
    return broken


def _within(node: str, selection: str) -> bool:
    """Whether test ``node`` (as pytest reports it) is part of the selection ``selection`` (file or node id)."""
    return node == selection or node.startswith((selection + "::", selection + "[", selection.rstrip("/") + "/"))


def table(outcomes: list[Outcome]) -> list[str]:
    width = max([len(o.mutation.name) for o in outcomes] + [8])
    lines = [f"{'mutation':<{width}}  {'verdict':<19}  {'seconds':>7}  caught by / why"]
    for outcome in outcomes:
        what = ", ".join(outcome.caught_by) or (outcome.detail.splitlines()[0] if outcome.detail else "")
        seconds = f"{outcome.seconds:7.1f}" if outcome.seconds else " " * 7
        lines.append(f"{outcome.mutation.name:<{width}}  {outcome.verdict:<19}  {seconds}  {what}")
    return lines


def summary(outcomes: list[Outcome], wall: float) -> str:
    counts: dict[str, int] = {}
    for outcome in outcomes:
        counts[outcome.verdict] = counts.get(outcome.verdict, 0) + 1
    parts = ", ".join(f"{n} {verdict}" for verdict, n in sorted(counts.items()))
    verdict = "ok" if all(o.ok for o in outcomes) else "FAILED"
    return f"mutations: {len(outcomes)} ({parts}) in {wall:.0f} s: {verdict}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fast", action="store_true", help="only the mutations marked fast (make test-mutate)")
    parser.add_argument("--only", nargs="+", default=[], metavar="NAME", help="only these mutations")
    parser.add_argument("--list", action="store_true", help="print the catalogue and stop")
    parser.add_argument("--python", help="the dev venv's python (default: scripts/venv.py dev --print)")
    parser.add_argument(
        "--engine-wrapper",
        default="",
        help="command that runs an engine mutation's tests (e.g. a machine's engine-slot queue)",
    )
    parser.add_argument("--every-catcher", action="store_true", help="run every test of a mutation (no -x)")
    parser.add_argument("--no-fork", action="store_true", help="a new process per run (no fork server)")
    parser.add_argument("--root", type=Path, default=ROOT, help=argparse.SUPPRESS)  # the runner's own tests
    args = parser.parse_args(argv)
    if args.list:
        for mutation in load_catalogue(args.root):
            lane = "fast" if mutation.fast else f"full ({mutation.venv}{', engine' if mutation.engine else ''})"
            print(f"{mutation.name:<40} {lane:<22} {mutation.file}: {mutation.claim}")
        return 0
    options = Options(
        fast=args.fast,
        only=tuple(args.only),
        python=args.python,
        engine_wrapper=tuple(shlex.split(args.engine_wrapper)),
        stop_first=not args.every_catcher,
        fork=not args.no_fork,
    )
    started = time.monotonic()
    try:
        outcomes = run_lane(args.root, options, say=lambda line: print(line, flush=True))
    except CatalogueError as exc:
        print(f"mutate: {exc}", file=sys.stderr)
        return 2
    for line in table(outcomes):
        print(line)
    for outcome in outcomes:
        if not outcome.ok:
            print(f"\n{outcome.mutation.name} ({outcome.verdict}): {outcome.mutation.claim}\n{outcome.detail}")
    print(summary(outcomes, time.monotonic() - started), flush=True)
    return 0 if all(outcome.ok for outcome in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
