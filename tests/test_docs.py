# SPDX-License-Identifier: Apache-2.0
"""README is for users, docs/ for the rest: README stays short, every relative link resolves, README links the
docs index and the index links every doc with a line saying what it holds, README's per-generation table agrees
with the release table and the committed matrix, the start-up lines the docs show are the ones the code logs, and
what CI and the DP tests rely on is still said. Standard library only (runs without torch or vLLM)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import ModuleType

import pytest

from tests import scripts

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
INDEX = ROOT / "docs" / "README.md"
GLOSSARY = ROOT / "docs" / "glossary.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_README_LINES = 120  # a newcomer's page: what, for whom, what ran where, two commands, links; detail in docs/


def _load_releases() -> ModuleType:
    # Plain data and the standard library only (see its docstring): loadable without the package's deps.
    return scripts.load("vllm_ascend_routing/releases.py", "_releases_for_docs")


def _prose(text: str) -> str:
    """``text`` without fenced code blocks and inline code, where brackets are not links."""
    return re.sub(r"`[^`\n]*`", "", _strip_fences(text))


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in _strip_fences(path.read_text()).splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = _slug(match.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def _strip_fences(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)


def _links_in(text: str) -> list[str]:
    return re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", _prose(text))


def _links(path: Path) -> list[str]:
    return _links_in(path.read_text())


def test_readme_is_short() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines (at most {MAX_README_LINES}): move detail to docs/"


@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path: Path) -> None:
    broken = []
    for link in _links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", link):  # http:, https:, mailto:
            continue
        target, _, anchor = link.partition("#")
        resolved = (path.parent / target).resolve() if target else path
        if not resolved.exists():
            broken.append(f"{link}: no file {resolved}")
        elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
            broken.append(f"{link}: no heading with anchor #{anchor} in {resolved.relative_to(ROOT)}")
    assert not broken, "\n".join(broken)


def _linked(path: Path) -> set[Path]:
    return {(path.parent / link.partition("#")[0]).resolve() for link in _links(path) if link.partition("#")[0]}


def test_readme_links_the_docs_index_and_the_index_every_doc_with_what_it_holds() -> None:
    assert INDEX.resolve() in _linked(README)
    assert [doc.name for doc in DOCS if doc != INDEX and doc.resolve() not in _linked(INDEX)] == []
    for doc in DOCS:  # one line each: "- [name.md](name.md): what it holds" (a description, not a bare link)
        if doc != INDEX:
            entry = re.search(rf"^- \[{re.escape(doc.name)}\]\({re.escape(doc.name)}\): (.+)$", INDEX.read_text(), re.M)
            assert entry and len(entry.group(1).split()) >= 5, f"docs/README.md: no line saying what {doc.name} holds"


def test_the_glossary_defines_the_words_the_docs_use() -> None:
    terms = re.findall(r"^\*\*(.+?)\.\*\*", GLOSSARY.read_text(), flags=re.MULTILINE)
    assert terms == sorted(terms, key=str.lower), "glossary entries in alphabetical order"
    defined = " ".join(terms).lower()
    for word in ("R3", "binder", "patch targets", "relied-on symbols", "API generation", "MC2", "EPLB", "xlite",
                 "DBO", "copy floor", "A/A", "near-tie", "always-on check", "validation mode", "stand-in"):  # fmt: skip
        assert word.lower() in defined, f"docs/glossary.md does not define {word!r}"
    assert GLOSSARY.resolve() in _linked(README)


def _format_to_pattern(template: str) -> str:
    """A logger format string (``%s``, ``%d``, ``%.1f``) as a regular expression matching what it prints."""
    parts = re.split(r"(%s|%d|%\.1f)", template)
    return "".join({"%s": r".*?", "%d": r"\d+", "%.1f": r"[0-9.]+"}.get(part, re.escape(part)) for part in parts)


def _logged_template(module: str, start: str) -> str:
    """The format string of the logger call in ``module`` whose text starts with ``start`` (string pieces joined)."""
    source = (ROOT / "vllm_ascend_routing" / module).read_text()
    at = source.index(f'"{start}')
    pieces = re.findall(r'"((?:[^"\\]|\\.)*)"', source[at : source.index("\n        ", source.index(",\n", at))])
    return "".join(pieces)


@pytest.mark.parametrize(
    ("path", "module", "start"),
    [
        (README, "integration.py", "vllm-ascend-routing enabled: "),
        (ROOT / "docs" / "usage.md", "integration.py", "vllm-ascend-routing enabled: "),
        (ROOT / "docs" / "usage.md", "peers.py", "vllm-ascend-routing: all "),
        (ROOT / "docs" / "distributed.md", "peers.py", "vllm-ascend-routing: all "),
    ],
    ids=["README-enabled", "usage-enabled", "usage-workers", "distributed-workers"],
)
def test_the_start_up_lines_shown_are_the_ones_the_code_logs(path: Path, module: str, start: str) -> None:
    """A line a doc shows as printed (``INFO <date> <time> [file:line] <text>``) matches the logger call's format."""
    pattern = _format_to_pattern(_logged_template(module, start))
    prefix = r"^(?:\(\w+ pid=\d+\) )?"  # a worker's line under Ray or vLLM's multiprocessing executor
    shown = [line for line in path.read_text().splitlines() if re.match(prefix + "INFO ", line) and start in line]
    assert shown, f"{path.name} shows no line starting {start!r}"
    for line in shown:
        line = re.sub(prefix, "", line)
        header = re.match(r"^INFO \d\d-\d\d \d\d:\d\d:\d\d \[" + re.escape(module) + r":\d+\] ", line)
        assert header, f"{path.name}: not as vLLM's logger prints it: {line}"
        assert re.fullmatch(pattern, line[header.end() :]), f"{path.name}: not what {module} logs: {line}"


