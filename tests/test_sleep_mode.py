# SPDX-License-Identifier: Apache-2.0
"""The capture's state through vLLM's level-2 sleep (``sleep_mode``): what the step does not rewrite is one of the
model's registered buffers, which vLLM's wake-up restores; the rest of device memory comes back lost (here: the
test-only stand-in ``tests/harness/sleep_stand_in.py`` overwrites it, in vLLM's own save / lose / restore order)."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.fakes import BufferedModel
from tests.harness import sleep_stand_in
from vllm_ascend_routing import runner_state, sentinel, sleep_mode
from vllm_ascend_routing.capture import PreparedCapture
from vllm_ascend_routing.reporting import ProcessReports
from vllm_ascend_routing.validate import RoutingValidationError

ACCELERATORS = [pytest.param("cuda", marks=pytest.mark.cuda), pytest.param("npu", marks=pytest.mark.npu)]
STEP = [("req-a", 5)]


@pytest.fixture(autouse=True)
def fresh_counters(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sentinel, "_REPORTS", ProcessReports(sentinel.SentinelStats, kept=3))


class _GraphWrapper:
    """vLLM's CUDAGraphWrapper as the runner holds it after load: not a module, attributes forwarded."""

    def __init__(self, runnable: torch.nn.Module) -> None:
        self.runnable = runnable

    def __getattr__(self, key: str) -> Any:
        return getattr(self.runnable, key)


def _prepared(layers: tuple[int, ...] = (1, 3), device: str = "cpu", strict: bool = True) -> PreparedCapture:
    buffer = torch.zeros(8, 4, 2, dtype=torch.int16, device=device)
    prepared = PreparedCapture.bound(buffer, torch.zeros(1, dtype=torch.int64, device=device), 8, layers)
    prepared.sentinel.strict = strict
    return prepared


def _worker(model: Any, prepared: PreparedCapture) -> SimpleNamespace:
    runner = SimpleNamespace(model=model)
    runner_state.set_prepared(runner, prepared)
    return SimpleNamespace(model_runner=runner)


def _step(prepared: PreparedCapture, tokens: int = 5) -> None:
    """One step as the runner hook runs it: clear, the capture writes real rows, the check."""
    prepared.sentinel.clear(tokens)
    for layer in prepared.layer_ids:
        prepared.buffer[:tokens, layer] = torch.arange(2, dtype=torch.int16, device=prepared.buffer.device)
    prepared.sentinel.after_forward(tokens, lambda: list(STEP))


def test_the_invalid_id_count_survives_a_level_2_sleep() -> None:
    model, prepared = BufferedModel(), _prepared(strict=False)
    sleep_mode.keep_through_sleep(model, prepared)
    prepared.errors.fill_(2)  # two ids stored as -1 in a step before the sleep
    _step(prepared)
    assert sentinel.stats().invalid_ids == 2

    lost = sleep_stand_in.lose_device_memory(_worker(model, prepared))

    assert lost["plugin_buffers_restored"] == ["vllm_ascend_routing_invalid_id_count"]
    assert int(prepared.errors[0]) == 2 and torch.equal(model.cos_sin_cache, torch.arange(6, dtype=torch.float32))
    prepared.sentinel.strict = True  # from here on, any report raises
    _step(prepared)
    _step(prepared)
    assert sentinel.stats().as_dict() == {"steps_checked": 3, "rows_checked": 30, "zero_rows": 0, "invalid_ids": 2}


def test_a_counter_left_out_of_the_models_buffers_comes_back_as_invalid_ids() -> None:
    """What the registration prevents (and what the stand-in is for): the lost counter reads as a vast count."""
    model, prepared = BufferedModel(), _prepared()
    _step(prepared)
    lost = sleep_stand_in.lose_device_memory(_worker(model, prepared))
    assert lost["plugin_buffers_restored"] == [] and lost["plugin_tensors_lost"] >= 2
    with pytest.raises(RoutingValidationError, match=r"routed expert id\(s\) outside \[0, 8\)"):
        _step(prepared)


@pytest.mark.parametrize("layers", [(0, 1, 2, 3), (1, 3)])
@pytest.mark.parametrize("accelerator_index", [False, True])
def test_every_tensor_kept_across_steps_is_a_model_buffer(layers: tuple[int, ...], accelerator_index: bool) -> None:
    """Whatever the capture holds (found by walking it, so a tensor added later is covered) is the step's buffer,
    zeroed before each forward, or restored by the wake-up. ``accelerator_index``: the device index of non-contiguous
    bound layers an accelerator's check builds (set here as its ``__post_init__`` does on a device)."""
    model, prepared = BufferedModel(), _prepared(layers)
    if accelerator_index and isinstance(prepared.sentinel._layers, list):
        prepared.sentinel._layers = torch.tensor(layers)
    kept = sleep_mode.keep_through_sleep(_GraphWrapper(model), prepared)  # registered through the wrapper

    buffers = {id(buffer): name for name, buffer in model.named_buffers()}
    held = sleep_stand_in.plugin_tensors(prepared)
    assert held and all(tensor is prepared.buffer or id(tensor) in buffers for tensor in held), [
        tuple(t.shape) for t in held
    ]
    assert set(kept) <= set(buffers.values())
    index_kept = "vllm_ascend_routing_bound_layers" in kept
    assert index_kept == isinstance(prepared.sentinel._layers, torch.Tensor)
    assert not any(name.startswith(sleep_mode.BUFFER_PREFIX) for name in model.state_dict())  # never checkpointed
    assert [name for name, _ in model.named_parameters()] == ["proj.weight", "proj.bias"]


def test_keeping_twice_replaces_the_registration() -> None:
    model, first, second = BufferedModel(), _prepared(), _prepared()
    sleep_mode.keep_through_sleep(model, first)
    sleep_mode.keep_through_sleep(model, second)
    assert model.vllm_ascend_routing_invalid_id_count is second.errors


@pytest.mark.parametrize("device", ACCELERATORS)
def test_a_level_2_sleep_on_the_accelerator(device: str) -> None:
    """On the device: non-contiguous bound layers (the check's device index), the packet path; after the stand-in
    lost every plugin tensor and the wake-up restored the model's buffers, the next steps report nothing."""
    if device == "npu":
        import torch_npu  # noqa: F401  (registers torch.npu)
    model, prepared = BufferedModel().to(device), _prepared((1, 3), device)
    assert sleep_mode.keep_through_sleep(model, prepared).keys() == {
        "vllm_ascend_routing_invalid_id_count",
        "vllm_ascend_routing_bound_layers",
    }
    _step(prepared)
    _settle(prepared)
    sleep_stand_in.lose_device_memory(_worker(model, prepared))
    for _ in range(3):
        _step(prepared)
        _settle(prepared)
    assert sentinel.stats().invalid_ids == 0 and sentinel.stats().zero_rows == 0
    assert sentinel.stats().steps_checked >= 2


def _settle(prepared: PreparedCapture) -> None:
    """Let the step's packet arrive, then read it (a step's check reads the previous packet)."""
    check = prepared.sentinel
    deadline = time.monotonic() + 10
    while check._in_flight is not None and not check._in_flight.event.query():
        assert time.monotonic() < deadline, "the packet's event never completed"
        time.sleep(0.001)
    check.after_forward(0, lambda: list(STEP))
    check._poll()
