# SPDX-License-Identifier: Apache-2.0
"""An invalid id never reaches a user looking valid, on every generation, with 255, 256 and 300 experts.

The capture op stores an id outside ``[0, num_experts)`` as -1 and counts it on the device. What the user then
sees depends on the generation's transport: 0.20.x (this plugin's shared-memory store) reads it back as -1;
0.22+ (vLLM's ``RoutedExpertsManager`` / AuxOutput ``snapshot_routing_data``) narrow it to uint8 up to 256
experts, else uint16, so -1 shows as 255 or 65535. 255 is a real expert of a 256-expert model: there, only the
always-on check's report (the step it was recorded, validation mode off) tells the rows apart.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from vllm_ascend_routing import capture, runner_mixin, runner_state, sentinel
from vllm_ascend_routing.compat.shm import store
from vllm_ascend_routing.reporting import ProcessReports
from vllm_ascend_routing.validate import RoutingValidationError

GENERATIONS = ("shm", "runner-output", "aux-output")


@pytest.fixture(autouse=True)
def fresh_counters(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sentinel, "_REPORTS", ProcessReports(sentinel.SentinelStats, kept=3))


def user_view(generation: str, rows: np.ndarray, num_experts: int) -> np.ndarray:
    """The recorded int16 rows as the generation hands them to the user."""
    if generation == "shm":  # the plugin's store (real code): narrow by num_experts, widened to int32 on read
        spec = store.SegmentSpec.for_engine(f"inv{num_experts}", 0, rows.shape, num_experts)  # type: ignore[arg-type]
        writer = store.SegmentWriter(spec)
        try:
            reader = store.SegmentReader(spec)
            writer.write(np.arange(len(rows)), rows)
            read = reader.read(np.arange(len(rows)))
            reader.close()
        finally:
            writer.close()
        return read
    # vLLM 0.22+: uint8 up to 256 experts, else uint16 (RoutedExpertsManager / snapshot_routing_data).
    return rows.astype(np.uint8 if num_experts <= 256 else np.uint16)


def _step(prepared: capture.PreparedCapture, ids: torch.Tensor) -> None:
    """One step through the runner mixin's hook: the forward records ``ids`` in layer 1 (layer 0 real rows)."""
    layer_0 = capture.LayerCapture(prepared.buffer, 0, prepared.num_experts, prepared.errors)
    layer_1 = capture.LayerCapture(prepared.buffer, 1, prepared.num_experts, prepared.errors)

    def forward(*_: Any) -> None:
        layer_0(torch.tensor([[0, 1]] * len(ids), dtype=torch.int64))
        layer_1(ids)

    runner = SimpleNamespace(model=object(), input_batch=SimpleNamespace(req_ids=["r"]))
    runner_state.set_prepared(runner, prepared)
    api = SimpleNamespace(step_started=lambda *a: None, after_forward=lambda *a: None)
    step = SimpleNamespace(total_num_scheduled_tokens=len(ids), num_scheduled_tokens={"r": len(ids)})
    runner_mixin.RoutingCaptureRunnerMixin.execute_model(runner, api, forward, step)  # type: ignore[arg-type]


@pytest.mark.parametrize("num_experts", [8, 256, 300])
def test_an_id_equal_to_the_expert_count_is_caught_on_the_eager_write(num_experts: int) -> None:
    """The eager CPU write takes a batch as it is when its largest id is below the expert count; a batch whose
    largest id is the expert count itself (no negative id to force the slower path) is stored as -1 and counted."""
    prepared = capture.PreparedCapture.bound(
        capture.new_capture_buffer(4, 2, 2, num_experts, "cpu"), capture.new_error_counter("cpu"), num_experts, (0, 1)
    )
    prepared.sentinel.strict = True
    with pytest.raises(RoutingValidationError, match=rf"1 routed expert id\(s\) outside \[0, {num_experts}\)"):
        _step(prepared, torch.tensor([[num_experts - 1, 0], [num_experts, 1]], dtype=torch.int64))
    assert prepared.buffer[:2, 1].tolist() == [[num_experts - 1, 0], [-1, 1]]
    assert sentinel.stats().invalid_ids == 1


@pytest.mark.parametrize("num_experts", [255, 256, 300])
@pytest.mark.parametrize("generation", GENERATIONS)
def test_an_invalid_id_is_reported_the_step_it_is_recorded(
    generation: str, num_experts: int, caplog: pytest.LogCaptureFixture
) -> None:
    prepared = capture.PreparedCapture.bound(
        capture.new_capture_buffer(4, 2, 2, num_experts, "cpu"), capture.new_error_counter("cpu"), num_experts, (0, 1)
    )
    ids = torch.tensor([[num_experts - 1, 3], [num_experts, 4], [-7, 5]], dtype=torch.int64)  # two invalid ids
    with caplog.at_level(logging.ERROR):
        _step(prepared, ids)  # validation mode off: logged
    lines = [r.getMessage() for r in caplog.records]
    assert any(f"2 routed expert id(s) outside [0, {num_experts})" in line for line in lines), lines
    assert sentinel.stats().invalid_ids == 2

    shown = user_view(generation, prepared.buffer[:3].numpy(), num_experts)[:, 1]
    assert shown[0].tolist() == [num_experts - 1, 3]  # the valid ids, exactly
    invalid = shown[1:, 0].astype(np.int64)
    looks_valid = bool(((invalid >= 0) & (invalid < num_experts)).any())
    # Where the transport makes the id look like a real expert (uint8 and 256 experts), the report above is
    # what tells it apart; everywhere else it is also unmistakable in the array itself.
    assert looks_valid == (generation != "shm" and num_experts == 256), (generation, num_experts, invalid)

    prepared.sentinel.strict = True
    with pytest.raises(RoutingValidationError, match=r"1 routed expert id\(s\) outside"):
        _step(prepared, torch.tensor([[0, num_experts + 5]], dtype=torch.int64))
