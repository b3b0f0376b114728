# SPDX-License-Identifier: Apache-2.0
"""The 0.20.x shared-memory store with real engines: crash leftovers removed by the next start, two at once, clean
exit. One engine is SIGKILLed, then two start at once (three engine starts for both claims, not four)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest

from vllm_ascend_routing.compat.shm import store

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]


def shm_generation_only(generation: str) -> None:
    if generation != "shm":
        pytest.skip("the shared-memory store is the vLLM 0.20.x (shm) generation only")


def segments() -> set[str]:
    return {p.name for p in store.SHM_DIR.glob(f"{store.PREFIX}_*")}


def owner_pid(segment: str) -> int | None:
    """The pid the segment's owner file names (the store's own reading of it), if it names this segment."""
    owner = store._owner(store.key_of(segment))
    return owner[0] if owner is not None and owner[1] == segment else None


def in_session(pid: int | None, session: int) -> bool:
    try:
        return pid is not None and os.getsid(pid) == session
    except ProcessLookupError:
        return False


def others_live() -> set[str]:
    """Segments of live engines this test did not start (another test or stage of this user running now): an
    engine's own start leaves them alone, and so does every assertion here."""
    found = set()
    for name in segments():
        pid = owner_pid(name)
        if pid is not None and store._alive(pid):
            found.add(name)
    return found


@pytest.fixture(scope="module")
def after_a_crash(scenario: Any, generation: str) -> dict[str, Any]:
    """An engine SIGKILLed once its segment exists (nothing of it cleans up), then two engines at once: the first
    starts since the crash (an engine's start removes a dead engine's segment) and two stores side by side."""
    shm_generation_only(generation)  # here, not in a function-scoped fixture: this one is set up before those
    engine = scenario.start("offline", "--arch", "mixtral", "--prompts", "4")
    deadline = time.monotonic() + 600

    def engines_own() -> set[str]:  # its engine runs in the session the scenario started (start_new_session)
        return {name for name in segments() if in_session(owner_pid(name), engine.pid)}

    while not engines_own():
        assert engine.poll() is None, "engine exited before creating its segment"
        assert time.monotonic() < deadline, "engine never created its segment"
        time.sleep(0.5)
    leftover = engines_own()
    os.killpg(engine.pid, signal.SIGKILL)  # the whole tree, resource tracker included: nothing cleans up
    engine.wait()
    time.sleep(1)
    owners = [store.owner_file(store.key_of(name)) for name in leftover]
    crashed = {"leftover": leftover, "left_behind": leftover <= segments(), "owners": owners}
    crashed["owner_files_left"] = any(owner.exists() for owner in owners)

    first = scenario.start("offline", "--arch", "qwen3_moe", "--prompts", "6")
    second = scenario.start("offline", "--arch", "mixtral", "--prompts", "6")
    results = [scenario.finish(first), scenario.finish(second)]
    return {**crashed, "results": results, "after": segments() - others_live()}


def test_two_engines_at_once_both_exact(after_a_crash: dict[str, Any]) -> None:
    for result in after_a_crash["results"]:
        for part in ("batch", "chunked_prefill", "prefix_repeat"):
            assert result[part]["ok"], (result["arch"], part, result[part]["problems"])
    assert not after_a_crash["after"], "a clean exit must leave no segment behind"


def test_sigkilled_engine_leaves_segment_next_start_removes_it(after_a_crash: dict[str, Any]) -> None:
    assert after_a_crash["left_behind"], "SIGKILL should leave the segment behind"
    assert after_a_crash["owner_files_left"]
    leftover = after_a_crash["leftover"]
    assert not (leftover & segments()), "the next engine start must remove the dead engine's segment"
    assert not any(owner.exists() for owner in after_a_crash["owners"])
    assert not after_a_crash["after"]
