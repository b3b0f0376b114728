# SPDX-License-Identifier: Apache-2.0
"""The re-prefill oracle's run (``reprefill.collect``) against a stand-in front end: the workload scales to the
engine's layout (step budget, concurrency, block size); coverage is read from what the engine reports
(``num_cached_tokens``, prompts longer than the budget) and its absence fails, saying which; the re-prefill is an
independent pass (its own ``cache_salt``: a front end whose prefix cache would serve it the generation's rows
is caught here, not only end to end)."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from vllm_ascend_routing.preflight import consistency, reprefill
from vllm_ascend_routing.preflight.reprefill import Layout

LAYERS, EXPERTS, TOP_K, VOCAB = 3, 16, 2, 1000
SMALL = Layout(max_num_batched_tokens=32, max_num_seqs=6, block_size=16, max_model_len=256)


def route(context: list[int]) -> np.ndarray:
    """A token's routing, a function of its context only (as a deterministic engine's is): ``[layers, top_k]``."""
    rng = np.random.default_rng(zlib.crc32(np.asarray(context, dtype=np.int64).tobytes()))
    return np.stack([rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(LAYERS)]).astype(np.uint8)


class StandInFrontEnd:
    """TEST-ONLY stand-in for vLLM's ``LLM.generate`` as the oracle sees it: greedy tokens; each token's rows
    computed from its context, or, for a prompt's full KV blocks found in the prefix cache (keyed by the
    request's ``cache_salt`` and the tokens, as vLLM hashes blocks), the rows stored with those blocks, reported
    in ``num_cached_tokens`` (the last prompt token is always computed). ``capture_fault(rows, tokens)`` changes
    a request's rows as a broken capture would (``None``: not this request's), before they are stored with the
    blocks."""

    def __init__(
        self,
        block_size: int = 16,
        prefix_cache: bool = True,
        capture_fault: Callable[[np.ndarray, list[int]], np.ndarray | None] | None = None,
    ) -> None:
        self.block_size, self.prefix_cache, self.capture_fault = block_size, prefix_cache, capture_fault
        self.blocks: dict[tuple[Any, tuple[int, ...]], np.ndarray] = {}
        self.calls: list[list[dict[str, Any]]] = []
        self.faulted = 0  # requests the capture fault was applied to

    def generate(self, prompts: list[dict[str, Any]], params: list[Any]) -> list[Any]:
        self.calls.append(prompts)
        return [self._one(prompt, param.max_tokens) for prompt, param in zip(prompts, params, strict=True)]

    def _one(self, prompt: dict[str, Any], max_tokens: int) -> Any:
        tokens, salt = list(prompt["prompt_token_ids"]), prompt.get("cache_salt")
        sequence = list(tokens)
        for _ in range(max_tokens):
            sequence.append(100 + zlib.crc32(np.asarray(sequence, dtype=np.int64).tobytes()) % (VOCAB - 100))
        rows = np.stack([route(sequence[: i + 1]) for i in range(len(sequence) - 1)])
        cached = 0
        while self.prefix_cache and cached + self.block_size <= len(tokens) - 1:
            key = (salt, tuple(tokens[: cached + self.block_size]))
            if key not in self.blocks:
                break
            cached += self.block_size
        if cached:
            rows[:cached] = self.blocks[(salt, tuple(tokens[:cached]))][:cached]
        faulty = None if self.capture_fault is None else self.capture_fault(rows, tokens)
        if faulty is not None:
            rows = faulty
            self.faulted += 1
        for end in range(self.block_size, len(rows) + 1, self.block_size):  # full blocks, stored with their rows
            self.blocks.setdefault((salt, tuple(sequence[:end])), rows[:end].copy())
        return SimpleNamespace(
            prompt_token_ids=tokens,
            outputs=[SimpleNamespace(token_ids=sequence[len(tokens) :])],
            num_cached_tokens=cached,
            routed_experts=rows,
        )


def params(n: int) -> Any:
    return SimpleNamespace(max_tokens=n)


def rows(output: Any) -> Any:
    return output.routed_experts


def collect(front: StandInFrontEnd, layout: Layout = SMALL, max_tokens: int = 6) -> reprefill.Collected:
    return reprefill.collect(front.generate, params, layout, VOCAB, max_tokens, rows)


def test_layout_is_read_from_vllms_resolved_config() -> None:
    config = SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_batched_tokens=8192, max_num_seqs=256, enable_chunked_prefill=True),
        cache_config=SimpleNamespace(block_size=16, enable_prefix_caching=False),
        model_config=SimpleNamespace(max_model_len=32768),
    )
    assert Layout.of(config) == Layout(8192, 256, 16, 32768, prefix_caching=False, chunked_prefill=True)


@pytest.mark.parametrize(
    "layout",
    [Layout(64, 8, 128, 1024), Layout(8192, 256, 16, 32768), Layout(2048, 1024, 64, 16384)],
    ids=["doctor-defaults-cpu", "gpu-8k-budget", "many-seqs"],
)
def test_the_workload_scales_to_the_step_budget_concurrency_and_block_size(layout: Layout) -> None:
    plan = reprefill.plan(layout, 32000, 16)
    budget, prefix = layout.max_num_batched_tokens, 2 * layout.block_size + 16
    # a full batch and two waiting, at least 8, at most REQUEST_CAP
    assert len(plan.first) == max(8, min(layout.max_num_seqs + 2, reprefill.REQUEST_CAP)) == len(plan.first_outputs)
    assert plan.shared_prefix == prefix and all(p[:prefix] == plan.first[0][:prefix] for p in plan.second)
    # chunked prefills at the user's budget: one token past it, and 2.5 budgets (no shared prefix: all computed)
    assert len(plan.first[1]) == budget + 1 and len(plan.first[5]) == budget * 5 // 2
    assert plan.first[5][:prefix] != plan.first[0][:prefix] and plan.first[2][:prefix] == plan.first[0][:prefix]
    # the second wave: a cached prefix, then a remainder longer than the budget (in a pair of one length)
    assert len(plan.second[0]) == len(plan.second[1]) == prefix + budget + 3
    bodies = [len(p) - (prefix if i % 2 == 0 else 0) for i, p in enumerate(plan.first)]
    others = [body for i, body in enumerate(bodies) if i not in (1, 5)]
    assert max(others) <= max(reprefill.SHORT_PROMPTS)  # two long prompts, whatever the batch
    assert len(set(plan.first_outputs)) >= 4 and min(plan.first_outputs) >= 1  # requests finish at different steps


def test_collect_reports_what_the_engine_exercised_and_passes_a_clean_run() -> None:
    front = StandInFrontEnd()
    collected = collect(front)
    work = collected.work
    assert work.concurrent == SMALL.max_num_seqs + 2 and work.requests == work.concurrent + work.concurrent // 2
    assert work.cached_tokens > 0 and work.chunked_prefills >= 3 and work.reprefill_cached_tokens == 0
    assert work.problems == [] and work.notes == [] and work.layout["max_num_batched_tokens"] == 32
    salts = [prompt["cache_salt"] for prompt in front.calls[-1]]
    assert len(set(salts)) == len(salts) == work.requests  # a salt of its own for each re-prefill
    result = consistency.analyse(collected.pairs(), "float32")
    assert result.verdict == consistency.PASS and result.exact == result.rows > 0, result.summary()
    assert [pair.prompt_tokens for pair in collected.pairs()] == [len(o.prompt_token_ids) for o in collected.generation]


def test_the_reprefill_is_an_independent_pass_that_catches_a_capture_fault() -> None:
    """One generation request's prompt row 5 holds row 4's routing (a capture fault, stored with its KV block).
    The re-prefill, salted, computes every row afresh: the oracle names that request and token, and nothing came
    from the cache. Were the salt dropped, the re-prefill would be served the generation's own faulty block from
    the prefix cache and agree with it: this test fails (reprefill.collect's cache_salt, a unit test's business)."""
    target = reprefill.plan(SMALL, VOCAB, 6).first[1]  # a prompt of its own (no shared prefix), > one block

    def late_row_5(rows: np.ndarray, tokens: list[int]) -> np.ndarray | None:
        if tokens != target:
            return None
        rows = rows.copy()
        rows[5] = rows[4]
        return rows

    front = StandInFrontEnd(capture_fault=late_row_5)
    collected = collect(front)
    assert front.faulted == 1  # the generation's request only: the re-prefill's prompt is longer
    assert collected.work.reprefill_cached_tokens == 0 and collected.work.problems == []
    result = consistency.analyse(collected.pairs(), "float32")
    assert result.verdict == consistency.TOKEN_FAULT, result.summary()
    (fault,) = result.token_faults
    assert (fault.request, fault.row, fault.kind) == ("1", 5, "late"), fault.describe()


def test_a_reprefill_served_from_the_prefix_cache_is_a_finding() -> None:
    """A front end that serves the salted re-prefill from its cache anyway (vLLM ignoring the salt) is reported:
    those rows would compare the generation with itself."""
    front = StandInFrontEnd()
    generate = front.generate

    def unsalted(prompts: list[dict[str, Any]], sampling: list[Any]) -> list[Any]:
        return generate([{k: v for k, v in p.items() if k != "cache_salt"} for p in prompts], sampling)

    work = reprefill.collect(unsalted, params, SMALL, VOCAB, 6, rows).work
    assert work.reprefill_cached_tokens > 0
    assert any("served" in problem and "not an independent pass" in problem for problem in work.problems)


def test_no_prefix_cache_hit_fails_saying_so() -> None:
    work = collect(StandInFrontEnd(prefix_cache=False)).work
    (problem,) = work.problems
    assert problem.startswith("prefix-cache hits not exercised") and "blocks of 16" in problem


def test_prefix_caching_off_in_the_engine_is_a_note_not_a_failure() -> None:
    layout = Layout(32, 6, 16, 256, prefix_caching=False)
    work = collect(StandInFrontEnd(prefix_cache=False), layout).work
    assert work.problems == [] and any("prefix caching is off" in note for note in work.notes)


def test_a_long_prompt_served_from_the_prefix_cache_is_no_chunked_prefill() -> None:
    """The same workload again on an engine whose prefix cache holds it: every prompt is longer than its cached part
    by less than the step budget, so nothing prefilled in chunks, whatever the prompts' lengths, and the pre-flight
    says so."""
    front = StandInFrontEnd()
    assert collect(front).work.chunked_prefills > 0
    work = collect(front).work  # the same prompts (the same seed), their full blocks cached now
    assert work.longest_prompt > SMALL.max_num_batched_tokens and work.cached_tokens > 0
    assert work.chunked_prefills == 0
    assert [p for p in work.problems if p.startswith("chunked prefill not exercised")], work.problems


def test_no_chunked_prefill_fails_saying_what_to_do() -> None:
    """A step budget the context cannot exceed (the user's 8192 with doctor's max_model_len 1024): no prompt
    prefills in chunks, and the pre-flight says to give a longer --max-model-len."""
    layout = Layout(max_num_batched_tokens=1024, max_num_seqs=6, block_size=16, max_model_len=512)
    work = collect(StandInFrontEnd(), layout).work
    (problem,) = work.problems
    assert problem.startswith("chunked prefill not exercised") and "--max-model-len above 1031" in problem
    off = Layout(1024, 6, 16, 512, chunked_prefill=False)
    assert collect(StandInFrontEnd(), off).work.problems == []
