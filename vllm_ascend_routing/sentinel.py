# SPDX-License-Identifier: Apache-2.0
"""Always-on check of every step's recorded rows, in the worker: rows that cannot be real routing, and
invalid ids, are reported loudly whether or not validation mode is on.

Two facts make the check exact, with no false positive:
  * a real routing row holds ``top_k`` *distinct* experts, so for ``top_k >= 2`` a row of a bound MoE layer
    that is all zero is never routing: it is a layer whose capture did not run (a bypass: a hook that stopped
    running, a graph replayed without the capture op, a runner that never calls the MoE forward's Python).
    The step's rows are zeroed before the forward (``clear``), so a bypass always leaves zeros, never the
    previous step's rows;
  * the capture op counts every id it stored as invalid (outside ``[0, limit)``) in the model's error counter.
    An invalid id can read as a real expert after vLLM narrows the array (uint8: -1 is 255, a real expert of
    a 256-expert model), so its count is reported the step it appears.

Cost: on the CPU, an OR over the words of the step's rows read in place through NumPy (no copy of the
buffer, no device). On an accelerator the same reduction runs on the device into a three-number packet, copied
to pinned host memory without blocking and read at a later step once its event has completed: no
synchronisation is added, and a step whose previous packet is still in flight is not checked (a bypass zeroes
rows every step: sampling loses nothing). The layers checked are the ones this worker bound, so models whose
MoE layout the config does not tell (``contract.moe_layers``) are checked too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vllm_ascend_routing import envs
from vllm_ascend_routing._logging import get_logger
from vllm_ascend_routing.reporting import ProcessReports, loud
from vllm_ascend_routing.validate import RoutingValidationError

logger = get_logger(__name__)


@dataclass
class SentinelStats:
    """What this process's checks saw (all captures together)."""

    steps_checked: int = 0
    rows_checked: int = 0  # (token, bound MoE layer) rows
    zero_rows: int = 0
    invalid_ids: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


# Several runners (DP engines in one process, tests) share the counters; the first three reports are kept.
_REPORTS = ProcessReports(SentinelStats, kept=3)


def stats() -> SentinelStats:
    """A copy of this process's counters."""
    return _REPORTS.stats()


def first_reports() -> list[str]:
    """The first reports this process made (at most three), as logged."""
    return _REPORTS.first_reports()


@dataclass
class _InFlight:
    """A device packet on its way to the host: zero rows, first zero (flat row * layers + layer), errors."""

    event: Any
    num_tokens: int
    requests: list[tuple[str, int]]


StepRequests = Callable[[], list[tuple[str, int]]]  # the step's (request id, tokens) in row order


