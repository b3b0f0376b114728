# SPDX-License-Identifier: Apache-2.0
"""``python -m vllm_ascend_routing doctor``: the report, and a clear FAIL where the plugin cannot run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.harness import distributed
from tests.harness.generation_cases import once_per_generation
from tests.harness.vllm_cache import fresh_cache_root
from vllm_ascend_routing.compat import UnsupportedVllmError
from vllm_ascend_routing.preflight import doctor, findings, guide, self_check


def test_report_lists_every_setting_with_its_effective_value(
    monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    from vllm_ascend_routing.compat import adapter as get_adapter

    request.addfinalizer(get_adapter.cache_clear)  # the adapter the override picked must not outlive this test
    get_adapter.cache_clear()
    monkeypatch.setenv("VLLM_ASCEND_ROUTING_VLLM_API", "shm")
    lines, _ = findings.environment_report()
    values = dict(lines)
    assert values["VLLM_ASCEND_ROUTING_VLLM_API"] == "shm"
    assert values["VLLM_ASCEND_ROUTING"] == "False (default)"
    assert {"platform", "kernel backend", "API generation"} <= set(values)
    # The tooling settings nobody set are one line, not one each.
    assert "VLLM_ASCEND_ROUTING_MODELS" not in values and "_MODELS" in values["build and tooling settings"]


def test_the_settings_doctor_forces_are_labelled_as_such(monkeypatch: pytest.MonkeyPatch) -> None:
    """doctor runs its engine with the plugin on and validation on: the report says so, not "(default)"."""
    monkeypatch.delenv("VLLM_ASCEND_ROUTING", raising=False)
    monkeypatch.delenv("VLLM_ASCEND_ROUTING_VALIDATE", raising=False)
    from vllm_ascend_routing.preflight import model_check

    monkeypatch.setattr(findings, "targets", fake_targets(1))
    monkeypatch.setattr(findings, "binder_coverage", lambda: {"module_level": False, "rows": [], "unknown": []})
    monkeypatch.setattr(self_check, "run", lambda *a: {"ok": True, "detail": "stand-in"})
    monkeypatch.setattr(model_check, "run", lambda *a, **k: (True, "stand-in", {}))
    for model, validate in ((None, "log"), ("/", "strict")):
        printed: list[str] = []
        report = doctor.new_report()
        doctor.run(print_fn=printed.append, platform="cpu", model=model, report=report)
        lines = {line.split()[0]: line.split(None, 1)[1] for line in printed[1:] if line.startswith("  VLLM_")}
        assert lines["VLLM_ASCEND_ROUTING"] == "True (set by doctor: its engine runs the plugin)", lines
        assert lines["VLLM_ASCEND_ROUTING_VALIDATE"].startswith(f"{validate} (set by doctor: every returned array")
        settings = {setting["name"]: setting for setting in report["settings"]}
        assert settings["VLLM_ASCEND_ROUTING"]["source"] == "doctor"
        assert "VLLM_ASCEND_ROUTING" not in os.environ  # restored once doctor is done
    monkeypatch.setenv("VLLM_ASCEND_ROUTING_VALIDATE", "strict")  # the self-check keeps the user's own mode
    report = doctor.new_report()
    doctor.run(print_fn=lambda line: None, platform="cpu", report=report)
    settings = {setting["name"]: setting for setting in report["settings"]}
    assert (settings["VLLM_ASCEND_ROUTING_VALIDATE"]["value"], settings["VLLM_ASCEND_ROUTING_VALIDATE"]["source"]) == (
        "strict",
        "environment",
    )
    report = doctor.new_report()
    doctor.run(print_fn=lambda line: None, platform="cpu", surface=True, report=report)
    assert {setting["source"] for setting in report["settings"]} <= {"default", "environment"}  # nothing forced


def test_refusal_ends_with_fail_and_no_self_check(monkeypatch: pytest.MonkeyPatch) -> None:
    def refused() -> None:
        raise UnsupportedVllmError("vLLM 0.21.0 is refused: use 0.20.x or 0.22-0.30")

    monkeypatch.setattr("vllm_ascend_routing.compat.vllm_version", lambda: "0.21.0")
    monkeypatch.setattr("vllm_ascend_routing.compat.adapter", refused)
    monkeypatch.setattr(self_check, "run", lambda *a: pytest.fail("no self-check after a refusal"))
    printed: list[str] = []
    assert doctor.run(print_fn=printed.append) == 1
    assert printed[-1] == (
        doctor.VERDICT + "FAIL (plugin_refused): vLLM 0.21.0 is refused: use 0.20.x or 0.22-0.30. Next: "
        f"{guide.PLUGIN_REFUSED}"
    )
    assert any("0.21.0" in line and "vLLM" in line for line in printed[:3])


def test_malformed_setting_is_a_finding(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ASCEND_ROUTING", "maybe")
    lines, problem = findings.environment_report()
    assert "expected 0 or 1" in dict(lines)["VLLM_ASCEND_ROUTING"] and problem is not None


def passing_doctor(tmp_path: Path, *args: str) -> list[str]:
    """``python -m vllm_ascend_routing doctor ARGS`` in a process of its own: its output lines, once it passed."""
    env = {**os.environ, "VLLM_CACHE_ROOT": str(fresh_cache_root(tmp_path / "cache"))}
    done = subprocess.run(
        [sys.executable, "-m", "vllm_ascend_routing", "doctor", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # as a terminal shows both: the verdict must be the last line of all
        text=True,
        env=env,
        timeout=900,
        cwd=tmp_path,
    )
    lines = done.stdout.strip().splitlines()
    verdicts = [line for line in lines if line.startswith(doctor.VERDICT)]
    assert done.returncode == 0 and verdicts == [doctor.VERDICT + "PASS"], done.stdout[-6000:]
    assert lines[-1] == doctor.VERDICT + "PASS", lines[-20:]  # the engine shut down before it: nothing follows
    return lines


def on_the_newest_generation_only(option: str) -> None:
    """Options whose code is the same on every generation run on the newest (aux-output: make e2e-0.32.0)."""
    from vllm_ascend_routing.compat._detect import detect_generation  # not get_adapter: other tests override it

    if detect_generation().value != "aux-output":
        pytest.skip(f"doctor {option} is generation-independent; it runs on the aux-output generation (0.32.0)")


@pytest.mark.vllm
@pytest.mark.e2e
def test_doctor_passes_on_this_release(tmp_path: Path) -> None:
    # Its engine is the offline scenario's (run on every release by tests/e2e); the report around it is the
    # generation's. doctor --surface, which differs per release, runs on every one (below).
    once_per_generation("doctor's self-check", distributed.vllm_release())
    lines = passing_doctor(tmp_path, "--prompts", "2", "--mode", "eager")
    assert any(line.strip().startswith("API generation") for line in lines)
    detail = next(line for line in lines if "rows exact" in line and "batch" in line)
    # The workers' always-on check counted the run's rows (their counters fetched, wherever the workers run).
    assert re.search(r"always-on check: [1-9]\d* rows in \d+ steps, 0 all-zero, 0 invalid ids", detail), detail
    # vLLM's reload_weights on the same engine, then the same prompts (the first MoE layer where vLLM's reload
    # changes the model, with a note saying so).
    assert re.search(r"after_reload [1-9]\d*/[1-9]\d* rows exact", detail), detail
    print(detail)
    forced = r"^\s+VLLM_ASCEND_ROUTING\s+True \(set by doctor: its engine runs the plugin\)$"
    assert any(re.match(forced, line) for line in lines)


@pytest.mark.vllm
@pytest.mark.e2e
def test_doctor_in_bfloat16_passes_with_its_flips_counted(tmp_path: Path) -> None:
    """The self-check as on a GPU or NPU (bfloat16 against the float32 reference, flips within bfloat16's
    rounding counted), on the CPU build."""
    on_the_newest_generation_only("--dtype")
    lines = passing_doctor(tmp_path, "--dtype", "bfloat16", "--prompts", "4", "--mode", "eager")
    assert any(line.startswith("self-check:") and "qwen3_moe_robust" in line and "bfloat16" in line for line in lines)
    print(next(line for line in lines if "rows" in line and "batch" in line))


@pytest.mark.vllm
@pytest.mark.e2e
def test_doctor_checks_a_users_own_model(tmp_path: Path) -> None:
    """``doctor --model PATH``: strict validation and the always-on check on a model the user names (here an
    e2e model with a dense layer), per-layer rows: the dense layer's all zero, every MoE layer's none."""
    from vllm_ascend_routing.preflight import models

    on_the_newest_generation_only("--model")
    model = models.build_tiny_moe("qwen3_moe_dense", tmp_path / "model")
    lines = passing_doctor(
        tmp_path, "--model", str(model.path), "--prompts", "3", "--max-tokens", "6", "--mode", "eager",
        "--", "--max-num-batched-tokens", "32",  # an engine flag, read by vLLM's parser: smaller prefill chunks
    )  # fmt: skip
    table = lines[lines.index("  layer    rows  all-zero  experts routed to  layer type") + 1 :]
    rows = {
        int(words[0]): (int(words[1]), int(words[2]), int(words[3]), " ".join(words[4:]))
        for words in map(str.split, table[: model.num_hidden_layers])
    }
    assert set(rows) == set(range(model.num_hidden_layers))
    for layer, (n, zero, experts, kind) in rows.items():
        assert n > 0
        if layer in model.moe_layers:
            assert zero == 0 and experts > model.top_k and kind == "MoE", (layer, rows)
        else:  # a dense layer: vLLM's zeros, labelled as such
            assert zero == n and experts == 1 and kind == "dense: no router, all zero by design", (layer, rows)
    assert any("strict validation passed" in line and "always-on check" in line for line in lines)
    # What doctor set for its engine, and the tables' columns, are said in the report itself.
    assert any(line.strip().startswith("set by doctor for this engine: ") for line in lines)
    assert any(line.strip() == "columns of the tables above:" for line in lines)
    # The re-prefill consistency oracle, on the flags given: every MoE layer's rows agree, PASS.
    assert any("engine flags: --max-num-batched-tokens 32" in line for line in lines)
    assert any("step budget 32" in line for line in lines)
    oracle = next(line for line in lines if line.strip().startswith("re-prefill consistency:"))
    assert "(100.00%), 0 near-ties" in oracle and oracle.endswith(": PASS"), oracle


def test_doctor_knows_the_platforms_the_runner_hooks_know() -> None:
    from vllm_ascend_routing.manifest import platforms

    assert set(doctor.PLATFORMS) == set(platforms())


def fake_environment(release: str) -> Callable[..., None]:
    """A stand-in for ``findings.environment``: vLLM ``release`` of the aux-output generation, nothing refused."""

    def environment(report: dict[str, Any], forced: dict[str, str] | None = None) -> None:
        report.update(vllm=release, generation="aux-output", platform="", kernel_backend="reference")

    return environment


def fake_targets(verified: int, problem: str | None = None) -> Callable[[str], dict[str, Any]]:
    """A stand-in for ``findings.targets``: ``verified`` present targets, then one with ``problem`` if given."""

    def targets(platform: str) -> dict[str, Any]:
        rows = [
            {"target": f"vllm.x:T{i}", "action": "replace", "present": True, "problem": None} for i in range(verified)
        ]
        gone = {"target": "vllm.x:Gone", "action": "rely", "present": False, "problem": problem}
        rows += [] if problem is None else [gone]
        total = len(rows)
        counted = f"{verified} patch targets + 0 relied-on symbols verified"
        return {
            "generation": "aux-output",
            "platform": platform,
            "verified": verified,
            "total": total,
            "rows": rows,
            "counted": counted,
        }

    return targets


def test_an_unknown_platform_is_a_clear_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(findings, "environment", fake_environment("0.33.0"))
    monkeypatch.setattr(findings, "platform", lambda: "")  # vLLM's CUDA wheel on a machine without a GPU
    printed: list[str] = []
    assert doctor.run(print_fn=printed.append, surface=True) == 1
    assert printed[-1].startswith(doctor.VERDICT + "FAIL (platform): vLLM reports platform ''")
    assert "--platform" in printed[-1]


def test_a_kind_of_layer_vllm_binds_that_the_plugin_does_not_know_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.34 might name a new seam in its binder: doctor --surface (and make matrix's static row) fail on it."""
    from vllm_ascend_routing.backends import upstream

    monkeypatch.setattr(findings, "environment", fake_environment("0.34.0"))
    monkeypatch.setattr(findings, "targets", fake_targets(3))
    known = [upstream.Seam("BaseRouter", upstream.KNOWN_NAMES["BaseRouter"])]
    monkeypatch.setattr(upstream, "seams", lambda: [*known, upstream.Seam("RoutedExpertsTap", "")])
    printed: list[str] = []
    assert doctor.run(print_fn=printed.append, surface=True, platform="cuda") == 1
    assert any(line.split() == ["UNKNOWN", "RoutedExpertsTap:", "not", "known"] for line in printed), printed
    assert printed[-1].startswith(doctor.VERDICT + "FAIL (not_covered): vLLM's binder names RoutedExpertsTap")
    monkeypatch.setattr(upstream, "seams", lambda: known)
    printed.clear()
    assert doctor.run(print_fn=printed.append, surface=True, platform="cuda") == 0
    assert any(line.strip() == "ok  BaseRouter: bound by the plugin (router backend)" for line in printed), printed


