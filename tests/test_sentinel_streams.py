# SPDX-License-Identifier: Apache-2.0
"""The stream order of ``Sentinel.clear`` under async scheduling: no race with vLLM's host copy of the previous step.

``clear`` zeroes the step's rows on the current stream when the runner hook's ``execute_model`` starts. Under async
scheduling vLLM copies the previous step's rows to the host on a copy stream of its own that may still be running
then. What makes that safe, in every release the plugin serves (docs/design.md, "Stream order of the step's
clear"): vLLM's copy never reads the capture buffer itself, but a snapshot of it taken on the runner's stream right
after the step's forward (0.22-0.30: ``buf[:total].clone()``; Model Runner V2: ``capturer.get_routed_experts``;
0.31+: the connector's ``snapshot_routing_data``), and the runner alternates ``execute_model`` and ``sample_tokens``
(vLLM raises on two ``execute_model`` in a row), so the next step's ``clear``, enqueued on that same stream, runs
after the snapshot whatever the copy stream does.

On the CPU: a two-stream stand-in that runs each stream's work in order, honours ``wait_stream``, and otherwise
delays the copy stream as long as it can; the runner hooks are the plugin's own, ``clear`` its own, only the work it
enqueues goes to the stream current when it is called (as device work does). On a GPU (``cuda``): real streams, the
copy stream held back by a sleeping kernel while the next step clears and writes. Both also run the snapshot-less
copy, which must see the race: the tests can tell.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from vllm_ascend_routing import capture, runner_mixin, runner_state
from vllm_ascend_routing.sentinel import Sentinel

TOKENS, LAYERS, TOP_K = 6, 2, 2


@dataclass
class Stream:
    """Work in enqueue order; ``waits`` holds, per entry, the (stream, position) it must not overtake."""

    name: str
    work: list[tuple[Callable[[], None], tuple[Stream, int] | None]] = field(default_factory=list)
    done: int = 0

    def run_one(self) -> bool:
        if self.done == len(self.work):
            return False
        fn, wait = self.work[self.done]
        if wait is not None and wait[0].done < wait[1]:
            return False
        fn()
        self.done += 1
        return True


@dataclass
class Device:
    """Two streams; ``current`` is where device work goes when issued (``torch.cuda.current_stream``)."""

    main: Stream = field(default_factory=lambda: Stream("main"))
    copy: Stream = field(default_factory=lambda: Stream("copy"))
    current: Stream | None = None

    def enqueue(self, fn: Callable[[], None], stream: Stream | None = None, wait: Stream | None = None) -> None:
        target = stream or self.current or self.main
        target.work.append((fn, None if wait is None else (wait, len(wait.work))))

    def drain_copy_last(self) -> None:
        """The worst case for a reader on the copy stream: the main stream runs as far as it can first."""
        while self.main.run_one() or self.copy.run_one():
            while self.main.run_one():
                pass


class AsyncRunner:
    """vLLM's GPU runner under async scheduling, as far as the routed-experts rows go: the forward writes the step's
    rows into the capture buffer on the main stream; ``sample_tokens`` takes the snapshot on the main stream (unless
    ``snapshot=False``: the mutation) and enqueues its device-to-host copy on the copy stream after a ``wait_stream``;
    the host reads the copy later."""

    def __init__(self, device: Device, buffer: torch.Tensor, snapshot: bool = True) -> None:
        self.device, self.buffer, self.snapshot = device, buffer, snapshot
        self.model = object()
        self.input_batch = SimpleNamespace(req_ids=["r"])
        self.host: list[torch.Tensor] = []
        self.step = 0

    def forward(self, scheduler_output: Any) -> None:
        step = self.step

        def write() -> None:
            self.buffer[:TOKENS] = rows_of(step)

        self.device.enqueue(write)
        self.step += 1

    def sample_tokens(self) -> None:
        holder: dict[str, torch.Tensor] = {}
        if self.snapshot:
            self.device.enqueue(lambda: holder.__setitem__("rows", self.buffer[:TOKENS].clone()))
        slot = len(self.host)
        self.host.append(torch.full((TOKENS, LAYERS, TOP_K), -1, dtype=torch.int16))

        def to_host() -> None:
            source = holder["rows"] if self.snapshot else self.buffer[:TOKENS]
            self.host[slot].copy_(source)

        self.device.enqueue(to_host, stream=self.device.copy, wait=self.device.main)


def rows_of(step: int) -> torch.Tensor:
    return (1 + step * 10 + torch.arange(TOKENS * LAYERS * TOP_K)).reshape(TOKENS, LAYERS, TOP_K).to(torch.int16)


def run_async_steps(snapshot: bool, monkeypatch: pytest.MonkeyPatch, steps: int = 4) -> list[torch.Tensor]:
    """``steps`` async steps through the plugin's runner hooks; the host copies, after the worst-case schedule."""
    device = Device()
    buffer = torch.zeros((16, LAYERS, TOP_K), dtype=torch.int16)
    prepared = capture.PreparedCapture.bound(buffer, torch.zeros(1, dtype=torch.int64), 64, (0, 1))
    clear = Sentinel.clear

    def clear_on_current_stream(self: Sentinel, num_tokens: int) -> None:
        device.enqueue(lambda: clear(self, num_tokens))  # as a device op: on the stream current at the call

    monkeypatch.setattr(Sentinel, "clear", clear_on_current_stream)
    monkeypatch.setattr(Sentinel, "after_forward", lambda self, n, requests: None)  # its packet is not the subject
    runner = AsyncRunner(device, buffer, snapshot)
    runner_state.set_prepared(runner, prepared)
    api = SimpleNamespace(step_started=lambda *a: None, after_forward=lambda *a: None)
    step_output = SimpleNamespace(total_num_scheduled_tokens=TOKENS, num_scheduled_tokens={"r": TOKENS})
    device.current = device.main
    for _ in range(steps):
        runner_mixin.RoutingCaptureRunnerMixin.execute_model(runner, api, lambda r, s: r.forward(s), step_output)  # type: ignore[arg-type]
        runner.sample_tokens()
    device.drain_copy_last()
    assert device.main.done == len(device.main.work) and device.copy.done == len(device.copy.work)
    return runner.host


