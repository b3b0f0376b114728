# SPDX-License-Identifier: Apache-2.0
"""The engine's objects within the byte cap and the TTL, each at its boundary."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from vllm_ascend_routing.store import layout
from vllm_ascend_routing.store.interface import StoreFullError
from vllm_ascend_routing.store.keys import Namespace
from vllm_ascend_routing.store.ledger import Ledger
from vllm_ascend_routing.store.shm import ShmBackend

ROWS = np.arange(40 * 4 * 2, dtype=np.uint8).reshape(40, 4, 2)


def object_bytes() -> int:
    return sum(len(part) for part in layout.encode(Namespace.mint().key(), ROWS, 0)[0])


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def ledger(tmp_path: Path, cap_objects: float, ttl: float = 0, clock: Clock | None = None) -> Ledger:
    return Ledger(ShmBackend(str(tmp_path)), Namespace.mint(), int(cap_objects * object_bytes()), ttl, clock or Clock())


def test_the_cap_admits_exactly_what_fits(tmp_path: Path) -> None:
    at_cap = ledger(tmp_path, 3)
    for _ in range(3):
        at_cap.publish(ROWS, 0)  # at the cap: admitted
    with pytest.raises(StoreFullError, match="VLLM_ASCEND_ROUTING_STORE_MIB"):
        at_cap.publish(ROWS, 0)  # one byte-object above it
    assert at_cap.live_bytes == 3 * object_bytes() and at_cap.stats.refused_full == 1
    below = ledger(tmp_path, 3 - 1e-6)
    below.publish(ROWS, 0)
    below.publish(ROWS, 0)
    with pytest.raises(StoreFullError):
        below.publish(ROWS, 0)


def test_a_release_by_another_process_frees_room(tmp_path: Path) -> None:
    one = ledger(tmp_path, 1)
    key = one.publish(ROWS, 0)
    ShmBackend(str(tmp_path)).remove(key)  # the trainer's release
    second = one.publish(ROWS, 0)
    assert list(one.entries) == [second] and one.live_bytes == object_bytes()


def test_objects_expire_at_their_ttl_not_before(tmp_path: Path) -> None:
    clock = Clock()
    timed = ledger(tmp_path, 10, ttl=60, clock=clock)
    first = timed.publish(ROWS, 0)
    clock.now += 59.999
    timed.publish(ROWS, 0)
    assert first in timed.entries and timed.backend.size(first) is not None  # below its TTL: kept
    clock.now += 0.001
    timed.publish(ROWS, 0)
    assert first not in timed.entries and timed.backend.size(first) is None and timed.stats.expired == 1


def test_shutdown_removes_every_live_object(tmp_path: Path) -> None:
    live = ledger(tmp_path, 10)
    published = [live.publish(ROWS, 0) for _ in range(3)]
    live.close()
    assert all(live.backend.size(key) is None for key in published) and live.live_bytes == 0
