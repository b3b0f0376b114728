#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Running pytest for ``scripts/mutate.py``: in a fresh process of a venv's python, or in a child forked from a
server that imported NumPy, torch and pytest once. Standard library only (pytest runs in the venv)."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

START_TIMEOUT = 300  # seconds the fork server may take to import what it preloads
GRACE = 30  # seconds a timed-out run has to stop after SIGINT, before SIGKILL


@dataclass(frozen=True)
class RunResult:
    returncode: int
    failed: tuple[str, ...]  # node ids reported FAILED or ERROR
    counts: dict[str, int]  # passed / failed / skipped / error ... from pytest's summary line
    seconds: float
    output: str
    timed_out: bool = False  # stopped at its timeout


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
            os.setsid()  # its own process group: a timeout stops whatever its tests started too
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
        self._reply(START_TIMEOUT, "ready")

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

    def run(self, args: list[str], environment: Sequence[tuple[str, str]], timeout: int) -> tuple[int | None, str]:
        """``pytest.main(args)`` in a fresh child in the scratch copy: (exit status, None on timeout; its output)."""
        assert self._process.stdin is not None
        with tempfile.NamedTemporaryFile("r", prefix="mutate-run-", suffix=".log", errors="replace") as log:
            request = {"args": args, "cwd": str(self.scratch), "env": _environment(self.scratch, environment)}
            self._process.stdin.write(json.dumps({**request, "log": log.name}) + "\n")
            self._process.stdin.flush()
            pid = self._reply(30, "pid")
            code = self._reply(timeout, "rc")
            if code is None:  # hung: stop the child and what it started, collect its status
                _signal_group(pid, signal.SIGINT)  # pytest unwinds: its fixtures stop what they started
                if self._reply(GRACE, "rc") is None:
                    _signal_group(pid, signal.SIGKILL)
                    self._reply(GRACE, "rc")
                return None, log.read()
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
    timeout: int,
    server: ForkServer | None = None,
) -> RunResult:
    """pytest on ``tests`` in ``scratch``: in a child of ``server`` where given, else in a new process of ``python``
    (behind ``wrapper``, e.g. an engine-slot queue)."""
    args = pytest_args(tests, stop_first)
    started = time.monotonic()
    returncode: int | None
    if server is not None:
        returncode, output = server.run(args, environment, timeout)
    else:
        # Its own session: on a timeout the whole tree stops (an engine the tests started, the wrapper's queue).
        process = subprocess.Popen(
            [*wrapper, python, "-m", "pytest", *args],
            cwd=scratch,
            env=_environment(scratch, environment),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,
        )
        try:
            output, _ = process.communicate(timeout=timeout)
            returncode = process.returncode
        except subprocess.TimeoutExpired:
            output, returncode = _stop(process), None
        except BaseException:  # interrupted: leave nothing running
            _stop(process)
            raise
    if returncode is None:
        output += f"\n(timed out after {timeout} s)"
    counts: dict[str, int] = {}
    last = output.strip().splitlines()[-1] if output.strip() else ""
    for number, kind in _COUNT.findall(last):
        counts["error" if kind.startswith("error") else kind] = int(number)
    failed = tuple(dict.fromkeys(_FAILED.findall(output)))
    seconds = time.monotonic() - started
    return RunResult(-1 if returncode is None else returncode, failed, counts, seconds, output, returncode is None)


def _stop(process: subprocess.Popen[str]) -> str:
    """Stop a run and its process group: SIGINT first (pytest unwinds, its fixtures stop the engines they started,
    which run in sessions of their own), SIGKILL after ``GRACE`` seconds. Its output so far."""
    _signal_group(process.pid, signal.SIGINT)
    try:
        output, _ = process.communicate(timeout=GRACE)
    except subprocess.TimeoutExpired:
        _signal_group(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
    return output


def _signal_group(pid: int, number: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, number)
