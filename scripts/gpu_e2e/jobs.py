# SPDX-License-Identifier: Apache-2.0
"""Run the device run's jobs (engine checks, the kernel build, the CUDA tests) at once, each in a process group of its
own, with a timeout each and one deadline for all; whatever finished by the deadline is kept, the rest is recorded as
timed out or not started (``make gpu-e2e``, and the engine checks' CPU dry run).

A job prints ``GPU_E2E_RESULT {json}`` as its last word on what it found; its exit status says whether it ran to the
end. Its whole output goes to ``LOG_DIR/<name>.log``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

RESULT_PREFIX = "GPU_E2E_RESULT "
POLL_S = 0.5


@dataclass
class Job:
    """One process: ``command`` run with ``env`` (added to this process's), at most ``timeout_s``; started once every
    job named in ``after`` has ended (``needs_ok``: only if they passed, else it is skipped) and ``ready()`` holds."""

    name: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    timeout_s: float = 300.0
    after: tuple[str, ...] = ()
    needs_ok: bool = False
    engine: bool = True  # counts against the parallel engine limit (the kernel build does not)
    cwd: str | None = None
    ready: Callable[[], bool] = field(default=lambda: True, repr=False)


@dataclass
class Outcome:
    name: str
    status: str  # passed, failed, timed out, not started, skipped
    seconds: float = 0.0
    returncode: int | None = None
    result: dict[str, Any] | None = None
    detail: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if v is not None and v != ""}


@dataclass
class _Running:
    job: Job
    process: subprocess.Popen[str]
    log: IO[str]
    started: float


def result_of(log_path: Path) -> dict[str, Any] | None:
    """The last ``GPU_E2E_RESULT`` line of a job's log, parsed."""
    found = None
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for line in lines:
        if line.startswith(RESULT_PREFIX):
            try:
                found = json.loads(line[len(RESULT_PREFIX) :])
            except ValueError:
                found = {"unparsed_result": line[:500]}
    return found


def _stop(running: _Running) -> None:
    """End the job's whole process group (vLLM's engine core and workers are its children): SIGTERM, then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(running.process.pid, sig)
        except ProcessLookupError:
            return
        try:
            running.process.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_jobs(
    jobs: list[Job],
    log_dir: Path,
    deadline: float,
    parallel: int,
    on_event: Callable[[str], None] = print,
) -> dict[str, Outcome]:
    """Run ``jobs`` (at most ``parallel`` engine jobs at a time, in list order as their dependencies allow) until
    each has ended or ``deadline`` (``time.monotonic()``) passes; returns every job's outcome."""
    log_dir.mkdir(parents=True, exist_ok=True)
    outcomes: dict[str, Outcome] = {}
    waiting = list(jobs)
    running: dict[str, _Running] = {}
    known = {job.name for job in jobs}
    for job in jobs:
        missing = [name for name in job.after if name not in known]
        if missing:
            raise ValueError(f"job {job.name} waits for unknown jobs {missing}")
    while waiting or running:
        now = time.monotonic()
        for name, run in list(running.items()):
            elapsed = now - run.started
            code = run.process.poll()
            if code is None and now < deadline and elapsed < run.job.timeout_s:
                continue
            if code is None:
                _stop(run)
                why = "its timeout" if elapsed >= run.job.timeout_s else "the run's deadline"
                status, detail = "timed out", f"stopped at {why} after {elapsed:.0f} s"
            else:
                status, detail = ("passed" if code == 0 else "failed"), ""
            run.log.close()
            outcome = Outcome(name, status, round(elapsed, 1), run.process.returncode, None, detail)
            outcome.result = result_of(log_dir / f"{name}.log")
            outcomes[name] = outcome
            del running[name]
            on_event(f"   {name}: {status} ({elapsed:.0f} s){' ' + detail if detail else ''}")
        if now >= deadline:
            for job in waiting:
                outcomes[job.name] = Outcome(job.name, "not started", detail="the run's deadline came first")
                on_event(f"   {job.name}: not started (the run's deadline came first)")
            waiting = []
            if not running:
                break
            continue
        engines = sum(1 for run in running.values() if run.job.engine)
        for job in list(waiting):
            if any(name not in outcomes for name in job.after):
                continue
            failed = [name for name in job.after if outcomes[name].status != "passed"]
            if job.needs_ok and failed:
                waiting.remove(job)
                outcomes[job.name] = Outcome(
                    job.name, "skipped", detail=f"needs {', '.join(failed)}, which did not pass"
                )
                on_event(f"   {job.name}: skipped (needs {', '.join(failed)})")
                continue
            if (job.engine and engines >= parallel) or not job.ready():
                continue
            log = (log_dir / f"{job.name}.log").open("w")
            log.write(f"$ {' '.join(job.command)}\n")
            log.flush()
            process = subprocess.Popen(
                job.command,
                cwd=job.cwd,
                env={**os.environ, **job.env},
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                text=True,
                start_new_session=True,  # its own process group: the whole engine is stopped together
            )
            running[job.name] = _Running(job, process, log, time.monotonic())
            waiting.remove(job)
            engines += job.engine
            on_event(f"   {job.name}: started (pid {process.pid})")
        time.sleep(POLL_S)
    return outcomes
