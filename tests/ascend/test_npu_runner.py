# SPDX-License-Identifier: Apache-2.0
"""The plugin on vllm-ascend's real NPU model runners: registered on the NPU platform, patched when the worker
imports the runner module, capturer created by vLLM's real ``init_routed_experts_capturer``, every step run
through the methods installed on the runner class (``execute_model`` / ``sample_tokens``), rows handed off by
the runner's own statements, synchronous and asynchronous, over real MoE forwards — see ``npu_runner_step``.
Each case runs in a process of its own (forked after the imports every case makes): the post-import patch must
see the runner module's first import.

Which runner serves routed experts, per vllm-ascend release (``releases.py`` ``ASCEND_RELEASES``): the
V1 runner up to 0.29.0rc1;
Model Runner V2 from 0.28.0rc1 (vLLM 0.28 added routed experts to it; before, vLLM's config validation refuses
the combination, and so does the plugin); 0.30.x refuses routed experts on V1 itself (its platform check)."""

from __future__ import annotations

import functools
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from tests.ascend.conftest import ASCEND_RELEASE, EXPECTED
from vllm_ascend_routing.compat import adapter as get_adapter
from vllm_ascend_routing.compat.interface import Generation, UnsupportedVllmError

pytestmark = [pytest.mark.vllm, pytest.mark.ascend]

ROOT = Path(__file__).resolve().parents[2]
SERVING = EXPECTED.runners if EXPECTED is not None else ()
# vLLM 0.21.0 (device-cache) refuses routed experts with async scheduling (test_async_scheduling_is_refused).
DEVICE_CACHE = EXPECTED is not None and get_adapter().generation is Generation.DEVICE_CACHE
CASES = [
    (kind, mode, hybrid)
    for kind in SERVING
    for mode in (("sync",) if DEVICE_CACHE else ("sync", "async") if kind == "v1" else ("async",))  # MRV2: async
    for hybrid in (False, True)
]


# The case run in verl's order (vllm-ascend's capture patch imported before the plugin registers); every test
# of this module holds for it as for the others.
VERL_ORDER_CASE = CASES[0] if CASES else None


def step_args(kind: str, mode: str, hybrid: bool) -> list[str]:
    args = [kind] + (["--async"] if mode == "async" else []) + (["--hybrid"] if hybrid else [])
    if (kind, mode, hybrid) == VERL_ORDER_CASE:
        args.append("--capture-patch-first")
    return args


