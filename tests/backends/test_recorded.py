# SPDX-License-Identifier: Apache-2.0
"""The forward guard both Ascend backends install: a bound layer's forward that did not record raises; the
record keeps the routed columns of a mix-placement row; rebinding replaces the guard."""

from __future__ import annotations

import contextvars

import pytest
import torch

from vllm_ascend_routing.backends._recorded import LayerRecord, RoutingNotRecordedError, guard_forward
from vllm_ascend_routing.capture import LayerCapture, new_capture_buffer, new_error_counter
from vllm_ascend_routing.patching import original_of as inner_of


class Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.routes = True
        self.record: LayerRecord | None = None

    def forward_impl(self, ids: torch.Tensor) -> str:
        if self.routes and self.record is not None:
            self.record(ids)
        return "done"


def record(buffer: torch.Tensor) -> LayerRecord:
    return LayerRecord(LayerCapture(buffer, 0, 8, new_error_counter("cpu")), "model.layers.0.mlp.experts")


def test_a_recorded_forward_passes_and_a_silent_one_raises() -> None:
    buffer = new_capture_buffer(4, 1, 2, 8, "cpu")
    layer = Layer()
    layer.record = record(buffer)
    guard_forward(layer, "forward_impl", layer.record, None, "calling the router")
    assert layer.forward_impl(torch.tensor([[1, 2]])) == "done"
    assert buffer[0, 0].tolist() == [1, 2]
    layer.routes = False
    with pytest.raises(RoutingNotRecordedError, match="finished without calling the router"):
        layer.forward_impl(torch.tensor([[3, 4]]))


def test_mix_placement_columns_are_dropped_and_too_few_ids_refused() -> None:
    buffer = new_capture_buffer(4, 1, 2, 8, "cpu")
    recorder = record(buffer)
    recorder(torch.tensor([[5, 6, 8]]))  # the shared expert's column appended after the routed ones
    assert buffer[0, 0].tolist() == [5, 6] and recorder.recorded
    with pytest.raises(RoutingNotRecordedError, match="1 ids per token"):
        recorder(torch.tensor([[5]]))


def test_rebinding_replaces_the_guard_and_the_active_layer_is_reset() -> None:
    buffer = new_capture_buffer(4, 1, 2, 8, "cpu")
    layer = Layer()
    original = layer.forward_impl
    active: contextvars.ContextVar[LayerRecord | None] = contextvars.ContextVar("active", default=None)
    seen: list[LayerRecord | None] = []
    layer.record = None

    def forward_impl(ids: torch.Tensor) -> str:  # records through the active layer, as select_experts does
        seen.append(active.get())
        record = active.get()
        assert record is not None
        record(ids)
        return "done"

    layer.forward_impl = forward_impl  # type: ignore[method-assign]
    records = []
    for _ in range(2):
        records.append(record(buffer))
        guard_forward(layer, "forward_impl", records[-1], active, "x")
    assert inner_of(layer.forward_impl) is forward_impl and forward_impl is not original  # wrapped once
    layer.forward_impl(torch.tensor([[1, 2]]))
    assert seen == [records[-1]] and active.get() is None
