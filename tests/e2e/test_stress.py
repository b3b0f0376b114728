# SPDX-License-Identifier: Apache-2.0
"""Bounded load test (``make stress`` runs the full one): exact routing for every completed request
under concurrency, preemption, prefix-cache hits, chunked prefill and client aborts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import distributed, pythonpath
from tests.harness.generation_cases import once_per_generation
from tests.harness.vllm_cache import fresh_cache_root

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]


def test_exact_routing_under_load(generation: str, tmp_path: Path) -> None:
    if generation == "shm":
        pytest.skip("vLLM 0.20.x has no routed-experts field in its OpenAI server (the offline suite covers it)")
    # The server's and the scheduler's paths under load are the generation's, not the MoE capture's.
    once_per_generation("the load test", distributed.vllm_release())
    env = {
        **os.environ,
        "VLLM_ASCEND_ROUTING": "1",
        "VLLM_ASCEND_ROUTING_VALIDATE": "strict",
        "VLLM_CACHE_ROOT": str(fresh_cache_root(tmp_path / "cache")),
    }
    pythonpath(env)  # the stress harness is the checkout's (tests/harness), not the installed package's
    cmd = [
        sys.executable,
        "-m",
        "tests.harness.stress",
        "--requests",
        "96",
        "--concurrency",
        "32",
        "--abort-every",
        "8",
        "--deadline",
        "600",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=tmp_path)
    lines = [line for line in done.stdout.splitlines() if line.startswith("STRESS_RESULT ")]
    assert lines, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(lines[-1].removeprefix("STRESS_RESULT "))
    print(result)
    assert result["failed"] == 0, result["failures"]
    assert result["aborted"] == 12 and result["completed"] == 96 - 12
    assert result["rows"] > 0 and result["mismatched_rows"] == 0, result["problems"]
    assert result["preemptions"] > 0 and result["prefix_cache_hits"] > 0  # the pressure really happened
    assert result["ok"] and done.returncode == 0
