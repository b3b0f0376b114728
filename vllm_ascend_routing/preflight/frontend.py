# SPDX-License-Identifier: Apache-2.0
"""The engine ``doctor --model`` drives, seen only through its front end (``RequestOutput``s).

Data parallel > 1: vLLM's ``LLM`` refuses it in one process, so the engine is ``AsyncLLM`` (``vllm serve``'s):
one engine-core process per DP rank behind one front end, the layout the user serves with; requests go in
concurrently and vLLM balances them over the ranks. Otherwise ``LLM`` (TP and Ray in its worker processes).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Frontend:
    kind: str  # "LLM" or "AsyncLLM"
    engine: Any
    model_config: Any
    vllm_config: Any  # the engine's resolved VllmConfig (the workload scales to its scheduler and cache configs)
    _loop: asyncio.AbstractEventLoop | None = None
    _ids: itertools.count[int] = field(default_factory=itertools.count)

    def generate(self, prompts: Sequence[Any], params: Sequence[Any]) -> list[Any]:
        """Final ``RequestOutput`` of each prompt, in order."""
        if self.kind == "LLM":
            return list(self.engine.generate(list(prompts), list(params), use_tqdm=False))
        assert self._loop is not None

        async def one(prompt: Any, sampling: Any) -> Any:
            final = None
            async for output in self.engine.generate(prompt, sampling, f"preflight-{next(self._ids)}"):
                final = output
            return final

        async def every() -> list[Any]:
            return list(await asyncio.gather(*(one(p, s) for p, s in zip(prompts, params, strict=True))))

        return self._loop.run_until_complete(every())

    def sentinel_totals(self) -> dict[str, int] | None:
        """The workers' always-on check counters; ``None`` where the engine cores are out of reach (AsyncLLM)."""
        if self.kind != "LLM":
            return None
        from vllm_ascend_routing.preflight import offline

        return offline.sentinel_totals(self.engine)

    def close(self) -> None:
        """Shut the engine down now (its processes included), so what vLLM logs while stopping comes before
        doctor's verdict, not after it."""
        from vllm_ascend_routing.preflight import offline

        if self.kind != "AsyncLLM":
            offline.close(self.engine)
            return
        self.engine.shutdown()
        if self._loop is not None:  # AsyncLLM's output and stats tasks: cancelled, not left pending
            pending = asyncio.all_tasks(self._loop)
            for task in pending:
                task.cancel()
            if pending:
                self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self._loop.close()


def open_engine(options: dict[str, Any]) -> Frontend:
    if int(options.get("data_parallel_size", 1) or 1) <= 1:
        from vllm import LLM

        llm = LLM(**options)
        return Frontend("LLM", llm, llm.llm_engine.model_config, llm.llm_engine.vllm_config)
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)  # AsyncLLM's output task lives on this loop: every call runs on it
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**options))
    return Frontend("AsyncLLM", engine, engine.model_config, engine.vllm_config, loop)
