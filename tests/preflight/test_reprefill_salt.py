# SPDX-License-Identifier: Apache-2.0
"""The re-prefill is an independent pass (``preflight/reprefill.collect``): no row of it may come from the prefix
cache the generation filled, or the oracle compares a request with itself. Against a front end whose prefix
cache works as vLLM's does: full blocks keyed by the request's ``cache_salt`` and every token before them."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

from vllm_ascend_routing.preflight import reprefill

BLOCK = 16


class CachingFrontEnd:
    """``LLM.generate`` as ``collect`` calls it, with automatic prefix caching: a request is served the full blocks
    of its prompt (all but its last token) that an earlier request computed under the same ``cache_salt``
    (``num_cached_tokens``); the full blocks of its prompt and output are cached when it finishes. Greedy
    outputs are a function of the prompt. ``honours_salt=False``: a front end that ignores the salt."""

    def __init__(self, honours_salt: bool = True) -> None:
        self.honours_salt = honours_salt
        self.cached: set[tuple[Any, ...]] = set()
        self.requests: list[dict[str, Any]] = []

    def _key(self, salt: str | None, tokens: list[int]) -> tuple[Any, ...]:
        return (salt if self.honours_salt else None, *tokens)

    def generate(self, prompts: list[dict[str, Any]], max_tokens: Sequence[int]) -> list[Any]:
        outputs = []
        for prompt, count in zip(prompts, max_tokens, strict=True):
            self.requests.append(prompt)
            ids, salt = list(prompt["prompt_token_ids"]), prompt.get("cache_salt")
            hits = 0
            while hits + BLOCK <= len(ids) - 1 and self._key(salt, ids[: hits + BLOCK]) in self.cached:
                hits += BLOCK
            tokens = [100 + (sum(ids) + 7 * i) % 900 for i in range(count)]
            whole = ids + tokens
            self.cached.update(self._key(salt, whole[:end]) for end in range(BLOCK, len(whole) + 1, BLOCK))
            completion = SimpleNamespace(token_ids=tokens, routed_experts=None)
            outputs.append(SimpleNamespace(prompt_token_ids=ids, outputs=[completion], num_cached_tokens=hits))
        return outputs


def collect(front_end: CachingFrontEnd) -> reprefill.Collected:
    return reprefill.collect(front_end.generate, lambda n: n, 8, 32000, 1024, 24, rows=lambda output: None)


def test_the_reprefill_is_never_served_from_the_generations_prefix_cache() -> None:
    front_end = CachingFrontEnd()
    first = collect(front_end)
    assert first.work.cached_tokens > 0  # the generation's second wave was served hits: this cache serves them
    assert first.work.reprefill_cached_tokens == 0 and first.work.problems == []
    salts = [request.get("cache_salt") for request in front_end.requests[-len(first.reprefill) :]]
    assert None not in salts and len(set(salts)) == len(salts)  # one salt per re-prefilled request
    second = collect(front_end)  # the same sequences again: a new run never reuses an earlier run's salts
    assert second.work.reprefill_cached_tokens == 0 and second.work.problems == []
    again = [request["cache_salt"] for request in front_end.requests[-len(second.reprefill) :]]
    assert not set(again) & set(salts)


def test_a_front_end_that_ignores_the_salt_is_a_finding() -> None:
    """Where the salt does not reach the prefix cache, the served tokens are counted and named, never silent."""
    work = collect(CachingFrontEnd(honours_salt=False)).work
    assert work.reprefill_cached_tokens > 0
    assert work.problems == [
        f"the re-prefill was served {work.reprefill_cached_tokens} tokens from the prefix cache despite its cache "
        "salt: its rows are not an independent pass"
    ]
