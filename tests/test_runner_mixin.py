# SPDX-License-Identifier: Apache-2.0
"""The runner hooks on fake runner classes shaped like vLLM 0.22-0.27 and 0.28-0.30 runners."""

from __future__ import annotations

from typing import Any

import pytest

from vllm_ascend_routing import runner_mixin, runner_state
from vllm_ascend_routing.compat._runners import CAPTURER_HOOKS, RUNNER_CLASSES
from vllm_ascend_routing.compat.runner_output import adapter as runner_output


class FakeAPI:
    runner_hooks = CAPTURER_HOOKS
    runner_classes = RUNNER_CLASSES
    rows_read_in_front_end = False

    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []

    def prepare(self, model: Any, vllm_config: Any, device: Any) -> Any:
        self.events.append(("prepare", model))
        return f"prepared:{id(model)}"

    def attach(self, runner: Any, prepared: Any, capturer: Any) -> None:
        self.events.append(("attach", (prepared, capturer)))


@pytest.fixture
def api() -> FakeAPI:
    return FakeAPI()


def make_runner_classes(binds_via_module: bool) -> tuple[type, type]:
    class GPURunner:
        upstream_bound = 0

        def __init__(self) -> None:
            self.vllm_config = object()
            self.device = "cpu"
            self.steps: list[str] = []

        def load_model(self) -> None:
            self.model = object()
            self.steps.append("load")

        def init_routed_experts_capturer(self) -> None:
            self.steps.append("create capturer")
            if binds_via_module:  # 0.28-0.30: module-level binder, patched by the adapter
                runner_output._bind_through_runner(self.model, "capturer")
            else:  # 0.22-0.27
                self._bind_routed_experts_capturer("capturer")
            self.steps.append("allocate host buffers")

        def _bind_routed_experts_capturer(self, capturer: Any) -> None:
            GPURunner.upstream_bound += 1

    class CPURunner(GPURunner):
        def load_model(self) -> None:  # like vLLM's CPU runner: overrides, calls super
            super().load_model()
            self.steps.append("cpu load")

    return GPURunner, CPURunner


@pytest.mark.parametrize("binds_via_module", [False, True], ids=["0.22-0.27", "0.28-0.30"])
def test_hooks_run_in_order(api: FakeAPI, binds_via_module: bool) -> None:
    gpu, cpu = make_runner_classes(binds_via_module)
    for cls in (cpu, gpu, cpu, gpu):  # any order, repeatedly: idempotent
        runner_mixin.apply_mixin(cls, api)  # type: ignore[arg-type]
    runner = cpu()
    runner.load_model()
    runner.init_routed_experts_capturer()
    assert runner.steps == ["load", "cpu load", "create capturer", "allocate host buffers"]
    prepared = f"prepared:{id(runner.model)}"
    # prepared exactly once (at load, before any forward), attached when vLLM creates its capturer
    assert api.events == [("prepare", runner.model), ("attach", (prepared, "capturer"))]
    assert gpu.upstream_bound == 0  # upstream binding replaced, not stacked
    assert runner_state.binding_runner() is None


def test_bind_without_load_hook_is_loud(api: FakeAPI) -> None:
    gpu, _ = make_runner_classes(False)
    runner_mixin.apply_mixin(gpu, api)  # type: ignore[arg-type]
    runner = gpu()
    runner.model = object()
    with pytest.raises(RuntimeError, match="load_model hook did not run"):
        runner.init_routed_experts_capturer()


def test_module_binder_outside_runner_init_is_loud() -> None:
    with pytest.raises(RuntimeError, match="outside a patched model runner"):
        runner_output._bind_through_runner(object(), "capturer")


def test_module_binder_for_another_model_is_loud(api: FakeAPI) -> None:
    gpu, _ = make_runner_classes(True)
    runner_mixin.apply_mixin(gpu, api)  # type: ignore[arg-type]
    runner = gpu()
    runner.load_model()
    with runner_state.as_binding_runner(runner), pytest.raises(RuntimeError, match="outside"):
        runner_output._bind_through_runner(object(), "capturer")  # e.g. a draft model
