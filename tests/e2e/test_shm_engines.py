# SPDX-License-Identifier: Apache-2.0
"""The 0.20.x shared-memory store with real engines: two at once, crash leftovers, clean exit."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

from vllm_ascend_routing.compat import _shm_store as store

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]


@pytest.fixture(autouse=True)
def shm_generation_only(generation: str) -> None:
    if generation != "shm":
        pytest.skip("the shared-memory store is the vLLM 0.20.x (shm) generation only")


def segments() -> set[str]:
    return {p.name for p in store.SHM_DIR.glob(f"{store.PREFIX}_*")}


def test_two_engines_at_once_both_exact(scenario: Any) -> None:
    first = scenario.start("offline", "--arch", "qwen3_moe", "--prompts", "6")
    second = scenario.start("offline", "--arch", "mixtral", "--prompts", "6")
    results = [scenario.finish(first), scenario.finish(second)]
    for result in results:
        for part in ("batch", "chunked_prefill", "prefix_repeat"):
            assert result[part]["ok"], (result["arch"], part, result[part]["problems"])
    assert not segments(), "a clean exit must leave no segment behind"


def test_sigkilled_engine_leaves_segment_next_start_removes_it(scenario: Any) -> None:
    before = segments()
    engine = scenario.start("offline", "--arch", "mixtral", "--prompts", "4")
    deadline = time.monotonic() + 600
    while not (segments() - before):
        assert engine.poll() is None, "engine exited before creating its segment"
        assert time.monotonic() < deadline, "engine never created its segment"
        time.sleep(0.5)
    leftover = segments() - before
    os.killpg(engine.pid, signal.SIGKILL)  # the whole tree, resource tracker included: nothing cleans up
    engine.wait()
    time.sleep(1)
    assert leftover <= segments(), "SIGKILL should leave the segment behind"
    owners = [store.owner_file(store.key_of(name)) for name in leftover]
    assert any(owner.exists() for owner in owners)

    result = scenario.finish(scenario.start("offline", "--arch", "mixtral", "--prompts", "4"))
    assert result["batch"]["ok"], result["batch"]["problems"]
    assert not (leftover & segments()), "the next engine start must remove the dead engine's segment"
    assert not any(owner.exists() for owner in owners)
    assert not segments()
