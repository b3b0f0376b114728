# SPDX-License-Identifier: Apache-2.0
"""``python -m vllm_ascend_routing doctor``: the report, and a clear FAIL where the plugin cannot run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_ascend_routing import doctor
from vllm_ascend_routing.compat import UnsupportedVllmError


def test_report_lists_every_setting_with_its_effective_value(
    monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    from vllm_ascend_routing.compat import get_api

    request.addfinalizer(get_api.cache_clear)  # the adapter the override picked must not outlive this test
    get_api.cache_clear()
    monkeypatch.setenv("VLLM_ASCEND_ROUTING_VLLM_API", "shm")
    lines, _ = doctor.environment_report()
    values = dict(lines)
    assert values["VLLM_ASCEND_ROUTING_VLLM_API"] == "shm"
    assert values["VLLM_ASCEND_ROUTING"] == "False (default)"
    assert {"platform", "kernel backend", "API generation"} <= set(values)


def test_refusal_ends_with_fail_and_no_self_check(monkeypatch: pytest.MonkeyPatch) -> None:
    def refused() -> None:
        raise UnsupportedVllmError("vLLM 0.21.0 is refused: use 0.20.x or 0.22-0.30")

    monkeypatch.setattr("vllm_ascend_routing.compat.vllm_version", lambda: "0.21.0")
    monkeypatch.setattr("vllm_ascend_routing.compat.get_api", refused)
    monkeypatch.setattr(doctor, "self_check", lambda *a: pytest.fail("no self-check after a refusal"))
    printed: list[str] = []
    assert doctor.run(print_fn=printed.append) == 1
    assert printed[-1] == doctor.VERDICT + "FAIL: vLLM 0.21.0 is refused: use 0.20.x or 0.22-0.30"
    assert any("0.21.0" in line and "vLLM" in line for line in printed[:3])


def test_malformed_setting_is_a_finding(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ASCEND_ROUTING", "maybe")
    lines, problem = doctor.environment_report()
    assert "expected 0 or 1" in dict(lines)["VLLM_ASCEND_ROUTING"] and problem is not None


def passing_doctor(tmp_path: Path, *args: str) -> list[str]:
    """``python -m vllm_ascend_routing doctor ARGS`` in a process of its own: its output lines, once it passed."""
    env = {**os.environ, "VLLM_CACHE_ROOT": str(tmp_path / "cache")}
    done = subprocess.run(
        [sys.executable, "-m", "vllm_ascend_routing", "doctor", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        cwd=tmp_path,
    )
    lines = done.stdout.strip().splitlines()
    verdicts = [line for line in lines if line.startswith(doctor.VERDICT)]  # vLLM workers may log after it
    assert done.returncode == 0 and verdicts == [doctor.VERDICT + "PASS"], done.stdout[-3000:] + done.stderr[-3000:]
    return lines


def on_the_newest_generation_only(option: str) -> None:
    """Options whose code is the same on every generation run on the newest (aux-output: make e2e-0.32.0)."""
    from vllm_ascend_routing.compat._detect import detect_generation  # not get_api: other tests override it

    if detect_generation().value != "aux-output":
        pytest.skip(f"doctor {option} is generation-independent; it runs on the aux-output generation (0.32.0)")


@pytest.mark.vllm
@pytest.mark.e2e
def test_doctor_passes_on_this_release(tmp_path: Path) -> None:
    lines = passing_doctor(tmp_path, "--prompts", "2", "--mode", "eager")
    assert any(line.strip().startswith("API generation") for line in lines)
    assert any("rows exact" in line and "batch" in line for line in lines)


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
    from vllm_ascend_routing.selfcheck import models

    on_the_newest_generation_only("--model")
    model = models.build_tiny_moe("qwen3_moe_dense", tmp_path / "model")
    lines = passing_doctor(
        tmp_path, "--model", str(model.path), "--prompts", "3", "--max-tokens", "6", "--mode", "eager"
    )
    table = lines[lines.index("  layer    rows  all-zero  experts routed to") + 1 :][: model.num_hidden_layers]
    rows = {int(layer): (int(n), int(zero), int(experts)) for layer, n, zero, experts in map(str.split, table)}
    assert set(rows) == set(range(model.num_hidden_layers))
    for layer, (n, zero, experts) in rows.items():
        assert n > 0
        if layer in model.moe_layers:
            assert zero == 0 and experts > model.top_k, (layer, rows)
        else:
            assert zero == n and experts == 1, (layer, rows)  # a dense layer: vLLM's zeros
    assert any("strict validation passed" in line and "always-on check" in line for line in lines)


def test_doctor_knows_the_platforms_the_runner_hooks_know() -> None:
    from vllm_ascend_routing.manifest import platforms

    assert set(doctor.PLATFORMS) == set(platforms())


def test_an_unknown_platform_is_a_clear_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(doctor, "environment_report", lambda: ([("vLLM", "0.33.0")], None))
    monkeypatch.setattr(doctor, "_platform", lambda: "")  # vLLM's CUDA wheel on a machine without a GPU
    printed: list[str] = []
    assert doctor.run(print_fn=printed.append, surface=True) == 1
    assert printed[-1].startswith(doctor.VERDICT + "FAIL: vLLM reports platform ''") and "--platform" in printed[-1]


def test_a_kind_of_layer_vllm_binds_that_the_plugin_does_not_know_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.34 might name a new seam in its binder: doctor --surface (and make matrix's static row) fail on it."""
    from vllm_ascend_routing.backends import upstream

    monkeypatch.setattr(doctor, "environment_report", lambda: ([("vLLM", "0.34.0")], None))
    monkeypatch.setattr(doctor, "target_report", lambda platform: (["patch targets: (none here)"], 3, 3, None))
    known = [upstream.Seam("BaseRouter", upstream.KNOWN_NAMES["BaseRouter"])]
    monkeypatch.setattr(upstream, "seams", lambda: [*known, upstream.Seam("RoutedExpertsTap", "")])
    printed: list[str] = []
    assert doctor.run(print_fn=printed.append, surface=True, platform="cuda") == 1
    assert any(line.split() == ["UNKNOWN", "RoutedExpertsTap:", "not", "known"] for line in printed), printed
    assert printed[-1].startswith(doctor.VERDICT + "FAIL: vLLM's binder names RoutedExpertsTap")
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
