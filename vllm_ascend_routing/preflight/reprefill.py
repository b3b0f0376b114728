# SPDX-License-Identifier: Apache-2.0
"""The re-prefill consistency oracle's run: a generation that exercises the mapping, then each finished sequence
submitted again as a prompt, both through the engine's front end only; ``consistency.analyse`` compares them.

Only what every front end returns is used (``RequestOutput``: prompt and output token ids, ``routed_experts``,
``num_cached_tokens``), never a hook in the engine's process: the engine may run in other processes (TP, DP,
Ray), as on the user's cluster.

The generation (``plan``) scales to the engine's layout as vLLM resolved it (``Layout``: the user's flags, the
platform's defaults): a full batch (``max_num_seqs`` + 2 concurrent requests, so some wait, from 8 up to
``REQUEST_CAP``) of mixed prompt lengths, one a token past the step budget (``max_num_batched_tokens``) and one of
2.5 budgets (chunked prefills at the user's chunk size), and mixed output lengths (requests finish at different
steps, the batch changes); every other request shares a prompt prefix of two KV blocks and more (at the engine's block
size), and a second wave with that prefix comes after the first finished (prefix-cache hits), one of them with
a remainder longer than the budget (a cached prefix, then chunks). Token ids are drawn from the model's vocabulary
with a fixed seed: no tokenizer is needed and lengths are exact.

What it exercised is read from what vLLM reports (``coverage``): prompt tokens served from the prefix cache
(``RequestOutput.num_cached_tokens``) and chunked prefills (a prompt whose uncached part is longer than the
step budget). Where the engine could do either and the workload did not, that is a finding (``Workload.problems``:
the pre-flight fails saying which); where the engine cannot (prefix caching or chunked prefill off), a note.

The re-prefill: ``prompt + output[:-1]`` of each finished request, one token out, each with a ``cache_salt`` of
its own (vLLM 0.20+) so no row is served from the prefix cache (``num_cached_tokens`` must be 0, else it is a
finding), all in one batch of another composition than the generation's.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from vllm_ascend_routing.preflight import consistency

SHORT_PROMPTS = (5, 23, 67, 9, 40, 17, 31, 12)  # prompt tokens of the first wave's other requests
OUTPUT_SHARES = (1.0, 0.5, 1.0, 0.25, 0.75, 1.0, 0.0, 0.5)  # of max_tokens (at least 1): finishing at different steps
# Chunked prefills at the user's step budget B: request 1's prompt is B + 1 tokens (a chunk boundary at its last
# token), request 5's 2.5 B (three chunks); odd requests do not share the prefix, so all of it is computed.
CHUNKED = {1: lambda budget: budget + 1, 5: lambda budget: budget * 5 // 2}
MIN_REQUESTS = 8
REQUEST_CAP = 512  # the most first-wave requests: max_num_seqs + 2 up to this
PREFIX_BLOCKS = 2  # the shared prefix: this many full KV blocks, and part of one more
DEFAULT_BLOCK_SIZE = 16
LOW_TOKEN_ID = 100  # below it: special tokens in most vocabularies

Generate = Callable[[list[dict[str, Any]], list[Any]], Sequence[Any]]
# A request's rows from its ``RequestOutput``, from token 0 on the decoder-layer axis (``contract.request_rows``:
# vLLM 0.21.0 returns the prompt's and the generated tokens' rows apart).
Rows = Callable[[Any], Any]


@dataclass(frozen=True)
class Layout:
    """The engine's limits the workload scales to, as vLLM resolved them (``of``)."""

    max_num_batched_tokens: int  # the step budget: a longer prompt prefills in chunks
    max_num_seqs: int  # requests at once
    block_size: int  # KV block: prefix-cache hits come in whole blocks
    max_model_len: int
    prefix_caching: bool = True
    chunked_prefill: bool = True

    @classmethod
    def of(cls, vllm_config: Any) -> Layout:
        """From vLLM's ``VllmConfig`` (scheduler, cache and model configs)."""
        scheduler, cache = vllm_config.scheduler_config, vllm_config.cache_config
        return cls(
            max_num_batched_tokens=int(scheduler.max_num_batched_tokens),
            max_num_seqs=int(scheduler.max_num_seqs),
            block_size=int(getattr(cache, "block_size", None) or DEFAULT_BLOCK_SIZE),
            max_model_len=int(vllm_config.model_config.max_model_len),
            prefix_caching=bool(getattr(cache, "enable_prefix_caching", True)),
            chunked_prefill=bool(getattr(scheduler, "enable_chunked_prefill", True)),
        )


