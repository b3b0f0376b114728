# SPDX-License-Identifier: Apache-2.0
"""The runner hooks on fake runner classes shaped like vLLM 0.22-0.27 and 0.28-0.30 runners."""

from __future__ import annotations

import types
from typing import Any

import pytest

from vllm_ascend_routing import runner_mixin
from vllm_ascend_routing.compat import runner_output


class FakeAPI:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, Any, Any]] = []

    def bind(self, model: Any, capturer: Any, vllm_config: Any) -> None:
        self.calls.append((model, capturer, vllm_config))


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch) -> FakeAPI:
    fake = FakeAPI()
    monkeypatch.setattr(runner_mixin, "get_api", lambda: fake)
    return fake


def make_runner_class(binds_via_module: bool) -> type:
    module_binder = types.SimpleNamespace(bind=None)

    class Runner:
        upstream_bound = False

        def __init__(self) -> None:
            self.model = object()
            self.vllm_config = object()
            self.steps: list[str] = []

        def init_routed_experts_capturer(self) -> None:
            self.steps.append("create capturer")
            capturer = "capturer"
            if binds_via_module:  # 0.28-0.30: module-level binder, patched by the adapter
                runner_output._bind_through_runner(self.model, capturer)
            else:  # 0.22-0.27
                self._bind_routed_experts_capturer(capturer)
            self.steps.append("allocate host buffers")

        def _bind_routed_experts_capturer(self, capturer: Any) -> None:
            Runner.upstream_bound = True

    Runner.module_binder = module_binder  # type: ignore[attr-defined]
    return Runner


@pytest.mark.parametrize("binds_via_module", [False, True], ids=["0.22-0.27", "0.28-0.30"])
def test_hooks_run_in_order_and_bind_target_model(api: FakeAPI, binds_via_module: bool) -> None:
    cls = make_runner_class(binds_via_module)
    runner_mixin.apply_mixin(cls)
    runner_mixin.apply_mixin(cls)  # idempotent
    runner = cls()
    runner.init_routed_experts_capturer()
    assert runner.steps == ["create capturer", "allocate host buffers"]  # vLLM's own init ran
    assert api.calls == [(runner.model, "capturer", runner.vllm_config)]
    assert cls.upstream_bound is False  # upstream binding replaced, not stacked
    assert runner_mixin.binding_runner() is None  # context cleared after init


def test_module_binder_outside_runner_init_is_loud() -> None:
    with pytest.raises(RuntimeError, match="outside a patched model runner"):
        runner_output._bind_through_runner(object(), "capturer")


def test_module_binder_for_another_model_is_loud(api: FakeAPI) -> None:
    cls = make_runner_class(True)
    runner_mixin.apply_mixin(cls)
    runner = cls()
    with runner_mixin.as_binding_runner(runner), pytest.raises(RuntimeError, match="outside"):
        runner_output._bind_through_runner(object(), "capturer")  # e.g. a draft model
