#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The mutation catalogue (``tests/mutations/*.toml``) for ``scripts/mutate.py``: reading and checking its entries,
applying one to a scratch copy of the checkout and restoring it. Standard library only."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
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
    count = path.read_text(encoding="utf-8").count(mutation.find)
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
    text = original.decode("utf-8")
    if text.count(mutation.find) != 1:
        raise CatalogueError(f"{mutation.name}: {apply_problem(scratch, mutation)}")
    path.write_text(text.replace(mutation.find, mutation.replace, 1), encoding="utf-8")
    try:
        yield
    finally:
        path.write_bytes(original)
