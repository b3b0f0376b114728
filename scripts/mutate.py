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
else ``scripts/venv.py dev --print``).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # the package supports Python 3.10; its tooling (this script) wants 3.11, or tomli installed
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
CATALOGUE = Path("tests") / "mutations"
DEV = "dev"
DEFAULT_TIMEOUT = 300  # seconds for one mutation's tests (a fast one takes seconds)
REQUIRED = {"name": str, "file": str, "find": str, "replace": str, "claim": str, "tests": list, "fast": bool}
OPTIONAL = {"venv": str, "engine": bool, "pending": bool, "environment": dict, "timeout": int, "fresh": bool}
NAME = re.compile(r"^[a-z0-9][a-z0-9-]*$")

# Verdicts; only CAUGHT, PENDING and NOT_RUN pass.
CAUGHT = "caught"
SURVIVED = "SURVIVED"
DOES_NOT_APPLY = "DOES NOT APPLY"
PENDING = "pending test"
NOT_RUN = "not run"
ERROR = "ERROR"
PASSING = (CAUGHT, PENDING, NOT_RUN)


class CatalogueError(ValueError):
    """The catalogue itself is malformed: a missing key, a duplicate name, a fast mutation needing vLLM."""


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str  # relative to the checkout root
    find: str  # occurs exactly once in ``file``
    replace: str
    claim: str  # what users rely on that this breaks
    tests: tuple[str, ...]  # pytest node ids or files, relative to the root
    fast: bool  # runs in make test (dev venv, no engine)
    venv: str = DEV
    engine: bool = False
    pending: bool = False  # its test file may not exist yet: "pending test" while it does not
    environment: tuple[tuple[str, str], ...] = ()  # variables set for its test run
    timeout: int = DEFAULT_TIMEOUT
    fresh: bool = False  # run in a new process, not a fork of one that imported torch already
    source: str = ""  # the catalogue file it comes from

    def test_files(self) -> list[str]:
        return sorted({test.split("::", 1)[0] for test in self.tests})


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


@dataclass(frozen=True)
class TestRun:
    returncode: int
    failed: tuple[str, ...]  # node ids reported FAILED or ERROR
    counts: dict[str, int]  # passed / failed / skipped / error ... from pytest's summary line
    seconds: float
    output: str

    @property
    def timed_out(self) -> bool:
        return self.returncode == -9


# ---- the catalogue ----


def load_catalogue(root: Path = ROOT) -> list[Mutation]:
    """Every ``[[mutation]]`` of ``root/tests/mutations/*.toml``, checked; raises ``CatalogueError``."""
    folder = root / CATALOGUE
    files = sorted(folder.glob("*.toml"))
    if not files:
        raise CatalogueError(f"no catalogue: {folder}/*.toml holds no file")
    found: list[Mutation] = []
    for path in files:
        with open(path, "rb") as handle:
            try:
                data = tomllib.load(handle)
            except tomllib.TOMLDecodeError as exc:
                raise CatalogueError(f"{path.relative_to(root)}: {exc}") from exc
        unknown = set(data) - {"mutation"}
        if unknown:
            raise CatalogueError(f"{path.relative_to(root)}: top-level keys {sorted(unknown)}; expected [[mutation]]")
        for index, entry in enumerate(data.get("mutation", [])):
            found.append(_mutation(entry, f"{path.relative_to(root)} entry {index + 1}"))
    seen: set[str] = set()
    for mutation in found:
        if mutation.name in seen:
            raise CatalogueError(f"{mutation.source}: mutation {mutation.name!r} is named twice")
        seen.add(mutation.name)
    return found


