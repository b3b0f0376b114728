# SPDX-License-Identifier: Apache-2.0
"""Load and soak: ``vllm serve`` with the plugin under concurrency, preemption, prefix hits and aborts.

    python -m tests.harness.stress --requests 300 --concurrency 64
    python -m tests.harness.stress --requests 2000 --concurrency 16 --abort-every 0   # soak

One OpenAI server on loopback, a KV cache small enough to force preemption, ``max_num_batched_tokens``
below the longest prompts (chunked prefill), a third of the prompts sharing one of three long prefixes
(prefix-cache hits), and every ``--abort-every``-th request streamed and disconnected after its first
chunk (an abort). Every completed request's routing must equal the reference computed for that request
alone. Bounded in request count and in time. Resident memory of the server's process tree is measured
after warm-up and at the end. Prints ``STRESS_RESULT {json}``.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import random
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tests.harness.server import Server
from vllm_ascend_routing.preflight import models, offline

MAX_BATCHED_TOKENS = 128
KV_CACHE_BYTES = 2 * 1024 * 1024  # ~1,360 tokens of the tiny model (10 CPU blocks): long decodes preempt
MAX_MODEL_LEN = 512
PREFIX_LEN = 256  # whole KV blocks (128 tokens on the CPU backend), so repeats hit the prefix cache


@dataclass
class Outcome:
    prompt: list[int]
    output: list[int] | None = None  # None: aborted by the client, or failed
    routed: np.ndarray | None = None
    error: str | None = None


def workload(count: int, seed: int, abort_every: int) -> list[tuple[list[int], int, bool]]:
    """``(prompt, max_tokens, abort)`` per request: mixed lengths, shared prefixes, long prompts."""
    rng = random.Random(seed)
    prefixes = [models.mixed_prompts(1, seed=seed + k, min_len=PREFIX_LEN, max_len=PREFIX_LEN)[0] for k in range(3)]
    requests = []
    for i in range(count):
        length = rng.choice([rng.randint(3, 40), rng.randint(40, 120), rng.randint(200, 400)])
        prompt = models.mixed_prompts(1, seed=seed * 100003 + i, min_len=length, max_len=length)[0]
        if i % 3 == 0:  # a shared prefix and a short tail of its own
            prompt = prefixes[(i // 3) % len(prefixes)] + prompt[: rng.randint(3, 150)]
        max_tokens = 150 if i % 5 == 4 else rng.randint(4, 24)  # long decodes cross KV blocks under pressure
        max_tokens = min(max_tokens, MAX_MODEL_LEN - len(prompt))
        requests.append((prompt, max_tokens, abort_every > 0 and i % abort_every == abort_every - 1))
    return requests


def _complete(url: str, model: str, prompt: list[int], max_tokens: int) -> Outcome:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    request = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            choice = json.loads(response.read())["choices"][0]
    except OSError as exc:
        return Outcome(prompt, error=repr(exc))
    encoded = choice.get("routed_experts")
    routed = None if encoded is None else np.load(io.BytesIO(base64.b64decode(encoded)))
    return Outcome(prompt, list(choice["token_ids"]), routed)


def _abort(url: str, model: str, prompt: list[int], max_tokens: int) -> Outcome:
    """Stream, read the first chunk, hang up: the server aborts the request mid-generation."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens + 200,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    request = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            response.readline()
    except OSError as exc:
        return Outcome(prompt, error=repr(exc))
    return Outcome(prompt)


def run(
    requests: int,
    concurrency: int,
    abort_every: int,
    seed: int,
    deadline_s: float,
    mode: str,
    max_rss_growth_mib: float,
) -> dict[str, Any]:
    model = models.build_tiny_moe("qwen3_moe", Path(offline_model_dir()) / "qwen3_moe")
    work = workload(requests, seed, abort_every)
    args = [
        "--kv-cache-memory-bytes",
        str(KV_CACHE_BYTES),
        "--max-num-batched-tokens",
        str(MAX_BATCHED_TOKENS),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--enable-prefix-caching",
    ]
    if mode == "eager":
        args.append("--enforce-eager")
    with Server(model.path, args) as server:
        _complete(server.url, str(model.path), work[0][0], 2)  # warm-up
        rss_start = server.rss_bytes()
        started = time.monotonic()
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            futures = [
                pool.submit(_abort if abort else _complete, server.url, str(model.path), prompt, max_tokens)
                for prompt, max_tokens, abort in work
            ]
            outcomes = [f.result(timeout=max(deadline_s - (time.monotonic() - started), 1.0)) for f in futures]
        elapsed = time.monotonic() - started
        metrics = server.metrics()
        rss_end = server.rss_bytes()
    aborted = sum(1 for (_, _, abort) in work if abort)
    done = [o for o, (_, _, abort) in zip(outcomes, work, strict=True) if not abort and o.output is not None]
    failed = [o.error for o, (_, _, abort) in zip(outcomes, work, strict=True) if not abort and o.error]
    completions = [offline.Completion(o.prompt, o.output or [], o.routed) for o in done]
    match = offline.check(offline.reference_for(model), model, completions)
    growth = (rss_end - rss_start) / 2**20
    return {
        "requests": requests,
        "concurrency": concurrency,
        "completed": len(done),
        "aborted": aborted,
        "failed": len(failed),
        "failures": failed[:3],
        "rows": match.rows,
        "matched": match.matched,
        "near_ties": match.ties,
        "mismatched_rows": match.rows - match.matched,
        "ok": match.ok and not failed and len(done) > 0 and growth <= max_rss_growth_mib,
        "problems": match.problems[:5],
        "seconds": round(elapsed, 1),
        "preemptions": metrics.get("vllm:num_preemptions_total", 0.0),
        "prefix_cache_hits": metrics.get("vllm:prefix_cache_hits_total", 0.0),
        "rss_start_mib": round(rss_start / 2**20, 1),
        "rss_end_mib": round(rss_end / 2**20, 1),
        "rss_growth_mib": round(growth, 1),
        "max_rss_growth_mib": max_rss_growth_mib,
    }


def offline_model_dir() -> str:
    from vllm_ascend_routing import envs

    return envs.VLLM_ASCEND_ROUTING_MODELS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--abort-every", type=int, default=10, help="every Nth request is aborted (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deadline", type=float, default=1200.0, help="seconds for the whole request loop")
    parser.add_argument("--mode", default="eager", choices=["eager", "compiled"])
    parser.add_argument(
        "--max-rss-growth-mib",
        type=float,
        default=256.0,
        help="resident memory the server tree may gain between warm-up and the end",
    )
    args = parser.parse_args()
    result = run(
        args.requests, args.concurrency, args.abort_every, args.seed, args.deadline, args.mode, args.max_rss_growth_mib
    )
    print("STRESS_RESULT " + json.dumps(result), flush=True)
    raise SystemExit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
