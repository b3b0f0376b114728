# SPDX-License-Identifier: Apache-2.0
"""The always-on check of each step's rows (``sentinel``): all-zero MoE rows and invalid ids, on the host
path (CPU) and the device-packet path (accelerators, exercised here on CPU tensors with a stand-in event)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from vllm_ascend_routing import capture, sentinel
from vllm_ascend_routing.reporting import ProcessReports
from vllm_ascend_routing.sentinel import Sentinel
from vllm_ascend_routing.validate import RoutingValidationError

STEP = [("req-a", 2), ("req-b", 3)]


@pytest.fixture(autouse=True)
def fresh_counters(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sentinel, "_REPORTS", ProcessReports(sentinel.SentinelStats, kept=3))


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


class _Stream:
    """A device stream as the always-on check relies on it: work runs in the order it was enqueued, and an
    event completes when the device reaches it, not before the work enqueued ahead of it. The device's
    reductions themselves run on the CPU tensors (the real ``_packet``); only the timing is the stream's."""

    def __init__(self) -> None:
        self.pending: list[Any] = []  # callables (copies) and _Event markers, in enqueue order
        self.log: list[str] = []

    def run_until(self, event: _Event) -> None:
        """The device reaches ``event``: everything enqueued before it has run; anything after has not."""
        while self.pending:
            work = self.pending.pop(0)
            if work is event:
                event.done = True
                return
            if isinstance(work, _Event):
                work.done = True
            else:
                work()
        raise AssertionError("the event was never recorded on this stream")


class _Event:
    """A device event on ``stream``: complete once the stream has run up to where it was recorded."""

    def __init__(self, stream: _Stream) -> None:
        self.stream, self.done = stream, False

    def record(self) -> None:
        self.stream.log.append("record")
        self.stream.pending.append(self)

    def query(self) -> bool:
        return self.done


class _PinnedPacket:
    """The pinned host packet: a non-blocking device-to-host copy lands when the stream runs it."""

    def __init__(self, stream: _Stream) -> None:
        self.stream, self.values = stream, [0, 0, 0]

    def copy_(self, source: torch.Tensor, non_blocking: bool = False) -> _PinnedPacket:
        assert non_blocking, "a blocking copy would synchronise the step"
        self.stream.log.append("copy")
        packet = source.tolist()  # what the device computed ahead of the copy on the stream
        self.stream.pending.append(lambda: setattr(self, "values", packet))
        return self

    def tolist(self) -> list[int]:
        return list(self.values)


def _device_path(check: Sentinel, monkeypatch: pytest.MonkeyPatch) -> tuple[_Stream, list[_Event]]:
    """Route ``check`` through the accelerator path (device packet, pinned copy, event) on CPU tensors, with a
    stream that honours enqueue order: only ``_event``'s choice of device module is taken over."""
    stream, events = _Stream(), []
    check._host = _PinnedPacket(stream)  # type: ignore[assignment]

    def new_event(self: Sentinel) -> _Event:
        events.append(_Event(stream))
        return events[-1]

    monkeypatch.setattr(Sentinel, "_event", new_event)
    return stream, events


def test_device_path_reads_the_packet_only_once_it_arrived(monkeypatch: pytest.MonkeyPatch) -> None:
    check = _sentinel()
    stream, events = _device_path(check, monkeypatch)
    _route(check, 5, (1,))
    check.after_forward(5, lambda: list(STEP))  # enqueued: nothing read yet
    check.after_forward(5, lambda: list(STEP))  # previous packet in flight: this step is not checked
    assert len(events) == 1 and sentinel.stats().steps_checked == 0
    stream.run_until(events[0])
    with pytest.raises(
        RoutingValidationError, match=r"5 all-zero.*request req-a, its token 0 of this step \(step row 0\), layer 3"
    ):
        check.after_forward(5, lambda: list(STEP))


def test_device_path_copies_the_packet_before_recording_its_event(monkeypatch: pytest.MonkeyPatch) -> None:
    """The event must follow the copy on the stream: an event recorded first completes before the packet has
    arrived, and the host reads an old packet (zeros: "nothing wrong") while the step's rows were all zero."""
    check = _sentinel()
    stream, events = _device_path(check, monkeypatch)
    _route(check, 2, (1, 3))  # req-a routed; req-b's three rows zero in both layers: a bypass
    check.after_forward(5, lambda: list(STEP))
    assert stream.log == ["copy", "record"]
    stream.run_until(events[0])
    _route(check, 5, (1, 3))  # the next step is clean: the report must name the step whose packet it read
    with pytest.raises(RoutingValidationError, match=r"6 all-zero.*request req-b, its token 0 of this step"):
        check.after_forward(5, lambda: [("req-c", 5)])
    assert sentinel.stats().as_dict() == {"steps_checked": 1, "rows_checked": 10, "zero_rows": 6, "invalid_ids": 0}


