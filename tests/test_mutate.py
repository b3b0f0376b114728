# SPDX-License-Identifier: Apache-2.0
"""``scripts/mutate.py`` (the mutation lane) on a checkout of its own: a mutation is applied to a scratch copy and
reverted, never to the checkout; a caught one names its test; a survivor, a patch that no longer applies, a test
failing without the mutation and a malformed catalogue fail the lane; a pending test is reported as such; a hang
is stopped. And the committed catalogue loads: every entry well formed, every test it names present."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import scripts

mutate = scripts.load("scripts/mutate.py", "_mutate_under_test")

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed (the lane lists files by it)")

CODE = """\
def limit(num_experts):
    return num_experts


def valid(expert, num_experts):
    return 0 <= expert < limit(num_experts)


def spin(n):
    while n:
        n += 1
    return n
"""
TESTS = """\
from pkg.rules import limit, spin, valid


def test_the_last_expert_is_valid():
    assert valid(7, 8)


def test_the_expert_count_is_not_an_expert():
    assert not valid(8, 8)


def test_spin_of_zero():
    assert spin(0) == 0
"""


def entry(name: str, find: str, replace: str, tests: str, **extra: object) -> str:
    fields = {
        "name": name,
        "file": "pkg/rules.py",
        "find": find,
        "replace": replace,
        "claim": f"{name}'s claim",
        "tests": [tests],
        "fast": True,
        **extra,
    }
    lines = ["[[mutation]]"]
    for key, value in fields.items():
        if isinstance(value, bool):
            lines.append(f"{key} = {'true' if value else 'false'}")
        elif isinstance(value, list):
            lines.append(f"{key} = [{', '.join(repr(v) for v in value)}]")
        else:
            lines.append(f"{key} = {value!r}" if "'" not in str(value) else f'{key} = "{value}"')
    return "\n".join(lines) + "\n"


CAUGHT = entry("bound-inclusive", "expert < limit", "expert <= limit", "tests/test_rules.py")
SURVIVOR = entry(
    "limit-plus-one",
    "return num_experts",
    "return num_experts + 1",
    "tests/test_rules.py::test_the_last_expert_is_valid",
)


def checkout(tmp_path: Path, *entries: str, tests: str = TESTS) -> Path:
    """A git checkout with one module, its tests and a catalogue of ``entries``."""
    root = tmp_path / "checkout"
    (root / "pkg").mkdir(parents=True)
    (root / "tests" / "mutations").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "rules.py").write_text(CODE)
    (root / "tests" / "__init__.py").write_text("")
    (root / "tests" / "test_rules.py").write_text(tests)
    (root / "tests" / "mutations" / "rules.toml").write_text("\n".join(entries))
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    return root


def options(**changes: object) -> object:
    return mutate.Options(python=sys.executable, preload=(), **changes)


def lane(root: Path, **changes: object) -> dict[str, object]:
    return {outcome.mutation.name: outcome for outcome in mutate.run_lane(root, options(**changes), say=lambda _: None)}


@pytest.mark.parametrize("fork", [True, False])
def test_a_caught_mutation_names_its_test_and_the_checkout_is_never_touched(tmp_path: Path, fork: bool) -> None:
    root = checkout(tmp_path, CAUGHT)
    before = (root / "pkg" / "rules.py").read_bytes()
    outcome = lane(root, fork=fork)["bound-inclusive"]
    assert outcome.verdict == mutate.CAUGHT and outcome.ok, outcome
    assert outcome.caught_by == ["tests/test_rules.py::test_the_expert_count_is_not_an_expert"]
    assert (root / "pkg" / "rules.py").read_bytes() == before


def test_a_mutation_is_applied_for_its_run_and_reverted_byte_for_byte(tmp_path: Path) -> None:
    root = checkout(tmp_path, CAUGHT)
    (mutation,) = mutate.load_catalogue(root)
    scratch = tmp_path / "scratch"
    mutate.scratch_copy(root, scratch)
    assert (scratch / "tests" / "mutations" / "rules.toml").exists() and not (scratch / ".git").exists()
    with mutate.mutated(scratch, mutation):
        assert "expert <= limit" in (scratch / "pkg" / "rules.py").read_text()
    assert (scratch / "pkg" / "rules.py").read_bytes() == (root / "pkg" / "rules.py").read_bytes()


def test_a_survivor_fails_the_lane_and_is_named(tmp_path: Path) -> None:
    root = checkout(tmp_path, CAUGHT, SURVIVOR)
    done = subprocess.run(
        [sys.executable, str(scripts.ROOT / "scripts" / "mutate.py"), "--root", str(root), "--no-fork"]
        + ["--python", sys.executable],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "limit-plus-one (SURVIVED): limit-plus-one's claim" in done.stdout
    rows = [line.split() for line in done.stdout.splitlines()]
    names = (["bound-inclusive"], ["limit-plus-one"])
    table = {row[0]: row[1] for row in rows if row[:1] in names and ":" not in row[1]}
    assert table == {"bound-inclusive": mutate.CAUGHT, "limit-plus-one": mutate.SURVIVED}
    assert "mutations: 2 (1 SURVIVED, 1 caught)" in done.stdout and done.stdout.rstrip().endswith("FAILED")


@pytest.mark.parametrize(
    ("find", "why"),
    [("expert < maximum", "is not in pkg/rules.py"), ("num_experts", "occurs 4 times in pkg/rules.py")],
)
def test_a_patch_that_no_longer_applies_fails_naming_the_mutation(tmp_path: Path, find: str, why: str) -> None:
    root = checkout(tmp_path, entry("moved", find, "x", "tests/test_rules.py"))
    outcome = lane(root)["moved"]
    assert outcome.verdict == mutate.DOES_NOT_APPLY and not outcome.ok
    assert why in outcome.detail and "update the catalogue entry" in outcome.detail


def test_a_pending_test_is_reported_until_its_file_exists(tmp_path: Path) -> None:
    awaited = entry("awaits", "expert < limit", "expert <= limit", "tests/test_later.py", pending=True)
    missing = entry("missing", "return num_experts", "return 9", "tests/test_gone.py")
    root = checkout(tmp_path, awaited, missing)
    found = lane(root)
    assert found["awaits"].verdict == mutate.PENDING and found["awaits"].ok
    assert "waiting for tests/test_later.py" in found["awaits"].detail
    assert found["missing"].verdict == mutate.ERROR and "tests/test_gone.py do not exist" in found["missing"].detail
    (root / "tests" / "test_later.py").write_text(TESTS.replace("test_the_", "test_later_"))
    assert lane(root)["awaits"].verdict == mutate.CAUGHT  # the file arrived: run, and caught


def test_a_test_failing_without_the_mutation_catches_nothing(tmp_path: Path) -> None:
    broken = TESTS + "\n\ndef test_broken():\n    assert False\n"
    on_broken = entry("on-broken", "expert < limit", "expert <= limit", "tests/test_rules.py")
    root = checkout(tmp_path, on_broken, tests=broken)
    outcome = lane(root)["on-broken"]
    assert outcome.verdict == mutate.ERROR
    assert "fail without the mutation: tests/test_rules.py::test_broken" in outcome.detail


def test_a_selection_that_runs_nothing_is_an_error_not_a_survivor(tmp_path: Path) -> None:
    root = checkout(tmp_path, entry("typo", "expert < limit", "expert <= limit", "tests/test_rules.py::test_nope"))
    outcome = lane(root)["typo"]
    assert outcome.verdict == mutate.ERROR and "do not pass without the mutation" in outcome.detail


def test_a_hang_is_stopped_and_counts_as_caught(tmp_path: Path) -> None:
    """The fork server's child is killed at the entry's timeout, and the server serves the next run."""
    hang = entry("spins", "while n:", "while True:", "tests/test_rules.py::test_spin_of_zero", timeout=6)
    root = checkout(tmp_path, hang, CAUGHT)
    found = lane(root)
    assert found["spins"].verdict == mutate.CAUGHT and found["spins"].caught_by == ["(its tests hung: timed out)"]
    assert found["bound-inclusive"].verdict == mutate.CAUGHT


def test_the_fast_lane_runs_fast_entries_and_checks_every_entry_applies(tmp_path: Path) -> None:
    slow = entry("needs-vllm", "return num_experts", "return 0", "tests/test_rules.py", fast=False, venv="0.30.0")
    stale = entry("stale", "gone", "x", "tests/test_rules.py", fast=False, venv="0.30.0")
    root = checkout(tmp_path, CAUGHT, slow, stale)
    found = lane(root, fast=True)
    assert found["bound-inclusive"].verdict == mutate.CAUGHT
    assert found["needs-vllm"].verdict == mutate.NOT_RUN and found["needs-vllm"].ok
    assert found["stale"].verdict == mutate.DOES_NOT_APPLY  # not run in the fast lane, still kept up to date


@pytest.mark.parametrize(
    ("text", "error"),
    [
        (entry("x", "a", "b", "tests/t.py").replace('claim = "x\'s claim"\n', ""), "missing claim"),
        (entry("x", "a", "b", "tests/t.py", owner="me"), "unknown keys ['owner']"),
        (entry("x", "a", "a", "tests/t.py"), "find must be non-empty and differ from replace"),
        (entry("x", "a", "b", "t.py"), "under tests/"),
        (entry("x", "a", "b", "tests/t.py", venv="0.30.0"), "a fast mutation runs in the dev venv"),
        (entry("x", "a", "b", "tests/t.py", engine=True), "a fast mutation runs in the dev venv"),
        (entry("Bad Name", "a", "b", "tests/t.py"), "lower-case words"),
        (entry("x", "a", "b", "tests/t.py") + entry("x", "c", "d", "tests/t.py"), "named twice"),
        ("[[mutations]]\nname = 'x'\n", "top-level keys ['mutations']"),
    ],
)
def test_a_malformed_catalogue_is_refused_saying_why(tmp_path: Path, text: str, error: str) -> None:
    root = checkout(tmp_path, text)
    with pytest.raises(mutate.CatalogueError, match=error.replace("[", r"\[").replace("]", r"\]")):
        mutate.load_catalogue(root)


def test_the_committed_catalogue_is_well_formed_and_names_tests_that_exist() -> None:
    catalogue = mutate.load_catalogue(scripts.ROOT)
    assert len(catalogue) >= 24
    for mutation in catalogue:
        missing = mutate.missing_tests(scripts.ROOT, mutation)
        assert mutation.pending or not missing, f"{mutation.name}: {missing}"
        assert (scripts.ROOT / mutation.file).is_file(), mutation.name
    assert sum(m.fast for m in catalogue) >= 24  # the CI subset