def test_binder_classes_are_read_from_the_bytecode() -> None:
    """What upstream.seams reads off vLLM's binder: classes it imports inside its body and vLLM module globals."""
    from vllm_ascend_routing.backends import upstream

    def binder(model: object, capturer: object) -> None:
        from collections import OrderedDict as NotFromVllm  # noqa: F401 (imported names count, capitalised)
        from json import loads  # noqa: F401 (not capitalised: not a class name)

        isinstance(model, int)  # a builtin: no module global

    assert upstream.referenced_classes(binder) == {"OrderedDict"}  # the name imported, not the local alias


def test_the_json_report_holds_what_was_printed(monkeypatch: pytest.MonkeyPatch) -> None:
    """``doctor --json``: the same run, its findings as data; the verdict's text is the last line's."""
    from vllm_ascend_routing.backends import upstream

    monkeypatch.setattr(findings, "environment", fake_environment("0.33.0"))
    monkeypatch.setattr(findings, "targets", fake_targets(2))
    known = [upstream.Seam("BaseRouter", upstream.KNOWN_NAMES["BaseRouter"])]
    monkeypatch.setattr(upstream, "seams", lambda: known)
    printed: list[str] = []
    report = doctor.new_report()
    assert doctor.run(print_fn=printed.append, surface=True, platform="cuda", report=report) == 0
    assert report["schema"] == doctor.SCHEMA and set(report) == set(doctor.new_report())
    assert (report["vllm"], report["generation"], report["platform"]) == ("0.33.0", "aux-output", "cuda")
    assert (report["patches"]["verified"], report["patches"]["total"]) == (2, 2)
    assert report["binder"] == {
        "module_level": True,
        "rows": [{"name": "BaseRouter", "known": True, "handling": "bound by the plugin (router backend)"}],
        "unknown": [],
    }
    verdict = {
        "ok": True,
        "stage": "surface",
        "kind": None,
        "reason": None,
        "next_step": None,
        "text": "PASS (static: 2/2 targets verified)",
    }
    assert report["verdict"] == verdict and report["exit_status"] == 0 and report["self_check"] is None
    assert printed[-1] == doctor.VERDICT + verdict["text"]
    monkeypatch.setattr(findings, "targets", fake_targets(2, "has no attribute 'Gone'"))
    report = doctor.new_report()
    assert doctor.run(print_fn=printed.append, surface=True, platform="cuda", report=report) == 1
    assert report["patches"]["rows"][-1] == {
        "target": "vllm.x:Gone",
        "action": "rely",
        "present": False,
        "problem": "has no attribute 'Gone'",
    }
    assert report["verdict"] == {
        "ok": False,
        "stage": "patches",
        "kind": "not_covered",
        "reason": "has no attribute 'Gone'",
        "next_step": guide.NOT_COVERED,
        "text": f"FAIL (not_covered): has no attribute 'Gone'. Next: {guide.NOT_COVERED}",
    }
    assert report["binder"] is None and report["exit_status"] == 1


