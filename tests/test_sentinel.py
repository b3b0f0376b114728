# SPDX-License-Identifier: Apache-2.0
"""The always-on check of each step's rows (``sentinel``): all-zero MoE rows and invalid ids, on the host
path (CPU) and the device-packet path (accelerators, exercised here on CPU tensors with a stand-in event)."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from vllm_ascend_routing import capture, sentinel
from vllm_ascend_routing.sentinel import Sentinel
from vllm_ascend_routing.validate import RoutingValidationError

STEP = [("req-a", 2), ("req-b", 3)]


@pytest.fixture(autouse=True)
def fresh_counters(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sentinel, "_STATS", sentinel.SentinelStats())


def _sentinel(top_k: int = 2, layers: tuple[int, ...] = (1, 3), strict: bool = True, num_experts: int = 8) -> Sentinel:
    buffer = torch.zeros(8, 4, top_k, dtype=torch.int16)
    return Sentinel(buffer, torch.zeros(1, dtype=torch.int64), layers, num_experts, strict=strict)


def _route(check: Sentinel, tokens: int, layers: tuple[int, ...]) -> None:
    """Real rows (distinct experts, expert 0 included) in ``layers`` for ``tokens`` tokens."""
    for layer in layers:
        check.buffer[:tokens, layer] = torch.arange(check.buffer.shape[2], dtype=torch.int16)


def test_real_rows_pass_and_are_counted() -> None:
    check = _sentinel()
    _route(check, 5, (1, 3))
    check.after_forward(5, lambda: STEP)
    assert sentinel.stats().as_dict() == {"steps_checked": 1, "rows_checked": 10, "zero_rows": 0, "invalid_ids": 0}


def test_a_bypassed_layer_is_named_with_its_request_and_row() -> None:
    check = _sentinel()
    _route(check, 5, (1,))
    check.buffer[:2, 3] = torch.tensor([2, 5], dtype=torch.int16)  # req-a routed; req-b's rows in layer 3 zero
    with pytest.raises(
        RoutingValidationError,
        match=r"3 all-zero routing row.*request req-b, its token 0 of this step \(step row 2\), layer 3",
    ):
        check.after_forward(5, lambda: STEP)
    assert sentinel.stats().zero_rows == 3


def test_dense_layers_are_not_checked_and_top_1_zero_is_expert_0() -> None:
    check = _sentinel(layers=(1,))  # layers 0, 2, 3 dense: their zero rows are right
    _route(check, 4, (1,))
    check.after_forward(4, lambda: STEP)
    top_1 = _sentinel(top_k=1)
    assert not top_1.checks_zero_rows
    top_1.after_forward(4, lambda: STEP)  # all rows expert 0: a real top-1 row
    assert sentinel.stats().zero_rows == 0


def test_non_contiguous_layers_are_checked_each() -> None:
    check = _sentinel(layers=(0, 2))
    _route(check, 3, (0,))
    with pytest.raises(RoutingValidationError, match=r"first: step row 0, layer 2"):
        check.after_forward(3, lambda: [])


def test_invalid_ids_are_reported_once_each(monkeypatch: pytest.MonkeyPatch) -> None:
    check = _sentinel()
    _route(check, 5, (1, 3))
    check.errors.fill_(3)  # the capture op stored three ids as -1
    with pytest.raises(RoutingValidationError, match=r"3 routed expert id\(s\) outside \[0, 8\).*255"):
        check.after_forward(5, lambda: STEP)
    check.after_forward(5, lambda: STEP)  # the same count: not reported again
    assert sentinel.stats().invalid_ids == 3


def test_log_mode_reports_loudly_without_flooding(caplog: pytest.LogCaptureFixture) -> None:
    check = _sentinel(strict=False)
    with caplog.at_level(logging.ERROR):
        for _ in range(5):
            check.after_forward(4, lambda: STEP)  # every bound row zero, every step
    reports = [r.getMessage() for r in caplog.records if "all-zero routing row" in r.getMessage()]
    assert [line.split("(report ")[1].split(";")[0] for line in reports] == ["1", "2", "4"]
    assert "request req-a, its token 0 of this step (step row 0), layer 1" in reports[0]
    assert sentinel.stats().zero_rows == 5 * 4 * 2


def test_clear_zeroes_only_the_steps_rows() -> None:
    check = _sentinel()
    check.buffer.fill_(7)
    check.clear(3)
    assert not check.buffer[:3].any() and bool((check.buffer[3:] == 7).all())


class _Event:
    """Stands in for a device event: complete once ``done`` is set."""

    def __init__(self) -> None:
        self.done = False

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return self.done


def _device_path(check: Sentinel, monkeypatch: pytest.MonkeyPatch) -> list[_Event]:
    """Route ``check`` through the accelerator path (device packet, pinned copy, event), on CPU tensors."""
    events: list[_Event] = []
    check._host = torch.zeros(3, dtype=torch.int64)

    def new_event(self: Sentinel) -> _Event:
        events.append(_Event())
        return events[-1]

    monkeypatch.setattr(Sentinel, "_event", new_event)
    return events


def test_device_path_reads_the_packet_only_once_it_arrived(monkeypatch: pytest.MonkeyPatch) -> None:
    check = _sentinel()
    events = _device_path(check, monkeypatch)
    _route(check, 5, (1,))
    check.after_forward(5, lambda: list(STEP))  # enqueued: nothing read yet
    check.after_forward(5, lambda: list(STEP))  # previous packet in flight: this step is not checked
    assert len(events) == 1 and sentinel.stats().steps_checked == 0
    events[0].done = True
    with pytest.raises(
        RoutingValidationError, match=r"5 all-zero.*request req-a, its token 0 of this step \(step row 0\), layer 3"
    ):
        check.after_forward(5, lambda: list(STEP))


def test_device_packet_equals_the_host_check() -> None:
    """The packet the device computes holds what the host check hands to the report, and both what a plain
    reading of the rows says, on random rows with and without zero rows."""
    generator = torch.Generator().manual_seed(0)
    for layers in ((0, 1, 2, 3), (1, 3)):
        for high in (3, 9):  # ids 0-2: zero rows in most steps; 0-8: in few or none
            check = _sentinel(layers=layers)
            check.buffer.copy_(torch.randint(0, high, check.buffer.shape, generator=generator, dtype=torch.int16))
            check.errors.fill_(2)
            rows = check.buffer[:6, list(layers)]
            zero = ~rows.bool().any(dim=2).flatten()
            expected_first = int(torch.nonzero(zero)[0]) if zero.any() else -1
            packet = check._packet(6).tolist()
            assert packet == [int(zero.sum()), expected_first, 2]
            reported: list[list[int]] = []
            check._account = lambda _n, count, first, errors, _r: reported.append([count, first, errors])  # type: ignore[method-assign]
            check._check_host(6, lambda: [])
            assert reported == [packet]


def test_step_requests_follow_the_runners_batch_order() -> None:
    runner = SimpleNamespace(input_batch=SimpleNamespace(req_ids=["b", "a"]))
    step = SimpleNamespace(num_scheduled_tokens={"a": 3, "b": 1})
    assert sentinel.step_requests(runner, step) == [("b", 1), ("a", 3)]
    assert sentinel.step_requests(SimpleNamespace(), step) == []


def test_the_step_hook_clears_before_and_checks_after_the_forward() -> None:
    from vllm_ascend_routing import runner_mixin, runner_state

    buffer = torch.full((8, 4, 2), 9, dtype=torch.int16)
    prepared = capture.PreparedCapture.bound(buffer, torch.zeros(1, dtype=torch.int64), 8, (1, 3))
    runner = SimpleNamespace(model=object(), input_batch=SimpleNamespace(req_ids=["r"]))
    runner_state.set_prepared(runner, prepared)
    seen: list[Any] = []
    api = SimpleNamespace(step_started=lambda *a: None, after_forward=lambda *a: seen.append("after_forward"))

    def forward(*_: Any) -> str:
        seen.append(int(buffer[:3].abs().sum()))  # the step's rows were cleared before the forward
        buffer[:3, 1] = torch.tensor([0, 1], dtype=torch.int16)  # layer 3 bypassed
        return "out"

    step = SimpleNamespace(total_num_scheduled_tokens=3, num_scheduled_tokens={"r": 3})
    execute = runner_mixin.RoutingCaptureRunnerMixin.execute_model
    prepared.sentinel.strict = True
    with pytest.raises(RoutingValidationError, match="request r, its token 0 of this step .*layer 3"):
        execute(runner, api, forward, step)  # type: ignore[arg-type]
    assert seen == [0, "after_forward"]
    assert int(buffer[3:].min()) == 9  # rows past the step untouched


def test_doctor_reports_the_sentinel_counters(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_ascend_routing import doctor, runner_state

    prepared = capture.PreparedCapture.bound(torch.zeros(4, 3, 2, dtype=torch.int16), torch.zeros(1), 8, (0, 2))
    monkeypatch.setattr(runner_state, "captures_in_process", lambda: [prepared])
    monkeypatch.setattr(sentinel, "_STATS", sentinel.SentinelStats(3, 24, 0, 0))
    assert doctor.capture_report() == ("2 MoE layers bound; 24 rows in 3 steps checked: 0 all-zero, 0 invalid ids", [])
    monkeypatch.setattr(sentinel, "_STATS", sentinel.SentinelStats(3, 24, 4, 1))
    assert len(doctor.capture_report()[1]) == 2
