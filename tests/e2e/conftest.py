# SPDX-License-Identifier: Apache-2.0
"""Run scenarios (one vLLM engine each) in subprocesses of this venv and return their JSON verdicts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.harness import cpu_moe_choice, pythonpath
from tests.harness.vllm_cache import fresh_cache_root


class Scenarios:
    def __init__(self, cache_root: Path) -> None:
        self.cache_root = fresh_cache_root(cache_root)  # no compiled graph: really compile
        self.results: dict[tuple[Any, ...], dict[str, Any]] = {}
        # TEST-ONLY, only where this vLLM refuses the float32 test models on this CPU (0.27 on AMX).
        self.standin = cpu_moe_choice.engine_pythonpath_standin()

    def start(
        self, *args: str, plugin: bool = True, in_process: bool = True, env: dict[str, str] | None = None
    ) -> subprocess.Popen[str]:
        env = dict(os.environ if env is None else env)
        env.pop("VLLM_ASCEND_ROUTING", None)
        if plugin:
            env["VLLM_ASCEND_ROUTING"] = "1"
            env["VLLM_ASCEND_ROUTING_VALIDATE"] = "strict"  # every returned array is also contract-checked
            # The workers' always-on check counters come back through collective_rpc with a function.
            env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        if in_process:
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        env["VLLM_CACHE_ROOT"] = str(self.cache_root)
        # The scenarios are the checkout's test harness, not part of the installed package: the root goes on
        # PYTHONPATH (after the stand-in, which imports it too), inherited by the engine's own processes.
        pythonpath(env, *([self.standin] if self.standin is not None else []))
        cmd = [sys.executable, "-m", "tests.harness.scenarios", *args]
        # Own session: a test can kill the engine's whole process tree.
        return subprocess.Popen(
            cmd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=Path.home(),
            start_new_session=True,
        )

    @staticmethod
    def finish(proc: subprocess.Popen[str], timeout: int = 900) -> dict[str, Any]:
        output, _ = proc.communicate(timeout=timeout)
        lines = [line for line in output.splitlines() if line.startswith("SCENARIO_RESULT ")]
        if proc.returncode != 0 or not lines:
            pytest.fail(f"{' '.join(map(str, proc.args))} exited {proc.returncode}:\n{output[-6000:]}")
        return dict(json.loads(lines[-1].removeprefix("SCENARIO_RESULT ")))

    def run_unchecked(self, *args: str, plugin: bool = True) -> tuple[int, str]:
        """Exit status and output, for runs that may fail by design (vLLM alone on some CPUs)."""
        proc = self.start(*args, plugin=plugin)
        output, _ = proc.communicate(timeout=900)
        return proc.returncode, output

    def __call__(
        self, *args: str, plugin: bool = True, in_process: bool = True, env: dict[str, str] | None = None
    ) -> dict[str, Any]:
        """``env``: the scenario's environment instead of this process's (e.g. with a kit's libraries on it)."""
        key = (args, plugin, in_process)
        if key not in self.results:
            self.results[key] = self.finish(self.start(*args, plugin=plugin, in_process=in_process, env=env))
            result = self.results[key]
            if args[0] != "bypass":
                for name, value in result.get("sentinel", {}).items():
                    SENTINEL_TOTALS[name] = SENTINEL_TOTALS.get(name, 0) + value
            if (
                plugin
                and args[0] in FRONT_END_HERE
                and not result.get("upstream_crash")
                and not result.get("refused_only")
            ):
                assert_validated(args, result)
        return self.results[key]


# Scenarios whose front-end (where validation mode checks each returned array) is the scenario's own process.
FRONT_END_HERE = ("offline", "speculative", "disaggregation")
# Arrays validation mode checked over those scenarios: validation that never ran would pass every array.
VALIDATED = {"arrays": 0, "scenarios": 0}


def assert_validated(args: tuple[str, ...], result: dict[str, Any]) -> None:
    checked = int(result.get("validated_arrays", 0))
    if checked <= 0:
        pytest.fail(
            f"scenario {' '.join(args)} ran with VLLM_ASCEND_ROUTING_VALIDATE=strict but validation mode checked "
            "no array (validate.checked_arrays() == 0): its front-end hooks did not run"
        )
    VALIDATED["arrays"] += checked
    VALIDATED["scenarios"] += 1


# The always-on check's counters over every in-process engine of the session (bypass engines excluded): the
# suite's false-positive count. Engines in other processes (TP, DP, serve) are covered by strict mode.
SENTINEL_TOTALS: dict[str, int] = {}


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if SENTINEL_TOTALS:
        terminalreporter.write_line(f"always-on routing check over the exact e2e engines: {SENTINEL_TOTALS}")
    if VALIDATED["scenarios"]:
        terminalreporter.write_line(
            f"validation mode (strict) checked {VALIDATED['arrays']} returned arrays in {VALIDATED['scenarios']} "
            "in-process e2e engines"
        )


@pytest.fixture(scope="session")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> Scenarios:
    return Scenarios(tmp_path_factory.mktemp("vllm_cache"))


@pytest.fixture(scope="session")
def generation() -> str:
    from vllm_ascend_routing.compat import adapter as get_adapter

    return get_adapter().generation.value