def test_the_json_report_of_a_refusal_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    def refused() -> None:
        raise UnsupportedVllmError("vLLM 0.21.0 is refused")

    monkeypatch.setattr("vllm_ascend_routing.compat.vllm_version", lambda: "0.21.0")
    monkeypatch.setattr("vllm_ascend_routing.compat.adapter", refused)
    monkeypatch.setenv("VLLM_ASCEND_ROUTING", "1")
    report = doctor.new_report()
    assert doctor.run(print_fn=lambda line: None, report=report) == 1
    assert (report["vllm"], report["generation"], report["refused"]) == ("0.21.0", None, "vLLM 0.21.0 is refused")
    setting = next(setting for setting in report["settings"] if setting["name"] == "VLLM_ASCEND_ROUTING")
    why = "its engine runs the plugin"
    assert setting == {"name": "VLLM_ASCEND_ROUTING", "value": "True", "source": "doctor", "why": why, "problem": None}
    assert report["verdict"]["stage"] == "environment" and report["verdict"]["reason"] == "vLLM 0.21.0 is refused"
    assert report["verdict"]["kind"] == "plugin_refused"


def test_the_self_check_verdict_counts_parts_and_near_ties() -> None:
    def part(rows: int, matched: int, ties: int = 0, problems: tuple[str, ...] = ()) -> dict[str, Any]:
        return {"rows": rows, "matched": matched, "near_ties": ties, "ok": not problems, "problems": list(problems)}

    results = {"batch": part(93, 93, 2), "chunked_prefill": part(120, 120), "prefix_repeat": part(40, 40, 1)}
    checked = self_check.summary(results, "2 MoE layers bound", [], 4, "eager", "bfloat16")
    assert checked["ok"] and checked["near_ties"] == 3
    assert [p["verdict"] for p in checked["parts"]] == ["93/93 rows exact", "120/120 rows exact", "40/40 rows exact"]
    assert checked["detail"] == (
        "batch 93/93 rows exact, chunked_prefill 120/120 rows exact, prefix_repeat 40/40 rows exact "
        "(3 of them near-tie flips within bfloat16 rounding); 2 MoE layers bound"
    )
    results["batch"] = part(93, 92, problems=("request 1 layer 0 row 3 differs",))
    failed = self_check.summary(results, "2 MoE layers bound", ["1 all-zero routing rows"], 4, "eager", "float32")
    assert not failed["ok"] and failed["detail"] == "batch: request 1 layer 0 row 3 differs; 1 all-zero routing rows"