def test_device_path_reports_invalid_ids_on_their_step(monkeypatch: pytest.MonkeyPatch) -> None:
    check = _sentinel()
    stream, events = _device_path(check, monkeypatch)
    _route(check, 5, (1, 3))
    check.after_forward(5, lambda: list(STEP))  # step 1: clean
    stream.run_until(events[0])
    check.errors.fill_(2)  # step 2 stores two ids as -1
    check.after_forward(5, lambda: list(STEP))  # reads step 1 (clean), enqueues step 2
    assert sentinel.stats().invalid_ids == 0
    stream.run_until(events[1])
    with pytest.raises(RoutingValidationError, match=r"2 routed expert id\(s\) outside \[0, 8\)"):
        check.after_forward(5, lambda: list(STEP))
    assert sentinel.stats().invalid_ids == 2


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

            def account(_n: int, count: int, first: int, errors: int, _r: object, seen: list = reported) -> None:
                seen.append([count, first, errors])

            check._account = account  # type: ignore[method-assign,assignment]
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


@pytest.mark.parametrize(("setting", "raises"), [("strict", True), ("1", False), ("0", False), (None, False)])
def test_the_validation_setting_reaches_the_check(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, setting: str | None, raises: bool
) -> None:
    """The check a capture is built with (``PreparedCapture.bound``, as every generation's load hook builds it)
    raises on a bypassed layer exactly when ``VLLM_ASCEND_ROUTING_VALIDATE=strict``; otherwise it logs."""
    if setting is None:
        monkeypatch.delenv("VLLM_ASCEND_ROUTING_VALIDATE", raising=False)
    else:
        monkeypatch.setenv("VLLM_ASCEND_ROUTING_VALIDATE", setting)
    buffer = torch.zeros(8, 4, 2, dtype=torch.int16)
    prepared = capture.PreparedCapture.bound(buffer, torch.zeros(1, dtype=torch.int64), 8, (1, 3))
    assert prepared.sentinel.strict is raises
    _route(prepared.sentinel, 5, (1,))  # layer 3 bypassed: every row zero
    with caplog.at_level(logging.ERROR):
        if raises:
            with pytest.raises(RoutingValidationError, match="all-zero routing row"):
                prepared.sentinel.after_forward(5, lambda: STEP)
        else:
            prepared.sentinel.after_forward(5, lambda: STEP)
    assert "5 all-zero routing row(s)" in caplog.text  # logged in every mode: 5 tokens x the bypassed layer


