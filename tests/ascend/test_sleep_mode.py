# SPDX-License-Identifier: Apache-2.0
"""vllm-ascend's own level-2 sleep and wake-up (``NPUWorker.sleep`` / ``wake_up``, the release's real source) keep
the capture's state (``sleep_mode``): what the NPU's memory pool loses, its wake-up restores from the model's
registered buffers.

Only the device is stood in for: the ``CaMemAllocator`` (a test-only stand-in whose ``sleep`` discards memory the
way level 2 does: every plugin tensor and model buffer overwritten, ``tests/harness/sleep_stand_in.py``) and
``torch.npu``'s free-memory query. The order of save, discard, wake-up and restore is vllm-ascend's.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType, SimpleNamespace
from typing import Any
from unittest import mock

import pytest
import torch

from tests.fakes import BufferedModel
from tests.harness import sleep_stand_in
from vllm_ascend_routing import sentinel, sleep_mode
from vllm_ascend_routing.capture import PreparedCapture
from vllm_ascend_routing.reporting import ProcessReports

pytestmark = [pytest.mark.vllm, pytest.mark.ascend]


class _LosingAllocator:
    """``CaMemAllocator`` on a device whose level-2 sleep discards the pool (nothing offloaded)."""

    def __init__(self, model: torch.nn.Module, prepared: PreparedCapture) -> None:
        self.model, self.prepared, self.calls = model, prepared, []

    def sleep(self, offload_tags: tuple[str, ...] = ()) -> None:
        self.calls.append(f"sleep {offload_tags}")
        assert offload_tags == (), "level 2 offloads nothing"
        for tensor in sleep_stand_in.plugin_tensors(self.prepared) + list(self.model.buffers()):
            sleep_stand_in.overwrite(tensor)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(f"wake_up {tags}")


def _worker_module(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """vllm-ascend's worker module; its ACL runtime import (``acl.rt``, absent without CANN) stood in."""
    for name in ("acl", "acl.rt"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or mock.MagicMock())
    return importlib.import_module("vllm_ascend.worker.worker")


@pytest.mark.parametrize("kept", [True, False])
def test_vllm_ascends_level_2_wake_up_restores_the_capture_state(monkeypatch: pytest.MonkeyPatch, kept: bool) -> None:
    module = _worker_module(monkeypatch)
    monkeypatch.setattr(sentinel, "_REPORTS", ProcessReports(sentinel.SentinelStats, kept=3))
    model = BufferedModel()
    prepared = PreparedCapture.bound(
        torch.zeros(8, 4, 2, dtype=torch.int16), torch.zeros(1, dtype=torch.int64), 8, (1, 3)
    )
    if kept:
        sleep_mode.keep_through_sleep(model, prepared)
    prepared.errors.fill_(2)  # two ids stored as -1 before the sleep
    allocator = _LosingAllocator(model, prepared)
    monkeypatch.setattr(module, "CaMemAllocator", SimpleNamespace(get_instance=lambda: allocator))
    monkeypatch.setattr(torch.npu, "mem_get_info", lambda *_: (1 << 30, 1 << 31), raising=False)
    # As RL deployments run it: vllm-ascend refuses to wake up with its FRACTAL_NZ weight layout on (its default).
    monkeypatch.setattr(module.get_ascend_config(), "weight_nz_mode", 0)
    worker: Any = SimpleNamespace(
        model_runner=SimpleNamespace(model=model, post_kv_cache_wake_up=lambda: None),
        _sleep_saved_buffers={},
        vllm_config=SimpleNamespace(
            model_config=SimpleNamespace(hf_text_config=SimpleNamespace(hidden_size=2)), quant_config=None
        ),
    )

    module.NPUWorker.sleep(worker, level=2)
    assert int(prepared.errors[0]) != 2  # the allocator lost it
    module.NPUWorker.wake_up(worker, tags=["weights"])  # verl's order: weights, (weights loaded), then KV cache
    module.NPUWorker.wake_up(worker, tags=["kv_cache"])

    assert allocator.calls == ["sleep ()", "wake_up ['weights']", "wake_up ['kv_cache']"]
    assert torch.equal(model.cos_sin_cache, torch.arange(6, dtype=torch.float32))  # the model's own buffer
    assert (int(prepared.errors[0]) == 2) == kept, int(prepared.errors[0])
