# SPDX-License-Identifier: Apache-2.0
"""doctor --model's engine front end under data parallel (vLLM's AsyncLLM): requests go in concurrently, each
one's final output comes back in the order asked, under a request id of its own; the counters of engine cores in
other processes are not claimed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from vllm_ascend_routing.preflight import frontend


class FakeAsyncLLM:
    """Streams two outputs per request, finishing in the reverse order of submission."""

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.shut = False
        self.handler: asyncio.Task[None] | None = None

    async def generate(self, prompt: Any, params: Any, request_id: str) -> AsyncIterator[Any]:
        if self.handler is None:  # as AsyncLLM's output handler: a task on the loop, running until shutdown
            self.handler = asyncio.get_running_loop().create_task(asyncio.sleep(3600))
        self.ids.append(request_id)
        yield ("partial", prompt)
        await asyncio.sleep(0.01 * (10 - len(self.ids)))  # later requests finish first
        yield ("final", prompt, params)

    def shutdown(self) -> None:
        self.shut = True


def test_async_outputs_come_back_in_order_with_their_own_ids() -> None:
    engine = FakeAsyncLLM()
    front = frontend.Frontend("AsyncLLM", engine, model_config=None, vllm_config=None, _loop=asyncio.new_event_loop())
    first = front.generate(["a", "b", "c"], [1, 2, 3])
    second = front.generate(["d"], [4])  # a second call on the same loop (AsyncLLM's task lives there)
    assert first == [("final", "a", 1), ("final", "b", 2), ("final", "c", 3)] and second == [("final", "d", 4)]
    assert engine.ids == ["preflight-0", "preflight-1", "preflight-2", "preflight-3"]
    assert front.sentinel_totals() is None
    front.close()
    assert engine.shut and engine.handler is not None and engine.handler.cancelled()
