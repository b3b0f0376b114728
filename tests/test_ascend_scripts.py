# SPDX-License-Identifier: Apache-2.0
"""``scripts/ascend_src.py`` resolves a vllm-ascend release through pip's own configuration (here a local
find-links folder, as a mirror would be) and unpacks only its Python source, never building it;
``scripts/ascend_matrix.py`` turns the suite's JUnit XML into a row and ``scripts/matrix_docs.py`` renders it."""

from __future__ import annotations

import io
import json
import tarfile
import zipfile
from pathlib import Path

import pytest

from tests import scripts
from vllm_ascend_routing import releases

ascend_src = scripts.load("scripts/ascend_src.py", "_ascend_src_under_test")
ascend_matrix = scripts.load("scripts/ascend_matrix.py", "_ascend_matrix_under_test")
rows, docs = ascend_matrix.rows, ascend_matrix.docs  # the matrix modules it writes the docs with

SOURCE = {"vllm_ascend/__init__.py": "X = 1\n", "vllm_ascend/ops/moe.py": "Y = 2\n", "vllm_ascend/_C.so": "bin"}


def _sdist(folder: Path, release: str) -> None:
    with tarfile.open(folder / f"vllm_ascend-{release}.tar.gz", "w:gz") as archive:
        for name, text in {**SOURCE, "setup.py": "raise SystemExit('never built')\n"}.items():
            data = text.encode()
            info = tarfile.TarInfo(f"vllm_ascend-{release}/{name}")
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))


def _wheel(folder: Path, release: str) -> None:
    with zipfile.ZipFile(folder / f"vllm_ascend-{release}-py3-none-any.whl", "w") as archive:
        for name, text in SOURCE.items():
            archive.writestr(name, text.replace("1", "10"))
        archive.writestr(f"vllm_ascend-{release}.dist-info/METADATA", "Name: vllm-ascend\n")


@pytest.fixture
def index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """pip configured with a local folder as its only source (a mirror); a cache under ``tmp_path``."""
    links = tmp_path / "links"
    links.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setattr(ascend_src, "cache_root", lambda: tmp_path / "cache")
    return links


def test_an_sdist_only_release_is_unpacked_without_building(index: Path) -> None:
    _sdist(index, "9.9.0rc1")
    source = ascend_src.source("9.9.0rc1")
    assert (source / "vllm_ascend" / "ops" / "moe.py").read_text() == "Y = 2\n"
    assert not (source / "vllm_ascend" / "_C.so").exists() and not (source / "setup.py").exists()
    assert "__device_type__" in (source / "vllm_ascend" / "_build_info.py").read_text()
    assert ascend_src.source("9.9.0rc1") == source  # cached


def test_the_wheel_is_preferred_when_one_fits(index: Path) -> None:
    _sdist(index, "9.9.1rc1")
    _wheel(index, "9.9.1rc1")
    source = ascend_src.source("9.9.1rc1")
    assert (source / "vllm_ascend" / "__init__.py").read_text() == "X = 10\n"  # the wheel's
    assert not list(source.rglob("*.dist-info"))


def test_an_unknown_release_says_what_the_index_has(index: Path) -> None:
    _sdist(index, "9.9.0rc1")
    with pytest.raises(SystemExit, match=r"vllm-ascend 1\.2\.3: no wheel for this Python and no sdist.*9\.9\.0rc1"):
        ascend_src.source("1.2.3")


def test_no_package_index_address_is_written_in_the_script() -> None:
    text = (scripts.ROOT / "scripts" / "ascend_src.py").read_text()
    assert "://" not in text and "pypi.org" not in text


def _junit(path: Path, outcomes: dict[str, str]) -> Path:
    cases = []
    for name, outcome in outcomes.items():
        inner = {"failed": "<failure message='x'/>", "skipped": "<skipped message='x'/>"}.get(outcome, "")
        cases.append(f'<testcase classname="tests.ascend.x" name="{name}">{inner}</testcase>')
    path.write_text(f"<testsuites><testsuite>{''.join(cases)}</testsuite></testsuites>")
    return path


