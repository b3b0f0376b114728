# SPDX-License-Identifier: Apache-2.0
"""``make gpu-check`` (scripts/gpu_check.py) where it cannot run: a failure with its reason, never a pass."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests import scripts

gpu_check = scripts.load("scripts/gpu_check.py", "_gpu_check_under_test")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: make gpu-check runs the real thing")
def test_without_a_gpu_it_fails_and_says_why() -> None:
    done = subprocess.run(
        [sys.executable, str(scripts.ROOT / "scripts" / "gpu_check.py")],
        cwd=scripts.ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("gpu-check: FAILED: "), done.stdout
    # A CPU-only torch fails at the toolchain; a CUDA torch without a GPU builds, then fails at the gpu step.
    assert "CPU-only build" in last or "no CUDA device visible" in last, last
    assert not list((scripts.ROOT / "vllm_ascend_routing").glob("_C*.so"))  # the build is not left behind


def test_skipped_or_missing_tests_are_a_failure(tmp_path: Path) -> None:
    report = tmp_path / "junit.xml"
    report.write_text('<testsuites><testsuite tests="3" failures="0" errors="0" skipped="1"/></testsuites>')
    counts = gpu_check.junit_counts(report)
    assert counts == {"tests": 3, "failures": 0, "errors": 0, "skipped": 1}
    with pytest.raises(gpu_check.GpuCheckError, match="did not all run"):
        gpu_check.test_verdict(0, counts)
    with pytest.raises(gpu_check.GpuCheckError, match="did not all run"):
        gpu_check.test_verdict(0, {"tests": 0, "skipped": 0})
    with pytest.raises(gpu_check.GpuCheckError, match="exited 1"):
        gpu_check.test_verdict(1, {"tests": 3, "skipped": 0})
    assert gpu_check.test_verdict(0, {"tests": 3, "skipped": 0}) == "3 CUDA tests passed, none skipped"