@functools.cache
def run_cases() -> tuple[dict[str, dict[str, Any]], str]:
    """Every case, each in a process of its own forked after the imports all make (``npu_runner_cases``): each
    case's RESULT by its arguments, and the whole output."""
    done = subprocess.run(
        [sys.executable, "-m", "tests.ascend.npu_runner_cases", *(" ".join(step_args(*case)) for case in CASES)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
    )
    results: dict[str, dict[str, Any]] = {}
    case = None
    for line in done.stdout.splitlines():
        if line.startswith("CASE "):
            case = line.removeprefix("CASE ")
        elif line.startswith("RESULT ") and case is not None:
            results[case] = json.loads(line.removeprefix("RESULT "))
    return results, done.stdout[-3000:] + done.stderr[-6000:]


def run_step(kind: str, mode: str, hybrid: bool) -> dict[str, Any]:
    results, output = run_cases()
    case = " ".join(step_args(kind, mode, hybrid))
    assert case in results, f"case {case!r} printed no RESULT:\n{output}"
    return results[case]


def case_id(case: tuple[str, str, bool]) -> str:
    kind, mode, hybrid = case
    return f"{kind}-{mode}" + ("-hybrid" if hybrid else "")


def test_the_release_is_in_the_release_table() -> None:
    assert EXPECTED is not None, f"vllm-ascend {ASCEND_RELEASE}: add it to releases.py ASCEND_RELEASES"


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_the_runner_is_patched_when_the_worker_imports_it(case: tuple[str, str, bool]) -> None:
    steps = run_step(*case)
    assert steps["imported_before_register"] is False
    if DEVICE_CACHE:  # the plugin ships the rows itself; vLLM's capturer creation is the plugin's replacement
        hooks = {"load_model", "initialize_kv_cache", "execute_model", "sample_tokens", "init_routed_experts_capturer"}
        assert set(steps["hooked"]) == hooks
        return
    assert {"load_model", "execute_model", "init_routed_experts_capturer"} <= set(steps["hooked"])
    assert "_bind_routed_experts_capturer" in steps["hooked"]  # the runner's own, or added for vLLM's binder
    assert "sample_tokens" not in steps["hooked"]  # runner-output / shm: vLLM's runner ships the rows itself


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_every_step_hands_off_the_exact_rows(case: tuple[str, str, bool]) -> None:
    kind, mode, hybrid = case
    steps = run_step(*case)
    if DEVICE_CACHE:
        check_device_cache_steps(steps, hybrid)
        return
    if hybrid and get_adapter().generation is Generation.SHM:  # vLLM 0.20.x: the snapshot cannot be re-taken
        assert "keys routed-experts rows by KV cache group 0's slots" in steps["refused"]
        return
    assert "refused" not in steps, steps.get("refused")
    assert steps["workers_bound_layers"] == [steps["moe_layers"]]  # the engine's start-up question, answered
    assert steps["buffer_is_plugins"] is True
    assert steps["load_model_wraps"].endswith("load_model")
    blocks = steps["blocks"]
    if kind == "v1":
        assert blocks["start"] or get_adapter().generation is not Generation.SHM, blocks
        assert blocks["after"], blocks  # found in the real source, so they really ran
        if get_adapter().generation is not Generation.SHM:
            assert blocks["slots"], blocks
            # An async branch (a cloned snapshot, copied on the output stream), or the one synchronous copy serving
            # both schedulings: vllm-ascend before its async fix (#10727, e.g. 0.22.1rc1) synchronises the stream
            # before building the output, so the async output carries complete rows too.
            assert blocks["async"] or blocks["after_synchronises"], blocks
        else:  # 0.20.x: one hand-off (a synchronous shared-memory save), whatever the scheduling
            assert blocks["async"] == [], blocks
    else:
        assert blocks["execute"], blocks
    for step in steps["steps"]:
        num_tokens = len(step["slots"])
        # the class's execute_model is the plugin's hook around the runner's own (vllm-ascend's NPU runner)
        assert step["wraps"] == ["NPUModelRunner.execute_model", "not hooked"]
        if get_adapter().generation is Generation.SHM:
            assert step["stored_rows"] == step["expected"]
        else:
            assert step["shipped_dtype"] == "int16"
            assert step["shipped_rows"] == step["expected"]
            # the attention group's slots: the ones the scheduler files rows by (not group 0's in a hybrid)
            assert step["shipped_slots"] == step["slots"]
        assert all(row[1] == [0, 0] and row[3] == [0, 0] for row in step["expected"][:num_tokens])  # dense
    # The always-on check ran on vllm-ascend's runner every step and found no all-zero row, no invalid id.
    checked = steps["sentinel"]
    assert checked["steps_checked"] >= len(steps["steps"]) > 0 and checked["rows_checked"] > 0, checked
    assert checked["zero_rows"] == 0 and checked["invalid_ids"] == 0, checked


def check_device_cache_steps(steps: dict[str, Any], hybrid: bool) -> None:
    """vLLM 0.21.0: each sampling request's new rows (MoE layers only, int16) in the runner's own output."""
    assert "refused" not in steps, steps.get("refused")
    assert steps["workers_bound_layers"] == [steps["moe_layers"]]
    assert steps["load_model_wraps"] == "NPUModelRunner.load_model"
    assert steps["initialize_kv_cache_wraps"] == "NPUModelRunner.initialize_kv_cache"
    # the runner's own statements were found in its source, so they really ran (each gated off by the plugin)
    assert steps["blocks"]["create"] and steps["blocks"]["start"] and steps["blocks"]["after"], steps["blocks"]
    assert steps["routed_experts_initialized"] is False
    shipped_requests = 0
    for step in steps["steps"]:
        assert step["wraps"] == ["NPUModelRunner.execute_model", "NPUModelRunner.sample_tokens"]
        assert step["shipped_dtypes"] == ["int16"]
        assert step["shipped"] == step["expected"]  # chunked prefill: "b"'s first chunk ships with its last
        shipped_requests += len(step["shipped"])
    assert shipped_requests == 4
    assert steps["store_group"] == steps["attention_group"] == (1 if hybrid else 0)  # the attention group's slots
    checked = steps["sentinel"]
    assert checked["steps_checked"] >= len(steps["steps"]) > 0 and checked["rows_checked"] > 0, checked
    assert checked["zero_rows"] == 0 and checked["invalid_ids"] == 0, checked


def test_async_scheduling_is_refused() -> None:
    """vLLM 0.21.0 refuses routed experts with async scheduling (its config validation, on every platform); the
    plugin's sample hook also refuses an output that cannot carry the rows rather than ship none."""
    if not DEVICE_CACHE:  # the other generations serve it: their async cases run above
        assert any(mode == "async" for _, mode, _ in CASES), CASES
        return
    from vllm.config import VllmConfig

    config = SimpleNamespace(
        parallel_config=SimpleNamespace(
            pipeline_parallel_size=1, prefill_context_parallel_size=1, decode_context_parallel_size=1
        ),
        scheduler_config=SimpleNamespace(async_scheduling=True),
    )
    with pytest.raises(ValueError, match="async scheduling"):
        VllmConfig._validate_return_routed_experts(config)  # type: ignore[arg-type]


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_vllm_ascend_own_binder_and_capture_stay_off(case: tuple[str, str, bool]) -> None:
    steps = run_step(*case)
    if "refused" in steps:
        return  # the hybrid shm case: refused before any capturer existed (asserted above)
    assert steps["vllm_ascend_binder_ran"] is False  # its per-layer capturer attribute was never set
    assert steps["vllm_ascend_capture_calls"] == 0  # vLLM's capturer capture (vllm-ascend patches it): never
    if DEVICE_CACHE:
        # vllm-ascend 0.21.0rc1's unquantized method captures into vLLM's global capturer itself, at the decoder
        # layer id (here 0): that capturer is vLLM's no-op (never created), so nothing lands anywhere.
        assert steps["capturer"] == "_RoutedExpertsCapturerNoop"
        assert steps["vllm_ascend_own_capture_layer_ids"] == [0] * len(steps["steps"])
        return
    if steps["vllm_ascend_capture_patch"]:  # loaded as vllm-ascend's worker loads it: its capture is installed
        assert steps["capturer_capture_module"] == "vllm_ascend.patch.worker.patch_routed_experts_capture"
    else:
        assert ASCEND_RELEASE == "0.20.2rc1"  # the one release without it
    if get_adapter().generation is Generation.SHM:
        assert steps["capturer"] == "ShmRoutedExpertsCapturer"
        assert steps["vllm_ascend_own_capturer"] == "None"  # its MoE method finds no capturer instance
    else:
        assert steps["capturer"] == "RoutedExpertsCapturer"  # vLLM's own, handed the plugin's buffer
    if steps["router_hooks"]:  # router design: each router holds the plugin's capture, nothing else
        assert steps["router_hooks"] == ["LayerRecord"]


def test_vllm_ascend_capture_patch_imported_first_as_verl_does() -> None:
    """verl (``VERL_VLLM_ASCEND_GLM52_PATCH=1``) imports vllm-ascend's own capture patch before vLLM loads the
    plugin: the plugin still owns the capture (rows exact, vllm-ascend's capture never called)."""
    assert VERL_ORDER_CASE is not None
    steps = run_step(*VERL_ORDER_CASE)
    if ASCEND_RELEASE == "0.20.2rc1":  # no such patch in that release: verl's import would fail there
        assert steps["capture_patch_first"] is False
        return
    assert steps["capture_patch_first"] is True
    assert "refused" not in steps, steps.get("refused")
    assert steps["vllm_ascend_capture_calls"] == 0
    if DEVICE_CACHE:  # its worker never loads the patch on vLLM 0.21.0; loaded anyway, nothing calls it
        assert all(step["shipped"] == step["expected"] for step in steps["steps"])
        return
    assert steps["capturer_capture_module"] == "vllm_ascend.patch.worker.patch_routed_experts_capture"
    assert all(
        step["shipped_rows"] == step["expected"] if "shipped_rows" in step else step["stored_rows"] == step["expected"]
        for step in steps["steps"]
    )


def test_a_runner_that_cannot_serve_routed_experts_is_refused() -> None:
    """Where this release's runners do not serve routed experts, the combination is refused at start-up (by
    vllm-ascend, vLLM or the plugin), never run into zeros."""
    if "v1" not in SERVING:  # vllm-ascend 0.30: its platform refuses routed experts on the V1 runner
        platform = importlib.import_module("vllm_ascend.platform")
        config = SimpleNamespace(
            model_config=SimpleNamespace(enable_return_routed_experts=True), use_v2_model_runner=False
        )
        with pytest.raises(ValueError, match="V2 model runner"):
            platform._validate_routing_replay_config(config)
    if "v2" not in SERVING:  # vLLM's Model Runner V2 of this release has no routed-experts capture
        from vllm_ascend_routing.compat.runner_output.adapter import RunnerOutputAdapter

        if DEVICE_CACHE:  # vLLM 0.21.0's own V2 validation refuses routed experts
            from vllm.config import VllmConfig

            v2 = SimpleNamespace(
                model_config=SimpleNamespace(has_inner_state=False, enable_return_routed_experts=True,
                                             logits_processors=None),
                parallel_config=SimpleNamespace(prefill_context_parallel_size=1, enable_dbo=False),
                speculative_config=None,
                cache_config=SimpleNamespace(kv_sharing_fast_prefill=False),
                ec_transfer_config=None,
            )  # fmt: skip
            with pytest.raises(ValueError, match="routed experts capture"):
                VllmConfig._validate_v2_model_runner(v2)  # type: ignore[arg-type]
            return
        if get_adapter().generation is not Generation.RUNNER_OUTPUT:
            return  # 0.20.x: vllm-ascend's worker never builds Model Runner V2 with vLLM 0.20.2
        config = SimpleNamespace(model_config=SimpleNamespace(enable_return_routed_experts=True))
        config.use_v2_model_runner = True  # type: ignore[attr-defined]
        with pytest.raises(UnsupportedVllmError, match="Model Runner V2 has no routed-experts capture"):
            RunnerOutputAdapter().prepare(None, config, None)  # type: ignore[arg-type]
