# SPDX-License-Identifier: Apache-2.0
"""``compat.Adapter``: the ``prepare`` every generation shares, each adapter defining only what
differs (its buffer shape, its own refusals, where its flag lives)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from vllm_ascend_routing import compat
from vllm_ascend_routing.compat import _common
from vllm_ascend_routing.compat.interface import Adapter, Generation


def test_every_adapter_prepares_through_the_shared_steps() -> None:
    classes = compat.adapter_classes()
    assert len(classes) == 4
    for adapter in classes:
        assert issubclass(adapter, Adapter), adapter
        assert "prepare" not in vars(adapter), f"{adapter} repeats prepare: define what differs instead"
        assert "routing_shape" in vars(adapter), f"{adapter} must say how its capturer sizes the buffer"


class Recording(Adapter):
    generation = Generation.RUNNER_OUTPUT
    narrowed_by_expert_count = False

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def refuse_before_binding(self, vllm_config: Any) -> None:
        self.calls.append("refuse")

    def routing_shape(self, vllm_config: Any) -> tuple[int, int, int]:
        self.calls.append("shape")
        return (2, 2, 4)


def test_prepare_is_nothing_without_the_flag_then_refusals_shape_and_binding(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    bound = object()

    def prepare_capture(model: Any, vllm_config: Any, device: Any, shape: tuple[int, int, int], **kwargs: Any) -> Any:
        calls.append(f"bind {shape}")
        return bound

    monkeypatch.setattr(_common, "prepare_capture", prepare_capture)
    adapter = Recording(calls)
    off = SimpleNamespace(model_config=SimpleNamespace(enable_return_routed_experts=False))
    assert adapter.prepare(torch.nn.Module(), off, torch.device("cpu")) is None and calls == []
    on = SimpleNamespace(model_config=SimpleNamespace(enable_return_routed_experts=True))
    assert adapter.prepare(torch.nn.Module(), on, torch.device("cpu")) is bound
    assert calls == ["refuse", "shape", "bind (2, 2, 4)"]


def test_the_capture_state_is_kept_through_sleep() -> None:
    """``prepare_capture`` registers what the capture keeps from step to step on the model (``sleep_mode``): vLLM's
    wake-up after a level-2 sleep restores it with the model's buffers (tests/test_sleep_mode.py; e2e:
    tests/e2e/test_sleep_mode.py)."""
    from tests.fakes import FakeModel
    from vllm_ascend_routing import sleep_mode

    model = FakeModel(cpu=True)
    config = SimpleNamespace(
        parallel_config=SimpleNamespace(),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=16),
        kv_transfer_config=None,
        model_config=SimpleNamespace(hf_config=SimpleNamespace()),
    )
    prepared = _common.prepare_capture(
        model,
        config,
        torch.device("cpu"),
        (3, 2, 4),
        generation=Generation.RUNNER_OUTPUT.value,
        narrowed_by_expert_count=False,
        kv_rows=None,
    )
    buffers = dict(model.named_buffers())
    assert buffers[sleep_mode.BUFFER_PREFIX + "invalid_id_count"] is prepared.errors
    assert prepared.layer_ids == (0, 2)
