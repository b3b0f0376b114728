# SPDX-License-Identifier: Apache-2.0
"""Run a scenario (one vLLM engine) in a subprocess of this venv and return its JSON verdict."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> Any:
    cache_root = tmp_path_factory.mktemp("vllm_cache")  # a fresh compile cache: really compile
    results: dict[tuple[Any, ...], dict[str, Any]] = {}

    def run(*args: str, plugin: bool = True, in_process: bool = True, timeout: int = 900) -> dict[str, Any]:
        key = (args, plugin, in_process)
        if key in results:
            return results[key]
        env = dict(os.environ)
        env.pop("VLLM_ASCEND_ROUTING", None)
        if plugin:
            env["VLLM_ASCEND_ROUTING"] = "1"
        if in_process:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        env["VLLM_CACHE_ROOT"] = str(cache_root)
        cmd = [sys.executable, "-m", "vllm_ascend_routing.testing.scenarios", *args]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=Path.home())
        lines = [line for line in proc.stdout.splitlines() if line.startswith("SCENARIO_RESULT ")]
        if proc.returncode != 0 or not lines:
            tail = (proc.stdout + proc.stderr)[-6000:]
            pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}:\n{tail}")
        results[key] = json.loads(lines[-1].removeprefix("SCENARIO_RESULT "))
        return results[key]

    return run