def test_readme_gives_the_test_command_ci_runs() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    command = re.search(r"^exec (.+)$", ci, flags=re.MULTILINE)
    assert command, ".ci/run no longer execs one command"
    readme = README.read_text()
    assert f"`{command.group(1).strip()}` is the test command" in readme
    assert any(line.startswith(f"{command.group(1).strip()} ") for line in readme.splitlines())  # quick start


def test_test_stand_ins_are_named_in_docs_and_said_in_readme() -> None:
    development = (ROOT / "docs" / "development.md").read_text()
    for standin in (
        "tests/harness/cpu_dp_collectives.py",
        "tests/harness/no_amx_standin/sitecustomize.py",
    ):
        assert (ROOT / standin).exists()
        assert standin in development
    readme = " ".join(README.read_text().split())
    assert (
        "Test-only stand-ins (`tests/harness/`, not in the wheel; never used by the plugin): gloo collectives" in readme
    )
    assert "AMX hidden from vLLM 0.27's CPU MoE" in readme


def _generation_rows() -> dict[str, list[str]]:
    readme = README.read_text()
    section = readme[readme.index("## Supported releases") :]
    rows: dict[str, list[str]] = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("| `") and len(cells) > 4:
            rows[cells[0].strip("`")] = cells
    return rows


def test_readme_generation_table_matches_the_release_table_and_the_matrix() -> None:
    releases = _load_releases()
    matrix_rows = json.loads((ROOT / "docs" / "compatibility.json").read_text())["rows"]
    readme_rows = _generation_rows()
    assert set(readme_rows) == {span.generation.value for span in releases.GENERATIONS}
    for span in releases.GENERATIONS:
        cells = readme_rows[span.generation.value]
        expected_span = span.first if span.first == span.last_tested else f"{span.first}–{span.last_tested}"
        assert cells[1] == expected_span, (
            f"README row {cells[0]}: releases {cells[1]!r}, releases.py says {expected_span!r}"
        )
        rows = [row for row in matrix_rows if row["generation"] == span.generation.value]
        checked = [row for row in rows if row["check"] != "static surface"]  # run end to end
        static = [row for row in rows if row["check"] == "static surface" and row["result"] == "pass"]
        if span.supported:
            passed = sum(row["result"] == "pass" for row in checked)
            surface = f" + {len(static)} static" if static else ""
            assert cells[4] == f"{passed} / {len(checked)} exact{surface}", (
                f"README row {cells[0]}: matrix cell {cells[4]!r}, docs/compatibility.json has {passed} of "
                f"{len(checked)} passing"
            )
        else:
            assert {row["result"] for row in checked} == {cells[4]}


def test_the_helpers_parse_what_they_must() -> None:
    assert _slug("Does replay close the gap? `make replay-check`") == "does-replay-close-the-gap-make-replay-check"
    assert _slug("In depth: the end-to-end suite (`make test`, one release per API generation)") == (
        "in-depth-the-end-to-end-suite-make-test-one-release-per-api-generation"
    )
    assert _links_in("see [a](docs/a.md#b), `[not](a link)`, [web](https://x.y)\n```\n[no](c.md)\n```\n") == [
        "docs/a.md#b",
        "https://x.y",
    ]