@dataclass
class Workload:
    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cached_tokens: int = 0  # generation prompt tokens served from the prefix cache (hits the oracle exercised)
    longest_prompt: int = 0
    chunked_prefills: int = 0  # generation prompts whose uncached part was longer than the step budget
    concurrent: int = 0  # first-wave requests submitted at once (a full batch: more than max_num_seqs)
    reprefill_cached_tokens: int = 0  # must be 0: rows served from the cache would not be an independent pass
    layout: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # findings: the pre-flight fails on each
    notes: list[str] = field(default_factory=list)  # what the engine's layout cannot exercise


@dataclass(frozen=True)
class Plan:
    """The generation's two waves: prompts (token ids) and output lengths."""

    first: list[list[int]]
    first_outputs: list[int]
    second: list[list[int]]
    shared_prefix: int


def token_range(vocab_size: int) -> tuple[int, int]:
    """Token ids drawn from ``[low, high)``: above most special tokens, within the vocabulary."""
    high = min(vocab_size, 32000)
    return (LOW_TOKEN_ID if high > 2 * LOW_TOKEN_ID else 1), high


def num_requests_for(layout: Layout) -> int:
    """First-wave requests: a full batch and two waiting (``max_num_seqs`` + 2), at least 8, at most REQUEST_CAP."""
    return max(MIN_REQUESTS, min(layout.max_num_seqs + 2, REQUEST_CAP))


def prompt_limit(layout: Layout, max_tokens: int) -> int:
    """The longest prompt that leaves room for ``max_tokens`` in the context."""
    return max(2, layout.max_model_len - max_tokens - 1)


