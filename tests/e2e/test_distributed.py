# SPDX-License-Identifier: Apache-2.0
"""vLLM's Ray executors and the external launcher with the plugin (TP=2): every row exact where the
variable reaches every worker, a clear start-up refusal where a worker would run without the plugin.

How ``VLLM_ASCEND_ROUTING=1`` reaches the workers differs by executor: RayExecutorV2 copies the engine core's
environment with ``setdefault`` (a value already set on the Ray node wins), the V1 Ray executor overwrites,
names in ``$VLLM_CONFIG_ROOT/ray_non_carry_over_env_vars.json`` are never copied, and a Ray ``runtime_env``
is handed to every worker actor. Exact cases: the variable in the driver's environment, only in the job's
``runtime_env``, the ``LLM`` built inside a Ray actor (verl's pattern), a second Ray node (one TP worker per
node), and torchrun with ``distributed_executor_backend="external_launcher"``. Mismatch cases, which must be
refused at start-up naming the worker and the cause instead of returning all-zero rows: a Ray node whose own
environment says ``VLLM_ASCEND_ROUTING=0``, and the variable on the non-carry-over list.

``make test`` runs ``FULL_SET`` on ``FULL_RELEASE``; ``make test-distributed`` runs every case. vLLM's CPU
platform refuses Ray by itself: the driver and the Ray nodes get the TEST-ONLY stand-in ``tests/harness/ray_standin/``
(``tests/harness/cpu_ray_standin.py``). Ray is not a dependency of vLLM's CPU wheels: the Ray cases need a venv
built with ``scripts/venv.py RELEASE --with ray``.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest

from tests import release_roles
from tests.harness import distributed, scenarios
from vllm_ascend_routing.preflight import models

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]

# What make test runs (each case costs an engine start, about a minute on a 2-core machine, and the suite must
# fit CI's time): on 0.30.0, eager, the two cases sharing one two-node cluster (the variable in the job's
# runtime_env over a node's own =0: exact; in the driver's environment with that node: refused) and torchrun.
# Every case of distributed.CASES, on any release: `make test-distributed RELEASE=...` (docs/evidence.md has
# the table: both executors and every way of passing the variable on 0.30.0, the two-node pair on 0.20.2,
# 0.23.0 and 0.32.0).
FULL_RELEASE = release_roles.FULL_E2E_RELEASE
FULL_SET = ("ray-v2:runtime-env-over-node-0", "ray-v2:node-env-0", "external-launcher")
# Where the two executors and torchrun take a whole engine start each (about 1-2 minutes per case here).
RUN_TIMEOUT_S = 3600
# What each mismatch case's refusal must name besides the plugin: the cause.
CAUSES = {
    "ray-v2:node-env-0": ("node", distributed.VARIABLE),
    "ray-v2:non-carry-over": ("non-carry-over", distributed.VARIABLE),
}


def _ray_installed() -> bool:
    return importlib.util.find_spec("ray") is not None


def cases_for(release: str) -> list[str]:
    return list(FULL_SET) if release == FULL_RELEASE else []


@pytest.fixture(scope="module")
def results(scenario: Any) -> dict[str, Any]:
    """One run of every case selected for this release (the Ray clusters shared between cases)."""
    release = distributed.vllm_release()
    cases = [case for case in cases_for(release) if case == "external-launcher" or _ray_installed()]
    proc = scenario.start("distributed", "--mode", "eager", "--cases", ",".join(cases), in_process=False)
    result = scenario.finish(proc, timeout=RUN_TIMEOUT_S)
    return dict(result)


def _row(case: str, release: str, result: dict[str, Any]) -> str:
    executor, _, how = case.partition(":")
    if "refused" in result:
        outcome = "refused: " + result["refused"].splitlines()[0][:200]
    elif "rows" in result:
        outcome = f"{result['matched']}/{result['rows']} rows exact"
    else:
        outcome = "error: " + str(result.get("error", result))[:200]
    check = f", start-up check {result['check_ms']} ms" if "check_ms" in result else ""
    return f"{executor} | {how or 'torchrun'} | vLLM {release} | {outcome} | {result.get('wall_s', '?')}s{check}"


def _case(case: str) -> Any:
    return pytest.param(case, marks=[] if case == "external-launcher" else [pytest.mark.ray], id=case)


# This release's cases only (read from package metadata at collection: nothing imports vLLM here).
HERE = cases_for(distributed.vllm_release())


@pytest.mark.parametrize("case", [_case(case) for case in distributed.EXACT_CASES if case in HERE])
def test_rows_exact(results: dict[str, Any], case: str) -> None:
    release = results["release"]
    result = results["cases"][case]
    print(_row(case, release, result))
    assert "refused" not in result, result["refused"]
    assert "error" not in result, result
    assert result["ok"], result["problems"]
    moe_layers = len(models.build_tiny_moe("qwen3_moe", scenarios.model_dir() / "qwen3_moe").moe_layers)
    prompts = models.mixed_prompts(distributed.NUM_PROMPTS, seed=1)
    expected = sum(len(p) + distributed.MAX_TOKENS - 1 for p in prompts) * moe_layers
    assert result["rows"] == result["matched"] == expected > 0


@pytest.mark.parametrize("case", [_case(case) for case in distributed.MISMATCH_CASES if case in HERE])
def test_mismatch_refused(results: dict[str, Any], case: str) -> None:
    release = results["release"]
    result = results["cases"][case]
    print(_row(case, release, result))
    assert "refused" in result, f"{case} was not refused at start-up: {result}"
    message = result["refused"]
    assert "vllm-ascend-routing" in message, message
    assert any(cause in message for cause in CAUSES[case]), message


RECIPE_CASE = "ray-v2:runtime-env-over-node-0"


@pytest.mark.ray
@pytest.mark.skipif(RECIPE_CASE not in HERE, reason=f"{RECIPE_CASE} runs on {FULL_RELEASE} (make test's Ray case)")
def test_the_runtime_env_recipe_reaches_every_worker_and_each_says_so(results: dict[str, Any]) -> None:
    """docs/distributed.md's recipe, ``ray.init(runtime_env=...)``, is what the runtime-env cases pass. On two Ray
    nodes, the second with ``VLLM_ASCEND_ROUTING=0`` in its own environment: every worker has the variable, each
    logs the plugin's start-up line (Ray prefixes it with the worker's pid), and the engine logs that it asked
    them all. The same engine run as ``test_rows_exact`` (no engine of its own)."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "distributed.md").read_text()
    shown = re.search(r"ray\.init\(runtime_env=(\{.*?\}\})\)", page)
    assert shown and ast.literal_eval(shown.group(1)) == distributed.RUNTIME_ENV, "the page shows another recipe"
    result = results["cases"][RECIPE_CASE]
    workers, lines = result["workers"], result["plugin_lines"]
    assert len(workers) == 2 and len({worker["ray_node"] for worker in workers}) == 2, workers
    assert all(worker[distributed.VARIABLE] == "1" for worker in workers), workers
    for worker in workers:
        mine = [line for line in lines if f"pid={worker['pid']}" in line and "vllm-ascend-routing enabled: " in line]
        assert mine, f"worker {worker['pid']} logged no start-up line: {lines}"
        print(mine[0])
    checked = [line for line in lines if "vllm-ascend-routing: all 2 worker(s) run the plugin (" in line]
    assert checked, lines
    print(checked[0])
