# SPDX-License-Identifier: Apache-2.0
"""vLLM's asynchronous-scheduling branch (its default on GPUs) with the plugin's buffer, from vLLM's own source.

The CPU build forces async scheduling off, so no e2e test takes this branch. On the runner-output generation
(0.22-0.30) it snapshots the capturer's buffer (``get_routed_experts``, 0.28+, or the same two clones inline
before), wraps it in ``AsyncGPUModelRunnerOutput`` (whose constructor queues the host copy on a side stream) and
hands ``get_output()``'s ``RoutedExpertsLists`` to the scheduler's ``RoutedExpertsManager.store_batch``. Here
those run as vLLM wrote them, with the buffer the plugin attached and rows its capture wrote; only the CUDA
stream and event are stubbed (no device here). The rows the scheduler stores must be the captured ones, in the
dtype vLLM returns (uint8 up to 256 experts), even when the next step overwrites the buffer before the copy is
read (the snapshot is a clone).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from tests.fakes import FakeModel
from vllm_ascend_routing.compat._common import attach_buffer, bind_target_model

pytestmark = pytest.mark.vllm

NUM_TOKENS, NUM_LAYERS, TOP_K, NUM_EXPERTS = 8, 3, 2, 8


class _Stream:
    """``torch.cuda.Stream`` where no device exists: work is already done when it is queued."""

    def wait_stream(self, other: Any) -> None:
        pass


class _Event:
    def __init__(self, **kwargs: Any) -> None:
        pass

    def record(self, *args: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


@pytest.fixture
def async_output_class(monkeypatch: pytest.MonkeyPatch) -> Any:
    from vllm.v1.worker import gpu_model_runner

    cls = getattr(gpu_model_runner, "AsyncGPUModelRunnerOutput", None)
    if cls is None or "routed_experts" not in inspect.signature(cls.__init__).parameters:
        pytest.skip("this vLLM's async runner output carries no routed experts (runner-output generation only)")
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch, "Event", _Event)  # 0.22-0.27 take the generic event
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: _Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    return cls


def _capturer() -> Any:
    from vllm.model_executor.layers.fused_moe import routed_experts_capturer

    capturer = routed_experts_capturer.RoutedExpertsCapturer.__new__(routed_experts_capturer.RoutedExpertsCapturer)
    capturer.device_buffer = torch.zeros(NUM_TOKENS, NUM_LAYERS, TOP_K, dtype=torch.int32)
    return capturer


def _snapshot(runner: Any, total: int) -> Any:
    """The step's device snapshot, as the runner takes it: its own method (0.28+), else its inline clones."""
    from vllm.v1.outputs import RoutedExpertsTensors
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if hasattr(GPUModelRunner, "get_routed_experts"):
        return GPUModelRunner.get_routed_experts(runner, total)
    buffer = runner.routed_experts_capturer.get_device_buffer()
    return RoutedExpertsTensors(
        routing_data=buffer[:total].clone(), slot_mapping=runner.routed_experts_slot_mapping_device[:total].clone()
    )


def _slot_store(num_slots: int) -> Any:
    """The scheduler's store, its buffer in the dtype vLLM's own constructor picks."""
    from vllm.model_executor.layers.fused_moe import routed_experts_capturer

    manager_class = getattr(routed_experts_capturer, "RoutedExpertsManager", None)
    if manager_class is None:
        from vllm.v1.core.sched import scheduler

        manager_class = scheduler.RoutedExpertsManager
    manager = manager_class.__new__(manager_class)
    dtype = np.uint8 if NUM_EXPERTS <= 256 else np.uint16
    manager.routed_experts_by_slot = np.zeros((num_slots, NUM_LAYERS, TOP_K), dtype=dtype)
    return manager


def test_the_async_branch_ships_the_captured_rows(async_output_class: Any) -> None:
    from vllm.v1 import outputs

    model = FakeModel(cpu=False)  # MoE layers 0 and 2, layer 1 dense; routed through the router backend
    prepared = bind_target_model(model, NUM_TOKENS, (NUM_LAYERS, TOP_K, NUM_EXPERTS), torch.device("cpu"))
    capturer = _capturer()
    attach_buffer(prepared, capturer)
    total = 5
    ids = {
        layer: torch.randint(0, NUM_EXPERTS, (total, TOP_K), generator=torch.Generator().manual_seed(layer))
        for layer in (0, 2)
    }
    for layer, layer_ids in ids.items():  # the step's forward, through the plugin's capture
        model.layers[layer].router.capture_fn(layer_ids)
    slots = torch.tensor([11, 3, 7, 0, 5, 0, 0, 0], dtype=torch.int64)
    runner = SimpleNamespace(
        routed_experts_initialized=True,
        routed_experts_capturer=capturer,
        routed_experts_slot_mapping_device=slots,
    )
    pending = async_output_class(
        model_runner_output=copy.copy(outputs.EMPTY_MODEL_RUNNER_OUTPUT),
        sampled_token_ids=torch.zeros((1, 1), dtype=torch.int64),
        logprobs_tensors=None,
        invalid_req_indices=[],
        async_output_copy_stream=_Stream(),
        vocab_size=16,
        routed_experts=_snapshot(runner, total),
    )
    prepared.buffer.fill_(7)  # the next step's forward, before the host reads this one
    shipped = pending.get_output().routed_experts
    store = _slot_store(16)
    store.store_batch(shipped.routing_data, shipped.slot_mapping)
    rows = store.routed_experts_by_slot[slots[:total].numpy()]
    for layer, layer_ids in ids.items():
        assert np.array_equal(rows[:, layer], layer_ids.numpy()), layer
    assert not rows[:, 1].any()  # the dense layer: zeros, as vLLM returns it
    assert rows.dtype == np.uint8 and store.routed_experts_by_slot[[1, 2, 4]].sum() == 0  # no other slot touched