def _mutation(entry: dict[str, Any], where: str) -> Mutation:
    missing = [key for key in REQUIRED if key not in entry]
    if missing:
        raise CatalogueError(f"{where}: missing {', '.join(missing)}")
    unknown = sorted(set(entry) - set(REQUIRED) - set(OPTIONAL))
    if unknown:
        raise CatalogueError(f"{where}: unknown keys {unknown} (known: {sorted({*REQUIRED, *OPTIONAL})})")
    for key, kind in {**REQUIRED, **OPTIONAL}.items():
        if key in entry and not isinstance(entry[key], kind):
            raise CatalogueError(f"{where}: {key} must be a {kind.__name__}")
    name = entry["name"]
    where = f"{where} ({name})"
    if not NAME.match(name):
        raise CatalogueError(f"{where}: a name is lower-case words joined by '-'")
    if not entry["find"] or entry["find"] == entry["replace"]:
        raise CatalogueError(f"{where}: find must be non-empty and differ from replace")
    tests = entry["tests"]
    if not tests or not all(isinstance(test, str) and test.startswith("tests/") for test in tests):
        raise CatalogueError(f"{where}: tests must name at least one pytest node id or file under tests/")
    venv, engine = entry.get("venv", DEV), entry.get("engine", False)
    if entry["fast"] and (venv != DEV or engine):
        raise CatalogueError(f"{where}: a fast mutation runs in the dev venv without an engine (set fast = false)")
    environment = entry.get("environment", {})
    if not all(isinstance(value, str) for value in environment.values()):
        raise CatalogueError(f"{where}: environment values must be strings")
    return Mutation(
        name=name,
        file=entry["file"],
        find=entry["find"],
        replace=entry["replace"],
        claim=entry["claim"],
        tests=tuple(tests),
        fast=entry["fast"],
        venv=venv,
        engine=engine,
        pending=entry.get("pending", False),
        environment=tuple(sorted(environment.items())),
        timeout=entry.get("timeout", DEFAULT_TIMEOUT),
        fresh=entry.get("fresh", False),
        source=where,
    )


def apply_problem(root: Path, mutation: Mutation) -> str | None:
    """Why ``mutation`` does not apply to the files under ``root`` (``None``: its ``find`` occurs exactly once)."""
    path = root / mutation.file
    if not path.is_file():
        return f"{mutation.file} does not exist"
    count = path.read_text().count(mutation.find)
    if count != 1:
        where = "is not in" if count == 0 else f"occurs {count} times in"
        return f"its find text {where} {mutation.file} (the code moved: update the catalogue entry)"
    return None


def missing_tests(root: Path, mutation: Mutation) -> list[str]:
    return [name for name in mutation.test_files() if not (root / name).exists()]


# ---- the scratch copy ----


def checkout_files(root: Path) -> list[str]:
    """The checkout's files as ``git ls-files`` lists them: tracked and untracked, not ignored, present."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout.decode()
    return sorted({name for name in listed.split("\0") if name and (root / name).is_file()})


def scratch_copy(root: Path, destination: Path) -> None:
    """Copy the checkout's files into ``destination`` (the mutations' playground; the checkout stays as it is)."""
    for name in checkout_files(root):
        target = destination / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / name, target, follow_symlinks=False)


@contextmanager
def mutated(scratch: Path, mutation: Mutation) -> Iterator[None]:
    """``mutation`` applied to ``scratch`` for the block, the file restored byte for byte afterwards."""
    path = scratch / mutation.file
    original = path.read_bytes()
    text = original.decode()
    if text.count(mutation.find) != 1:
        raise CatalogueError(f"{mutation.name}: {apply_problem(scratch, mutation)}")
    path.write_text(text.replace(mutation.find, mutation.replace, 1))
    try:
        yield
    finally:
        path.write_bytes(original)


# ---- running tests ----

_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)\b")
_FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.MULTILINE)
PRELOAD = ("numpy", "torch")  # what the fork server imports once: never the package, whose copy is mutated

# The fork server: imports what every run needs and the package never touches (NumPy, torch, pytest) once, then
# forks a child per run that imports the scratch copy's package afresh and runs pytest. A run then costs its tests,
# not torch's import (seconds on a 2-core machine). Requests and replies are JSON lines on stdin / stdout.
_SERVER = r"""
import json, os, sys
sys.dont_write_bytecode = True
for name in sys.argv[1:]:
    try:
        __import__(name)
    except ImportError:
        pass
import pytest
print(json.dumps({"ready": os.getpid()}), flush=True)
for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 3
        try:
            log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(log, 1)
            os.dup2(log, 2)
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            os.chdir(request["cwd"])
            os.environ.clear()
            os.environ.update(request["env"])
            sys.path.insert(0, request["cwd"])
            code = int(pytest.main(request["args"]))
        except BaseException as exc:
            print(f"mutate fork server: {type(exc).__name__}: {exc}", file=sys.stderr)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    print(json.dumps({"pid": pid}), flush=True)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)