@dataclass
class Sentinel:
    """The checks of one prepared capture (one target model, one buffer)."""

    buffer: torch.Tensor  # [max_tokens, num_layers, top_k]
    errors: torch.Tensor  # [1], the capture op's invalid-id counter
    bound_layers: tuple[int, ...]  # layers this worker bound, ascending
    num_experts: int  # the id range recorded as valid (routed experts, then zero experts)
    strict: bool = False
    _layers: Any = field(default=None, init=False, repr=False)  # index of bound_layers (slice when contiguous)
    # The CPU: NumPy views of the buffer (its rows read as ``_word`` integers, one row of top_k ids = whole words)
    # and of the error counter, taken once: a NumPy call costs a fraction of an ATen one at these sizes.
    _rows: np.ndarray | None = field(default=None, init=False, repr=False)
    _errors: np.ndarray | None = field(default=None, init=False, repr=False)
    _word: Any = field(default=None, init=False, repr=False)
    _host: torch.Tensor | None = field(default=None, init=False, repr=False)  # pinned packet (accelerators)
    _in_flight: _InFlight | None = field(default=None, init=False, repr=False)
    _errors_seen: int = field(default=0, init=False, repr=False)
    _reports: int = field(default=0, init=False, repr=False)

    @classmethod
    def for_capture(
        cls, buffer: torch.Tensor, errors: torch.Tensor, bound_layers: tuple[int, ...], num_experts: int
    ) -> Sentinel:
        return cls(buffer, errors, bound_layers, num_experts, strict=envs.VLLM_ASCEND_ROUTING_VALIDATE == "strict")

    def __post_init__(self) -> None:
        layers = self.bound_layers
        contiguous = bool(layers) and layers == tuple(range(layers[0], layers[-1] + 1))
        self._layers = slice(layers[0], layers[-1] + 1) if contiguous else list(layers)
        if self.buffer.device.type == "cpu":
            self._rows, self._errors = self.buffer.numpy(), self.errors.numpy()
            row_bytes = self.buffer.shape[2] * self.buffer.element_size()
            self._word = next(w for w in (np.uint64, np.uint32, np.uint16, np.uint8) if row_bytes % w().itemsize == 0)
        else:
            self._host = torch.zeros(3, dtype=torch.int64, pin_memory=True)
            self._layers = self._layers if contiguous else torch.tensor(layers, device=self.buffer.device)

    def kept_tensors(self) -> dict[str, torch.Tensor]:
        """Device tensors of the check's own that every step reads and none rewrites (the index of non-contiguous
        bound layers on an accelerator); the counter and the rows are the capture's."""
        return {"bound_layers": self._layers} if isinstance(self._layers, torch.Tensor) else {}

    @property
    def checks_zero_rows(self) -> bool:
        """Only for ``top_k >= 2``: with one expert per token, expert 0 alone is a real row."""
        return self.buffer.shape[2] >= 2

    def clear(self, num_tokens: int) -> None:
        """Before the step's forward: its rows start at zero, so a bypassed layer cannot show old rows.

        On a device the zeroing is enqueued on the current stream (the runner's) and waits for nothing. Under async
        scheduling vLLM may still be copying the previous step's rows to the host on its own copy stream, but that
        copy reads a snapshot vLLM took on the runner's stream right after that step's forward, never this buffer,
        so this zeroing, later on the same stream, cannot reach it (docs/design.md, "Stream order of the
        step's clear"; tests/test_sentinel_streams.py)."""
        if num_tokens:
            if self._rows is not None:
                self._rows[:num_tokens] = 0
            else:
                self.buffer[:num_tokens].zero_()

    def after_forward(self, num_tokens: int, requests: StepRequests) -> None:
        """After the step's forward is enqueued: check its ``num_tokens`` rows. ``requests()`` gives the
        step's ``(request id, scheduled tokens)`` in row order, for the report (called on the CPU only when
        there is something to report)."""
        if num_tokens <= 0:
            return
        if self._host is None:
            self._check_host(num_tokens, requests)
        else:
            self._poll()
            if self._in_flight is None:
                self._enqueue(num_tokens, requests())

    # ---- the CPU: the rows are host memory already ----

    def _check_host(self, num_tokens: int, requests: StepRequests) -> None:
        assert self._rows is not None and self._errors is not None
        errors = int(self._errors[0])
        zero_count, first = 0, -1
        if self.checks_zero_rows:
            # A row is all zero exactly when the OR of its words is: elementwise ORs of a few word columns, where
            # NumPy's reduction along a short last axis costs several times more.
            words = self._rows[:num_tokens, self._layers].view(self._word)  # [tokens, bound layers, words]
            nonzero = words[..., 0]
            for column in range(1, words.shape[2]):
                nonzero = nonzero | words[..., column]
            if not nonzero.all():
                zero = nonzero == 0
                zero_count = int(zero.sum())
                first = int(np.argmax(zero.ravel()))
        if zero_count or errors != self._errors_seen:
            self._account(num_tokens, zero_count, first, errors, requests())
        else:
            self._account(num_tokens, 0, -1, errors, [])

    # ---- accelerators: a packet computed on the device, read when it has arrived ----

    def _packet(self, num_tokens: int) -> torch.Tensor:
        """``[zero rows, first zero row (flat), errors]`` on the buffer's device; no host read."""
        rows = self.buffer[:num_tokens, self._layers]
        zero = (rows == 0).all(dim=2).flatten() if self.checks_zero_rows else rows.new_zeros(1, dtype=torch.bool)
        count = zero.sum()
        first = torch.where(count > 0, torch.argmax(zero.to(torch.uint8)), -1)
        return torch.stack((count.to(torch.int64), first.to(torch.int64), self.errors[0].to(torch.int64)))

    def _enqueue(self, num_tokens: int, requests: list[tuple[str, int]]) -> None:
        assert self._host is not None
        self._host.copy_(self._packet(num_tokens), non_blocking=True)
        event = self._event()
        event.record()
        self._in_flight = _InFlight(event, num_tokens, requests)

    def _event(self) -> Any:
        """The device's own event type (``torch.npu.Event`` on Ascend, never a ``torch.cuda`` alias)."""
        return getattr(torch, self.buffer.device.type).Event()

    def _poll(self) -> None:
        in_flight = self._in_flight
        if in_flight is None or not in_flight.event.query():
            return
        self._in_flight = None
        assert self._host is not None
        zero_count, first, errors = (int(value) for value in self._host.tolist())
        self._account(in_flight.num_tokens, zero_count, first, errors, in_flight.requests)

    # ---- reporting ----

    def _account(
        self, num_tokens: int, zero_count: int, first: int, errors: int, requests: list[tuple[str, int]]
    ) -> None:
        new_errors = errors - self._errors_seen
        self._errors_seen = errors
        _REPORTS.count(
            steps_checked=1,
            rows_checked=num_tokens * len(self.bound_layers) if self.checks_zero_rows else 0,
            zero_rows=zero_count,
            invalid_ids=max(new_errors, 0),
        )
        problems = []
        if zero_count:
            row, column = divmod(first, len(self.bound_layers))
            problems.append(
                f"{zero_count} all-zero routing row(s) in this step's {num_tokens} tokens x "
                f"{len(self.bound_layers)} MoE layers, first: {_where(row, requests)}, layer "
                f"{self.bound_layers[column]}. A top-{self.buffer.shape[2]} row holds distinct experts, so this "
                "layer's capture did not run (its routing was bypassed): these rows are not routing"
            )
        if new_errors > 0:
            problems.append(
                f"{new_errors} routed expert id(s) outside [0, {self.num_experts}) recorded (stored as -1, which "
                f"vLLM's uint8 array shows as 255; {errors} in this engine so far): those rows are not routing"
            )
        if problems:
            self._report("; ".join(problems))

    def _report(self, message: str) -> None:
        self._reports += 1
        text = f"vllm-ascend-routing: {message}."
        _REPORTS.keep(text)
        if self.strict or loud(self._reports):
            logger.error("%s (report %d; counters: %s)", text, self._reports, stats().as_dict())
        if self.strict:
            raise RoutingValidationError(text)


def _where(row: int, requests: list[tuple[str, int]]) -> str:
    """``request R token t`` for a row of the step, where the step's request order is known."""
    start = 0
    for request_id, count in requests:
        if row < start + count:
            return f"request {request_id}, its token {row - start} of this step (step row {row})"
        start += count
    return f"step row {row}"


def step_requests(runner: Any, scheduler_output: Any) -> list[tuple[str, int]]:
    """The step's ``(request id, scheduled tokens)`` in the order the runner laid its tokens out (the V1
    runners' input batch); empty where the runner does not expose it (the report then names the row)."""
    req_ids = getattr(getattr(runner, "input_batch", None), "req_ids", None)
    counts = getattr(scheduler_output, "num_scheduled_tokens", None)
    if not isinstance(req_ids, list) or not isinstance(counts, dict):
        return []
    return [(str(r), int(counts.get(r, 0))) for r in req_ids if r is not None]