def test_the_next_steps_clear_never_reaches_vllms_host_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """With vLLM's snapshot on the main stream, each step's host copy holds that step's rows, although every copy
    ran after the next step's clear and forward."""
    host = run_async_steps(True, monkeypatch)
    for step, rows in enumerate(host):
        assert torch.equal(rows, rows_of(step)), step


def test_without_the_snapshot_the_stand_in_shows_the_race(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same schedule with vLLM copying the live buffer: the copies see a later step's rows (or zeros). The
    stand-in can show a race, so the test above is not passing for want of one."""
    host = run_async_steps(False, monkeypatch)
    assert not torch.equal(host[0], rows_of(0))


# ``torch.cuda._sleep`` spins for a number of GPU clock cycles: 1e8 is about 50 ms at 2 GHz, longer at lower clocks.
HOLD_BACK_CYCLES = 100_000_000


@pytest.mark.cuda
@pytest.mark.parametrize("snapshot", [True, False], ids=["vllm_snapshot", "live_buffer_mutation"])
def test_clear_on_the_gpu_waits_for_nothing_and_races_with_nothing(snapshot: bool) -> None:
    """Real streams: step 0's rows, vLLM's snapshot on the runner's stream, the copy stream held back ~50 ms by a
    sleeping kernel before its device-to-host copy; meanwhile step 1's ``clear`` and forward on the runner's stream.
    The snapshot's copy holds step 0's rows; the live-buffer mutation must not (it proves the copy was still in
    flight when the clear ran)."""
    buffer = torch.zeros((64, LAYERS, TOP_K), dtype=torch.int16, device="cuda")
    check = Sentinel(buffer, torch.zeros(1, dtype=torch.int64, device="cuda"), (0, 1), 64)
    copy_stream = torch.cuda.Stream()
    host = torch.full((TOKENS, LAYERS, TOP_K), -1, dtype=torch.int16).pin_memory()
    main = torch.cuda.current_stream()
    check.clear(TOKENS)
    buffer[:TOKENS].copy_(rows_of(0).cuda())  # step 0's forward
    source = buffer[:TOKENS].clone() if snapshot else buffer[:TOKENS]  # sample_tokens: vLLM's snapshot
    copy_stream.wait_stream(main)
    with torch.cuda.stream(copy_stream):
        torch.cuda._sleep(HOLD_BACK_CYCLES)
        host.copy_(source, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
    check.clear(TOKENS)  # step 1 starts: the plugin's clear, on the runner's stream, not waiting for the copy
    buffer[:TOKENS].copy_(rows_of(1).cuda(), non_blocking=True)  # step 1's forward
    assert not copied.query(), "the copy stream was not held back: the test shows nothing"
    copied.synchronize()
    torch.cuda.synchronize()
    if snapshot:
        assert torch.equal(host, rows_of(0))
    else:
        assert not torch.equal(host, rows_of(0)), "the live buffer's copy ran before the next clear: no overlap seen"