def plan(layout: Layout, vocab_size: int, max_tokens: int, num_requests: int | None = None, seed: int = 0) -> Plan:
    """The workload for ``layout`` (``num_requests`` first-wave requests, else ``num_requests_for``)."""
    count = max(2, num_requests if num_requests is not None else num_requests_for(layout))
    rng = np.random.default_rng(seed)
    low, high = token_range(vocab_size)
    limit = prompt_limit(layout, max_tokens)
    budget = layout.max_num_batched_tokens
    prefix_len = min(PREFIX_BLOCKS * layout.block_size + 16, limit // 2)
    prefix = rng.integers(low, high, prefix_len).tolist()
    first = []
    for i in range(count):
        length = CHUNKED[i](budget) if i in CHUNKED else SHORT_PROMPTS[i % len(SHORT_PROMPTS)]
        body = rng.integers(low, high, min(length, limit)).tolist()
        first.append((prefix + body)[:limit] if i % 2 == 0 else body)  # half of them share the prefix
    outputs = [max(1, round(OUTPUT_SHARES[i % len(OUTPUT_SHARES)] * max_tokens)) for i in range(count)]
    # The second wave: the shared prefix again, after the first wave finished and cached it; in pairs of one
    # length (a swap would keep each's row count); the first pair's remainder longer than the step budget.
    rng = np.random.default_rng(seed + 1)
    second = [
        (prefix + rng.integers(low, high, budget + 3 if i < 2 else 11 + 7 * (i // 2)).tolist())[:limit]
        for i in range(max(2, count // 2))
    ]
    return Plan(first, outputs, second, prefix_len)


@dataclass
class Collected:
    """Both passes' outputs (``RequestOutput``s, in the same order) and what the workload exercised."""

    generation: list[Any]
    reprefill: list[Any]
    work: Workload
    rows: Rows

    def pairs(self) -> list[consistency.Pair]:
        return [
            consistency.Pair(str(i), self.rows(g), self.rows(r), len(g.prompt_token_ids), list(r.prompt_token_ids))
            for i, (g, r) in enumerate(zip(self.generation, self.reprefill, strict=True))
        ]


def run(
    generate: Generate,
    sampling_params: Callable[[int], Any],
    layout: Layout,
    vocab_size: int,
    max_tokens: int,
    dtype: str,
    rows: Rows,
    num_requests: int | None = None,
    seed: int = 0,
) -> tuple[consistency.Result, Workload]:
    """Generate, re-prefill (``collect``), analyse."""
    collected = collect(generate, sampling_params, layout, vocab_size, max_tokens, rows, num_requests, seed)
    return consistency.analyse(collected.pairs(), dtype), collected.work


def collect(
    generate: Generate,
    sampling_params: Callable[[int], Any],
    layout: Layout,
    vocab_size: int,
    max_tokens: int,
    rows: Rows,
    num_requests: int | None = None,
    seed: int = 0,
) -> Collected:
    """``generate(prompts, params)`` is the front end's (``LLM.generate``); ``sampling_params(n)`` makes greedy
    params for ``n`` tokens; ``rows(output)`` reads a request's rows (``contract.request_rows``); ``layout``: the
    engine's (``Layout.of``); ``num_requests``: first-wave requests, else a full batch (``num_requests_for``);
    ``seed``: the prompts' token ids."""
    work_plan = plan(layout, vocab_size, max_tokens, num_requests, seed)
    outputs = list(
        generate(
            [{"prompt_token_ids": p} for p in work_plan.first], [sampling_params(n) for n in work_plan.first_outputs]
        )
    )
    second = work_plan.second
    outputs += list(generate([{"prompt_token_ids": p} for p in second], [sampling_params(max_tokens)] * len(second)))
    work = Workload(requests=len(outputs), concurrent=len(work_plan.first), layout=asdict(layout))
    sequences = []
    for output in outputs:
        completion = output.outputs[0]
        prompt, tokens = list(output.prompt_token_ids), list(completion.token_ids)
        cached = int(getattr(output, "num_cached_tokens", 0) or 0)
        work.prompt_tokens += len(prompt)
        work.generated_tokens += len(tokens)
        work.cached_tokens += cached
        work.longest_prompt = max(work.longest_prompt, len(prompt))
        work.chunked_prefills += int(len(prompt) - cached > layout.max_num_batched_tokens)
        sequences.append(prompt + tokens[:-1])  # the last sampled token was never forwarded
    salt = secrets.token_hex(8)  # never a salt an earlier run cached under
    again = [{"prompt_token_ids": s, "cache_salt": f"reprefill-{salt}-{i}"} for i, s in enumerate(sequences)]
    redone = list(generate(again, [sampling_params(1)] * len(again)))
    work.reprefill_cached_tokens = sum(int(getattr(r, "num_cached_tokens", 0) or 0) for r in redone)
    if work.reprefill_cached_tokens:
        work.problems.append(
            f"the re-prefill was served {work.reprefill_cached_tokens} tokens from the prefix cache despite its "
            "cache salt: its rows are not an independent pass"
        )
    coverage(work, layout, max_tokens, work_plan.shared_prefix)
    return Collected(outputs, redone, work, rows)


def coverage(work: Workload, layout: Layout, max_tokens: int, shared_prefix: int) -> None:
    """Findings (``work.problems``) where the engine could chunk a prefill or hit the prefix cache and the
    workload did not; notes where the engine's layout cannot."""
    budget = layout.max_num_batched_tokens
    if not layout.chunked_prefill:
        work.notes.append("chunked prefill is off in this engine: no prompt prefilled in chunks (not exercised)")
    elif not work.chunked_prefills:
        limit = prompt_limit(layout, max_tokens)
        why = (
            f"max_model_len {layout.max_model_len} leaves room for prompts of {limit} tokens at most: give doctor "
            f"a --max-model-len above {budget + max_tokens + 1}"
            if limit <= budget
            else f"the longest prompt had {work.longest_prompt} tokens"
        )
        work.problems.append(
            f"chunked prefill not exercised: no prompt's uncached part was longer than the step budget "
            f"(max_num_batched_tokens {budget}); {why}"
        )
    if not layout.prefix_caching:
        work.notes.append("prefix caching is off in this engine: no row served from the cache (not exercised)")
    elif not work.cached_tokens:
        work.problems.append(
            f"prefix-cache hits not exercised: vLLM reported no prompt token served from the prefix cache "
            f"(num_cached_tokens 0 for all {work.requests} requests; a shared prefix of {shared_prefix} tokens, "
            f"blocks of {layout.block_size})"
        )
