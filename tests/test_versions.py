# SPDX-License-Identifier: Apache-2.0
"""The version fields of ``--version`` and ``doctor --json``: the commit from the build's file or from the checkout
being run, CANN, the NVIDIA driver and GPU name where their tools are present (stand-ins here), none otherwise."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.preflight.test_doctor import fake_environment, fake_targets
from vllm_ascend_routing import __version__, versions
from vllm_ascend_routing.preflight import doctor, findings

ROOT = Path(__file__).resolve().parent.parent


def test_the_commit_of_a_build_is_its_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / versions.BUILD_INFO).write_text(json.dumps({"commit": "0123456789abcdef" * 2 + "+dirty"}))
    monkeypatch.setattr(versions, "PACKAGE_DIR", tmp_path)
    assert versions.commit() == ("0123456789abcdef" * 2 + "+dirty", "build")
    assert versions.version_line() == f"vllm-ascend-routing {__version__} (commit 0123456789ab+dirty, from the build)"


def test_without_a_file_or_a_checkout_there_is_no_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(versions, "PACKAGE_DIR", tmp_path)  # outside any git work tree
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    assert versions.commit() == (None, None)
    assert versions.version_line() == f"vllm-ascend-routing {__version__}"


def test_run_from_a_checkout_the_commit_is_the_checkouts_head() -> None:
    if (versions.PACKAGE_DIR / versions.BUILD_INFO).exists():
        pytest.skip("this package is an installed build, not the checkout")
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("the tests do not run from a git checkout")
    found, source = versions.commit()
    assert source == "checkout" and found is not None and found.removesuffix("+dirty") == head.stdout.strip()


def test_cann_and_the_npu_driver_from_their_install_info(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "ascend_toolkit_install.info").write_text("package_name=Ascend-cann-toolkit\nversion=8.1.RC1\n")
    driver = tmp_path / "version.info"
    driver.write_text("Version=24.1.0\nascendhal_version=7.35.23\n")
    monkeypatch.setenv("ASCEND_HOME_PATH", str(tmp_path))
    monkeypatch.setattr(versions, "NPU_DRIVER_INFO", str(driver))
    assert (versions.cann_version(), versions.npu_driver_version()) == ("8.1.RC1", "24.1.0")


def test_the_cuda_driver_and_gpu_from_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    smi = tmp_path / "nvidia-smi"
    smi.write_text('#!/bin/sh\necho "570.86.15, NVIDIA H100 80GB HBM3"\necho "570.86.15, NVIDIA H100 80GB HBM3"\n')
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert versions.cuda_driver() == ("570.86.15", "NVIDIA H100 80GB HBM3")
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    assert versions.cuda_driver() == (None, None)


def test_doctor_prints_and_reports_the_versions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(findings, "environment", fake_environment("0.33.0"))
    monkeypatch.setattr(findings, "targets", fake_targets(1))
    monkeypatch.setattr(findings, "binder_coverage", lambda: {"module_level": False, "rows": [], "unknown": []})
    fields = {**dict.fromkeys(versions.collect(), None), "vllm_ascend_routing": __version__, "commit": "abc"}
    fields.update(commit_source="build", torch_npu="2.7.1", cann="8.1.RC1", device_name="Ascend910B3")
    monkeypatch.setattr(versions, "collect", lambda: dict(fields))
    printed: list[str] = []
    report = doctor.new_report()
    assert doctor.run(print_fn=printed.append, surface=True, platform="npu", report=report) == 0
    assert report["versions"] == fields
    expected = [
        ("vllm-ascend-routing", f"{__version__} (commit abc, from the build)"),
        ("torch_npu", "2.7.1"),
        ("CANN", "8.1.RC1"),
        ("device", "Ascend910B3"),
    ]
    expected.insert(1, ("vLLM", "0.33.0"))  # the other releases follow vLLM's
    assert [tuple(line.split(None, 1)) for line in printed[1:6]] == expected


def test_version_on_the_command_line_imports_neither_vllm_nor_torch(tmp_path: Path) -> None:
    code = (
        "import runpy, sys; sys.argv = ['x', '--version']\n"
        "try:\n    runpy.run_module('vllm_ascend_routing', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'vllm', 'torch', 'numpy'}))\n"
    )
    env_path = {"PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env_path)
    assert done.returncode == 0, done.stderr
    first, last = done.stdout.splitlines()[0], done.stdout.splitlines()[-1]
    assert first.startswith(f"vllm-ascend-routing {__version__}") and last == "[]"
