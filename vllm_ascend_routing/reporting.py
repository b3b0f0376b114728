# SPDX-License-Identifier: Apache-2.0
"""How the plugin's run-time checks report: one process's counters and its first few reports, under one lock, and
the rule that keeps repeated reports loud without flooding the log.

Used by the always-on check (``sentinel``) and by the rows that follow KV connectors (``kv``): several runners or
schedulers of one process (DP engines in one process, tests) count into the same object. A leaf: standard library
only.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Generic, TypeVar

Counters = TypeVar("Counters")


class ProcessReports(Generic[Counters]):
    """This process's counters (a dataclass of ints) and the first ``kept`` reports it made, as logged."""

    def __init__(self, counters: type[Counters], kept: int) -> None:
        self._type = counters
        self._counters = counters()
        self._kept = kept
        self._first: list[str] = []
        self._lock = threading.Lock()

    def stats(self) -> Counters:
        """A copy of the counters."""
        with self._lock:
            return self._type(**_fields(self._counters))

    def first_reports(self) -> list[str]:
        with self._lock:
            return list(self._first)

    def count(self, **increments: int) -> None:
        """Add ``increments`` to the counters of those names."""
        with self._lock:
            for name, value in increments.items():
                setattr(self._counters, name, getattr(self._counters, name) + value)

    def keep(self, text: str) -> None:
        """Keep ``text`` if fewer than ``kept`` reports are kept (doctor and the tests read them)."""
        with self._lock:
            if len(self._first) < self._kept:
                self._first.append(text)


def loud(report_number: int) -> bool:
    """Whether a reporter's ``report_number``-th report (from 1) is logged: the 1st, 2nd, 4th, 8th ...: every kind
    of fault shows at once, and a fault that repeats every step does not flood the log."""
    return report_number > 0 and report_number & (report_number - 1) == 0


def _fields(counters: Any) -> dict[str, int]:
    return {field.name: getattr(counters, field.name) for field in dataclasses.fields(counters)}