def test_a_row_from_the_suite_outcomes(tmp_path: Path) -> None:
    main = _junit(
        tmp_path / "main.xml",
        {
            "test_real_forward_records_the_router_top_k[a.M1-gate-off]": "passed",
            "test_real_forward_records_the_router_top_k[a.M2-gate-off]": "passed",
            "test_real_forward_records_the_router_top_k[a.M2-gate-on]": "failed",
            "test_every_step_hands_off_the_exact_rows[v1-sync]": "passed",
            "test_every_step_hands_off_the_exact_rows[v1-async]": "passed",
            "test_every_step_hands_off_the_exact_rows[v1-sync-hybrid]": "passed",
            "test_every_step_hands_off_the_exact_rows[v2-async]": "passed",
            "test_the_switch_is_vllm_ascends_and_xlite_is_refused": "passed",
        },
    )
    reference = _junit(tmp_path / "ref.xml", {"test_the_kernel_path_in_use": "passed"})
    entry = releases.ascend_release("0.28.0rc1")
    row = ascend_matrix.summarize(entry, ascend_matrix.outcomes(main), ascend_matrix.outcomes(reference))
    assert (row["methods_found"], row["methods_tested"]) == (2, 1)  # M2 failed one of its cases
    assert row["async_scheduling"] == "pass" and row["mrv2"] == "pass" and row["xlite"] == "refused at start-up"
    assert row["ok"] is False and row["result"] == rows.FAIL and "1 failed" in row["tests"]


def test_a_release_whose_vllm_refuses_async_scheduling(tmp_path: Path) -> None:
    """vLLM 0.21.0 refuses routed experts with async scheduling: the row says so where the suite checked it."""
    outcomes = {
        "test_every_step_hands_off_the_exact_rows[v1-sync]": "passed",
        "test_async_scheduling_is_refused": "passed",
    }
    entry = releases.ascend_release("0.21.0rc1")
    main = ascend_matrix.outcomes(_junit(tmp_path / "m.xml", outcomes))
    row = ascend_matrix.summarize(entry, main, main)
    assert row["sync"] == "pass" and row["async_scheduling"] == "refused by vLLM with routed experts"
    outcomes["test_async_scheduling_is_refused"] = "failed"
    main = ascend_matrix.outcomes(_junit(tmp_path / "f.xml", outcomes))
    assert ascend_matrix.summarize(entry, main, main)["async_scheduling"] == "FAIL"


def test_the_vllm_ascend_table_is_rendered_after_vllms(tmp_path: Path) -> None:
    entry = releases.ascend_release("0.30.0rc2")
    passing = {"test_real_forward_records_the_router_top_k[a.M1-gate-off]": "passed"}
    row = ascend_matrix.summarize(
        entry,
        ascend_matrix.outcomes(_junit(tmp_path / "m.xml", passing)),
        ascend_matrix.outcomes(_junit(tmp_path / "r.xml", passing)),
    )
    assert row["sync"] == "V1 refused by vllm-ascend" and row["ok"] is True
    document = {"rows": [], "ascend_rows": [{**row, "checked_at": "2026-11-25T00:00:00Z"}]}
    text = docs.render_markdown(document)
    assert "## vllm-ascend" in text and "| 0.30.0rc2 | 0.30.0 | router | 1 / 1 / 0 |" in text
    json.dumps(document)  # the row is plain JSON


def test_every_release_table_entry_is_a_pypi_style_pair() -> None:
    seen = [entry.release for entry in releases.ASCEND_RELEASES]
    assert seen[0] == "0.20.2rc1" and "0.30.0rc2" in seen and len(seen) == len(set(seen)) == 14
    for entry in releases.ASCEND_RELEASES:
        assert entry.release.startswith(entry.vllm.rsplit(".", 1)[0])  # 0.26.0rc1 -> vLLM 0.26.x
        assert set(entry.runners) <= {"v1", "v2"} and entry.runners