def test_doctor_reports_the_sentinel_counters(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_ascend_routing import runner_state
    from vllm_ascend_routing.preflight import self_check

    prepared = capture.PreparedCapture.bound(torch.zeros(4, 3, 2, dtype=torch.int16), torch.zeros(1), 8, (0, 2))
    monkeypatch.setattr(runner_state, "captures_in_process", lambda: [prepared])
    sentinel._REPORTS.count(steps_checked=3, rows_checked=24)
    expected = "2 MoE layers bound; always-on check: 24 rows in 3 steps, 0 all-zero, 0 invalid ids"
    assert self_check.capture_report() == (expected, [])
    sentinel._REPORTS.count(zero_rows=4, invalid_ids=1)
    assert len(self_check.capture_report()[1]) == 2
    # The workers' counters (collective_rpc), where the runners are other processes: none bound here.
    monkeypatch.setattr(runner_state, "captures_in_process", lambda: [])
    workers = {"steps_checked": 6, "rows_checked": 48, "zero_rows": 0, "invalid_ids": 0}
    assert self_check.capture_report(workers) == ("always-on check: 48 rows in 6 steps, 0 all-zero, 0 invalid ids", [])
    # No row counted is a failure, not a pass: the check did not run or its counters did not come back.
    assert self_check.capture_report({**workers, "rows_checked": 0})[1] == [
        "the always-on check counted no row (did it run?)"
    ]


# ---- the accelerator path on a real device (make gpu-check runs the CUDA ones; an NPU host runs -m npu) ----

ACCELERATORS = [pytest.param("cuda", marks=pytest.mark.cuda), pytest.param("npu", marks=pytest.mark.npu)]


@contextlib.contextmanager
def _no_synchronisation(device: str) -> Iterator[None]:
    """Any host synchronisation inside raises (CUDA's sync debug mode; NPU where torch_npu offers it)."""
    module = getattr(torch, device)
    set_mode = getattr(module, "set_sync_debug_mode", None)
    if set_mode is None:
        yield
        return
    set_mode("error")
    try:
        yield
    finally:
        set_mode("default")


def _arrived(check: Sentinel) -> None:
    """Wait, without synchronising, until the packet in flight has arrived (its event completes)."""
    assert check._in_flight is not None
    deadline = time.monotonic() + 30
    while not check._in_flight.event.query():
        assert time.monotonic() < deadline, "the packet's event never completed"
        time.sleep(0.001)


def _device_rows(check: Sentinel, tokens: int, layers: tuple[int, ...]) -> None:
    """Real rows (distinct experts) written on the device, as the capture op writes them."""
    row = torch.arange(check.buffer.shape[2], dtype=check.buffer.dtype, device=check.buffer.device)
    for layer in layers:
        check.buffer[:tokens, layer] = row


@pytest.mark.parametrize("device", ACCELERATORS)
def test_device_path_on_the_accelerator(device: str) -> None:
    """The pinned packet, the device's own event, no synchronisation: a step's planted zero rows and invalid
    ids are reported with that step's requests, read at a later step."""
    if device == "npu":
        import torch_npu  # noqa: F401  (registers torch.npu)
    buffer = torch.zeros(64, 4, 2, dtype=torch.int16, device=device)
    check = Sentinel(buffer, torch.zeros(1, dtype=torch.int64, device=device), (1, 3), 8, strict=True)
    assert check._host is not None and check._host.is_pinned()
    assert isinstance(check._event(), getattr(torch, device).Event)  # the device's own event, not an alias
    with _no_synchronisation(device):
        _device_rows(check, 2, (1, 3))  # step 1: req-b's three rows zero in both layers
        check.after_forward(5, lambda: list(STEP))
        _arrived(check)
        check.clear(5)
        _device_rows(check, 5, (1, 3))  # step 2 clean: the report must name step 1's request
        with pytest.raises(RoutingValidationError, match=r"6 all-zero.*request req-b, its token 0 of this step"):
            check.after_forward(5, lambda: [("req-c", 5)])
        check.errors.add_(3)  # step 3 stores three ids as -1
        check.after_forward(5, lambda: list(STEP))
        _arrived(check)
        with pytest.raises(RoutingValidationError, match=r"3 routed expert id\(s\) outside \[0, 8\)"):
            check.after_forward(5, lambda: list(STEP))
    assert sentinel.stats().as_dict() == {"steps_checked": 2, "rows_checked": 20, "zero_rows": 6, "invalid_ids": 3}


class _EventFirst(Sentinel):
    """The ordering mutation: the event recorded before the packet is computed and copied."""

    def _enqueue(self, num_tokens: int, requests: list[tuple[str, int]]) -> None:
        assert self._host is not None
        event = self._event()
        event.record()
        self._host.copy_(self._packet(num_tokens), non_blocking=True)
        self._in_flight = sentinel._InFlight(event, num_tokens, requests)


@pytest.mark.cuda
def test_an_event_recorded_before_the_copy_misses_zero_rows_on_the_gpu() -> None:
    """On the GPU the ordering matters: with the event first, the host reads the packet before it arrives.
    A large step (1 GiB of rows, about a millisecond of reduction) keeps the packet in flight while the event
    has completed. The correct order catches every planted step; the mutation must miss at least one."""
    tokens, layers = 1 << 20, tuple(range(64))

    def caught(kind: type[Sentinel]) -> list[bool]:
        buffer = torch.ones(tokens, len(layers), 8, dtype=torch.int16, device="cuda")
        check = kind(buffer, torch.zeros(1, dtype=torch.int64, device="cuda"), layers, 8, strict=True)
        seen = []
        for _ in range(5):
            buffer[tokens - 1, 63] = 0  # the last row of the last layer bypassed, every step
            check.after_forward(tokens, lambda: [("req", tokens)])
            _arrived(check)
            try:
                check.after_forward(tokens, lambda: [("req", tokens)])
                seen.append(False)
            except RoutingValidationError:
                seen.append(True)
            torch.cuda.synchronize()
            check._in_flight = None  # the read step enqueued no packet (it raised) or one not wanted here
            assert check._host is not None
            check._host.zero_()  # no trial reads the previous trial's packet
        return seen

    assert caught(Sentinel) == [True] * 5
    assert not all(caught(_EventFirst)), "an event recorded before the copy went unnoticed on this GPU"


@pytest.mark.parametrize("top_k", [3, 6, 8])
def test_wide_rows_count_as_zero_only_when_every_id_is_zero(top_k: int) -> None:
    """The CPU check reads a row as whole words (8 ids of int16: two 64-bit words): a row whose first word is zero
    but not its last is not an all-zero row; one that is zero throughout is."""
    check = _sentinel(top_k=top_k, layers=(0, 1, 2, 3), strict=False)
    check.buffer[:3] = torch.arange(1, top_k + 1, dtype=torch.int16)
    check.buffer[0, 2, :-1] = 0  # only the last id set: not all zero
    check.buffer[1, 3, 1:] = 0  # only the first id set: not all zero
    check.buffer[2, 1] = 0  # all zero
    check.after_forward(3, lambda: [])
    assert sentinel.stats().zero_rows == 1
    check.clear(3)
    assert not check.buffer[:3].any() and check.buffer[3:].eq(0).all()