"""


class ForkServer:
    """One venv python holding NumPy, torch and pytest imported, forking a child per test run."""

    def __init__(self, python: str, scratch: Path, preload: Sequence[str] = PRELOAD) -> None:
        self.scratch = scratch
        self._process = subprocess.Popen(
            [python, "-c", _SERVER, *preload],
            cwd=scratch,
            env=_environment(scratch, ()),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self._reply(DEFAULT_TIMEOUT, "ready")

    def _read(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            self._replies.put(json.loads(line))
        self._replies.put(None)  # the server exited

    def _reply(self, timeout: float, key: str) -> Any:
        try:
            reply = self._replies.get(timeout=timeout)
        except queue.Empty:
            return None
        if reply is None or key not in reply:
            raise RuntimeError(f"the mutation fork server stopped (exit status {self._process.poll()})")
        return reply[key]

    def run(self, args: list[str], environment: Sequence[tuple[str, str]], timeout: int) -> tuple[int, str]:
        """``pytest.main(args)`` in a fresh child in the scratch copy: (exit status, -9 on timeout; its output)."""
        assert self._process.stdin is not None
        with tempfile.NamedTemporaryFile("r", prefix="mutate-run-", suffix=".log", errors="replace") as log:
            request = {"args": args, "cwd": str(self.scratch), "env": _environment(self.scratch, environment)}
            self._process.stdin.write(json.dumps({**request, "log": log.name}) + "\n")
            self._process.stdin.flush()
            pid = self._reply(30, "pid")
            code = self._reply(timeout, "rc")
            if code is None:  # hung: stop the child, collect its status
                os.kill(pid, signal.SIGKILL)
                self._reply(30, "rc")
                code = -9
            return int(code), log.read()

    def close(self) -> None:
        if self._process.stdin is not None:
            self._process.stdin.close()
        try:
            self._process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


def _environment(scratch: Path, environment: Sequence[tuple[str, str]]) -> dict[str, str]:
    """The runs' environment: the scratch copy first on the path, no bytecode written (a mutation of the same
    length within the same second would otherwise reuse a stale ``.pyc``), no inherited pytest options."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(scratch), *filter(None, [os.environ.get("PYTHONPATH", "")])]),
        "PYTHONDONTWRITEBYTECODE": "1",
        **dict(environment),
    }
    env.pop("PYTEST_ADDOPTS", None)
    return env


def pytest_args(tests: Sequence[str], stop_first: bool) -> list[str]:
    return ["-q", "-p", "no:cacheprovider", "-rfE", *(["-x"] if stop_first else []), *tests]


def run_tests(
    python: str,
    scratch: Path,
    tests: Sequence[str],
    *,
    stop_first: bool = True,
    environment: Sequence[tuple[str, str]] = (),
    wrapper: Sequence[str] = (),
    timeout: int = DEFAULT_TIMEOUT,
    server: ForkServer | None = None,
) -> TestRun:
    """pytest on ``tests`` in ``scratch``: in a child of ``server`` where given, else in a new process of ``python``
    (behind ``wrapper``, e.g. an engine-slot queue)."""
    args = pytest_args(tests, stop_first)
    started = time.monotonic()
    if server is not None:
        returncode, output = server.run(args, environment, timeout)
    else:
        try:
            done = subprocess.run(
                [*wrapper, python, "-m", "pytest", *args],
                cwd=scratch,
                env=_environment(scratch, environment),
                capture_output=True,
                text=True,
                errors="replace",
                timeout=timeout,
            )
            returncode, output = done.returncode, done.stdout + done.stderr
        except subprocess.TimeoutExpired as exc:
            returncode = -9
            output = _text(exc.stdout) + _text(exc.stderr)
    if returncode == -9:
        output += f"\n(timed out after {timeout} s)"
    counts: dict[str, int] = {}
    last = output.strip().splitlines()[-1] if output.strip() else ""
    for number, kind in _COUNT.findall(last):
        counts["error" if kind.startswith("error") else kind] = int(number)
    failed = tuple(dict.fromkeys(_FAILED.findall(output)))
    return TestRun(returncode, failed, counts, time.monotonic() - started, output)


def _text(value: bytes | str | None) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else (value or "")


def judge(mutation: Mutation, run: TestRun) -> Outcome:
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

    def run(self, mutation: Mutation, tests: Sequence[str], stop_first: bool, timeout: int) -> TestRun:
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
        default=os.environ.get("MUTATE_ENGINE_WRAPPER", ""),
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
