# SPDX-License-Identifier: Apache-2.0
"""The re-prefill consistency oracle's run: a generation that exercises the mapping, then each finished sequence
submitted again as a prompt, both through the engine's front end only; ``consistency.analyse`` compares them.

Only what every front end returns is used (``RequestOutput``: prompt and output token ids, ``routed_experts``,
``num_cached_tokens``), never a hook in the engine's process: the engine may run in other processes (TP, DP,
Ray), as on the user's cluster.

The generation (``workload``): concurrent requests of mixed prompt lengths (several longer than one step's
token budget: chunked prefills) and mixed output lengths (requests finish at different steps, the batch
changes); half of them share a long prompt prefix, and a second wave of requests with that prefix comes after
the first finished (prefix-cache hits, counted). Token ids are drawn from the model's vocabulary with a fixed
seed: no tokenizer is needed and lengths are exact.

The re-prefill: ``prompt + output[:-1]`` of each finished request, one token out, each with a ``cache_salt`` of
its own (vLLM 0.20+) so no row is served from the prefix cache (``num_cached_tokens`` must be 0, else it is a
finding), all in one batch of another composition than the generation's.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vllm_ascend_routing.preflight import consistency

# (prompt tokens, output tokens) of the first wave, scaled to the model's context: short and long prompts, one-token
# and long outputs.
SHAPES = ((5, 1.0), (131, 0.5), (23, 1.0), (67, 0.25), (9, 0.75), (200, 1.0), (40, 0.0), (17, 0.5))
SHARED_PREFIX = 272  # tokens: at least two full KV blocks of 128 (the CPU build's and Ascend's block size)
LOW_TOKEN_ID = 100  # below it: special tokens in most vocabularies

Generate = Callable[[list[dict[str, Any]], list[Any]], Sequence[Any]]
# A request's rows from its ``RequestOutput``, from token 0 on the decoder-layer axis (``contract.request_rows``:
# vLLM 0.21.0 returns the prompt's and the generated tokens' rows apart).
Rows = Callable[[Any], Any]


@dataclass
class Workload:
    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    cached_tokens: int = 0  # generation prompt tokens served from the prefix cache (hits the oracle exercised)
    longest_prompt: int = 0
    reprefill_cached_tokens: int = 0  # must be 0: rows served from the cache would not be an independent pass
    problems: list[str] = field(default_factory=list)


def token_range(vocab_size: int) -> tuple[int, int]:
    """Token ids drawn from ``[low, high)``: above most special tokens, within the vocabulary."""
    high = min(vocab_size, 32000)
    return (LOW_TOKEN_ID if high > 2 * LOW_TOKEN_ID else 1), high


def prompts(num_requests: int, vocab_size: int, max_model_len: int, max_tokens: int, seed: int = 0) -> list[list[int]]:
    """The first wave's prompts (token ids); the first half starts with the shared prefix."""
    rng = np.random.default_rng(seed)
    low, high = token_range(vocab_size)
    prefix = rng.integers(low, high, SHARED_PREFIX).tolist()
    limit = max(2, max_model_len - max_tokens - 1)
    out = []
    for i in range(num_requests):
        length = min(SHAPES[i % len(SHAPES)][0], limit)
        body = rng.integers(low, high, length).tolist()
        out.append((prefix + body)[:limit] if i < (num_requests + 1) // 2 else body)
    return out


def output_lengths(num_requests: int, max_tokens: int) -> list[int]:
    return [max(1, round(SHAPES[i % len(SHAPES)][1] * max_tokens)) for i in range(num_requests)]


@dataclass
class Collected:
    """Both passes' outputs (``RequestOutput``s, in the same order) and what the workload exercised."""

    generation: list[Any]
    reprefill: list[Any]
    work: Workload
    rows: Rows

    def pairs(self) -> list[consistency.Pair]:
        return [
            consistency.Pair(str(i), self.rows(g), self.rows(r))
            for i, (g, r) in enumerate(zip(self.generation, self.reprefill, strict=True))
        ]


def run(
    generate: Generate,
    sampling_params: Callable[[int], Any],
    num_requests: int,
    vocab_size: int,
    max_model_len: int,
    max_tokens: int,
    dtype: str,
    rows: Rows,
) -> tuple[consistency.Result, Workload]:
    """Generate, re-prefill (``collect``), analyse."""
    collected = collect(generate, sampling_params, num_requests, vocab_size, max_model_len, max_tokens, rows)
    return consistency.analyse(collected.pairs(), dtype), collected.work


def collect(
    generate: Generate,
    sampling_params: Callable[[int], Any],
    num_requests: int,
    vocab_size: int,
    max_model_len: int,
    max_tokens: int,
    rows: Rows,
) -> Collected:
    """``generate(prompts, params)`` is the front end's (``LLM.generate``); ``sampling_params(n)`` makes greedy
    params for ``n`` tokens; ``rows(output)`` reads a request's rows (``contract.request_rows``)."""
    num_requests = max(2, num_requests)
    first = prompts(num_requests, vocab_size, max_model_len, max_tokens)
    lengths = output_lengths(num_requests, max_tokens)
    outputs = list(generate([{"prompt_token_ids": p} for p in first], [sampling_params(n) for n in lengths]))
    # The second wave: the shared prefix again, after the first wave finished and cached it.
    rng = np.random.default_rng(1)
    low, high = token_range(vocab_size)
    limit = max(2, max_model_len - max_tokens - 1)
    second = [
        (first[0][:SHARED_PREFIX] + rng.integers(low, high, 11 + 7 * (i // 2)).tolist())[:limit]
        for i in range(max(2, num_requests // 2))  # in pairs of one length (a swap would keep each's row count)
    ]
    outputs += list(generate([{"prompt_token_ids": p} for p in second], [sampling_params(max_tokens)] * len(second)))
    work = Workload(requests=len(outputs))
    sequences = []
    for output in outputs:
        completion = output.outputs[0]
        prompt, tokens = list(output.prompt_token_ids), list(completion.token_ids)
        work.prompt_tokens += len(prompt)
        work.generated_tokens += len(tokens)
        work.cached_tokens += int(getattr(output, "num_cached_tokens", 0) or 0)
        work.longest_prompt = max(work.longest_prompt, len(prompt))
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
    return Collected(outputs, redone, work, rows)