def test_run_json_prints_one_json_line_on_stdout_and_the_text_on_stderr(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(findings, "environment", fake_environment("0.33.0"))
    monkeypatch.setattr(findings, "targets", fake_targets(1))
    monkeypatch.setattr(findings, "binder_coverage", lambda: {"module_level": False, "rows": [], "unknown": []})
    assert doctor.run_json(surface=True, platform="cpu") == 0
    out, err = capfd.readouterr()
    assert len(out.splitlines()) == 1 and out.startswith(f'{{"schema": "{doctor.SCHEMA}"')
    report = json.loads(out)
    assert report["verdict"]["text"] == "PASS (static: 1/1 targets verified)" and report["exit_status"] == 0
    assert err.splitlines()[-1] == doctor.VERDICT + report["verdict"]["text"]


@pytest.mark.vllm
def test_doctor_json_surface_on_this_release(tmp_path: Path) -> None:
    """``doctor --surface --json`` in a process of its own: stdout is the document alone."""
    done = subprocess.run(
        [sys.executable, "-m", "vllm_ascend_routing", "doctor", "--surface", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    report = json.loads(done.stdout)
    assert report["schema"] == doctor.SCHEMA and report["exit_status"] == done.returncode
    assert report["generation"] is not None and report["patches"]["rows"], done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1].startswith(doctor.VERDICT + report["verdict"]["text"])


def test_doctor_reports_how_many_arrays_validation_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_ascend_routing import validate

    monkeypatch.setenv("VLLM_ASCEND_ROUTING_VALIDATE", "1")
    monkeypatch.setattr(validate, "_checked", 7)
    assert self_check.validation_report() == ("validation mode (log) checked 7 returned arrays", [])
    monkeypatch.setattr(validate, "_checked", 0)
    assert self_check.validation_report()[1] == [
        "validation mode checked no returned array (its front-end hooks did not run)"
    ]
    monkeypatch.setenv("VLLM_ASCEND_ROUTING_VALIDATE", "0")
    assert self_check.validation_report() == ("validation mode off (VLLM_ASCEND_ROUTING_VALIDATE=0)", [])
