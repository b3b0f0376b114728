# SPDX-License-Identifier: Apache-2.0
"""Data-parallel serving end to end: ``vllm serve --data-parallel-size 2`` on loopback, one core per engine.

``server``: one ``vllm serve`` with both DP engines, and a row store (``VLLM_ASCEND_ROUTING_STORE=shm``): every other
request asks for its rows inline, the others' are fetched by key, so one batch holds both engines' keys.
``headless``: the multi-node form on one machine, a
``vllm serve --data-parallel-size-local 1`` (rank 0, API server) and a second ``--headless`` process
(``--data-parallel-start-rank 1``). ``offline``: one ``LLM`` per DP rank in its own process (vLLM's
``VLLM_DP_*`` variables), each with its own share of the requests: the only DP form on vLLM 0.20.x, whose
OpenAI API has no ``routed_experts``. Requests of very different lengths (chunked prefills, one-token decodes)
go in concurrently, so the ranks' token counts differ step by step and a rank runs dummy batches while the
other works; every completed request is compared with the transformers reference, exactly.

vLLM's CPU build cannot run an MoE under DP by itself (its CPU communicator lacks ``all_gatherv`` /
``reduce_scatterv``, vllm #57837): the engine processes get the TEST-ONLY stand-in in ``dp_standin/``.
"""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from tests.harness import pythonpath
from tests.harness.server import Server, free_port, post
from vllm_ascend_routing import replay
from vllm_ascend_routing.preflight import models, offline

STANDIN = Path(__file__).with_name("dp_standin")
MAX_BATCHED_TOKENS = 128
# (prompt length, max tokens): chunked prefills beside one-token requests and long decodes.
REQUESTS = [
    (300, 6),
    (3, 24),
    (57, 1),
    (12, 17),
    (190, 3),
    (5, 9),
    (96, 12),
    (33, 2),
    (140, 20),
    (8, 1),
    (71, 5),
    (4, 30),
    (260, 8),
    (21, 11),
    (46, 4),
    (9, 16),
]


def engine_env(events: str, cores: list[int]) -> dict[str, str]:
    """The engine processes' environment: the stand-in on ``PYTHONPATH``, one core per local DP engine.

    Explicit cores (``"0|1"``: vLLM hands local DP rank ``i`` the ``i``-th entry) because vLLM's automatic
    NUMA binding fails on some VMs (0.23: "Not enough allowed NUMA nodes") and ``nobind`` crashes 0.20.2.
    """
    env = dict(os.environ)
    pythonpath(env, STANDIN)  # the stand-in imports tests.harness: the checkout root follows it
    env["ROUTING_TEST_DP_EVENTS"] = events
    env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(map(str, cores))
    return env


def run_data_parallel(arch: str, layout: str, mode: str, expert_parallel: bool = False) -> dict[str, Any]:
    if layout == "offline":
        return run_offline_data_parallel(arch)
    model = models.build_tiny_moe(arch, models_dir() / arch)
    events = tempfile.mkstemp(prefix="dp_events_", suffix=".log")[1]
    cores = sorted(os.sched_getaffinity(0))
    cores = [cores[0], cores[-1]]  # the same core twice on a one-core machine
    env = engine_env(events, cores if layout == "server" else cores[:1])
    if layout == "server":  # the engines publish, this process fetches
        env["VLLM_ASCEND_ROUTING_STORE"] = os.environ["VLLM_ASCEND_ROUTING_STORE"] = "shm"
    port = free_port()
    common = [
        "--kv-cache-memory-bytes",
        str(offline.KV_CACHE_BYTES),
        "--max-model-len",
        "1024",
        "--max-num-batched-tokens",
        str(MAX_BATCHED_TOKENS),
        "--data-parallel-size",
        "2",
    ]
    if mode == "eager":
        common.append("--enforce-eager")
    if expert_parallel:
        common.append("--enable-expert-parallel")
    headless: subprocess.Popen[bytes] | None = None
    if layout == "headless":
        common += [
            "--data-parallel-size-local",
            "1",
            "--data-parallel-address",
            "127.0.0.1",
            "--data-parallel-rpc-port",
            str(port),
        ]
        log = tempfile.mkstemp(prefix="vllm_headless_", suffix=".log")[1]
        with open(log, "w") as out:
            headless = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tests.harness.vllm_cli",
                    "serve",
                    str(model.path),
                    "--headless",
                    "--data-parallel-start-rank",
                    "1",
                    "--dtype",
                    "float32",
                    "--enable-return-routed-experts",
                    "--seed",
                    "0",
                    *common,
                ],
                env=engine_env(events, cores[1:]),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
    keys: list[str] = []
    try:
        with Server(model.path, common, env=env) as server:
            prompts = [
                models.mixed_prompts(1, seed=40 + i, min_len=n, max_len=n)[0] for i, (n, _) in enumerate(REQUESTS)
            ]

            def complete(i: int) -> offline.Completion:
                reply = post(
                    f"{server.url}/v1/completions",
                    {
                        "model": str(model.path),
                        "prompt": prompts[i],
                        "max_tokens": REQUESTS[i][1],
                        "temperature": 0,
                        "ignore_eos": True,
                        "return_token_ids": True,
                        **({"vllm_xargs": {"routed_experts_transport": "inline"}} if i % 2 == 0 else {}),
                    },
                    # each request to the rank rank_requests gives it: vLLM's balancer alternates ranks in the order
                    # requests arrive, which would put every keyed (odd) request on one rank
                    {"X-data-parallel-rank": str(rank_of(i))},
                )
                choice = reply["choices"][0]
                encoded = choice.get("routed_experts")
                array = None if encoded is None else np.load(io.BytesIO(base64.b64decode(encoded)))
                key = (choice.get("routed_experts_info") or {}).get("store_key")
                if key is not None:
                    keys.append(key)
                    array = replay.fetch(key)
                return offline.Completion(prompts[i], list(choice["token_ids"]), array)

            with ThreadPoolExecutor(len(REQUESTS)) as pool:
                completions = list(pool.map(complete, range(len(REQUESTS))))
            result = offline.check(offline.reference_for(model), model, completions)
    finally:
        if headless is not None:
            headless.terminate()
            try:
                headless.wait(timeout=60)
            except subprocess.TimeoutExpired:
                headless.kill()
    counted = Counter(tuple(line.split()) for line in Path(events).read_text().splitlines())
    return {
        "arch": arch,
        "layout": layout,
        "mode": mode,
        "expert_parallel": expert_parallel,
        "rows": result.rows,
        "matched": result.matched,
        "near_ties": result.ties,
        "ok": result.ok,
        "problems": result.problems[:5],
        "requests": len(completions),
        "keys_per_rank": {rank: sum(f".dp{rank}." in key for key in keys) for rank in ("0", "1")} if keys else {},
        "requests_per_rank": {rank: counted[(rank, "request")] for rank in ("0", "1")},
        "dummy_batches_per_rank": {rank: counted[(rank, "dummy")] for rank in ("0", "1")},
    }


def models_dir() -> Path:
    from vllm_ascend_routing import envs

    return Path(envs.VLLM_ASCEND_ROUTING_MODELS)


def rank_of(request: int) -> int:
    """The DP rank of 2 that serves request index ``request`` (``rank_requests``)."""
    return 0 if request in rank_requests(0) else 1


def rank_requests(rank: int) -> list[int]:
    """Request indices DP rank ``rank`` of 2 serves (offline: its own ``LLM``; served: asked for by vLLM's
    ``X-data-parallel-rank`` header): uneven shares (10 and 6, long prompts on rank 0)."""
    return [i for i in range(len(REQUESTS)) if (i % 3 != 0) == (rank == 0)]


def run_offline_data_parallel(arch: str) -> dict[str, Any]:
    """Two processes, one ``LLM`` each as DP ranks 0 and 1; each checks its own rows and reports them."""
    models.build_tiny_moe(arch, models_dir() / arch)  # built once, before two processes race to build it
    events = tempfile.mkstemp(prefix="dp_events_", suffix=".log")[1]
    cores = sorted(os.sched_getaffinity(0))
    port = free_port()
    ranks = []
    for rank in (0, 1):
        env = engine_env(events, [cores[rank % len(cores)]])
        env.update(
            VLLM_DP_RANK=str(rank),
            VLLM_DP_RANK_LOCAL="0",
            VLLM_DP_SIZE="2",
            VLLM_DP_MASTER_IP="127.0.0.1",
            VLLM_DP_MASTER_PORT=str(port),
        )
        ranks.append(
            subprocess.Popen(
                [sys.executable, "-m", "tests.harness.data_parallel", arch, str(rank)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
    verdicts = []
    for rank, proc in enumerate(ranks):
        output, _ = proc.communicate(timeout=900)
        lines = [line for line in output.splitlines() if line.startswith("RANK_RESULT ")]
        if proc.returncode != 0 or not lines:
            raise RuntimeError(f"DP rank {rank} exited {proc.returncode}:\n{output[-4000:]}")
        verdicts.append(json.loads(lines[-1].removeprefix("RANK_RESULT ")))
    counted = Counter(tuple(line.split()) for line in Path(events).read_text().splitlines())
    return {
        "arch": arch,
        "layout": "offline",
        "mode": "eager",
        "expert_parallel": False,
        "rows": sum(v["rows"] for v in verdicts),
        "matched": sum(v["matched"] for v in verdicts),
        "near_ties": sum(v["near_ties"] for v in verdicts),
        "ok": all(v["ok"] for v in verdicts),
        "problems": [p for v in verdicts for p in v["problems"]][:5],
        "requests": sum(v["requests"] for v in verdicts),
        "requests_per_rank": {str(rank): v["requests"] for rank, v in enumerate(verdicts)},
        "dummy_batches_per_rank": {rank: counted[(rank, "dummy")] for rank in ("0", "1")},
    }


def offline_rank(arch: str, rank: int) -> dict[str, Any]:
    """One DP rank's ``LLM`` (its ``VLLM_DP_*`` set by the parent): its share of the requests, checked."""
    model = models.build_tiny_moe(arch, models_dir() / arch)
    llm = offline.make_llm(model, enforce_eager=True, max_num_batched_tokens=MAX_BATCHED_TOKENS)
    mine = rank_requests(rank)
    prompts = [models.mixed_prompts(1, seed=40 + i, min_len=REQUESTS[i][0], max_len=REQUESTS[i][0])[0] for i in mine]
    completions = offline.generate(llm, prompts, [REQUESTS[i][1] for i in mine])
    result = offline.check(offline.reference_for(model), model, completions)
    return {
        "rows": result.rows,
        "matched": result.matched,
        "near_ties": result.ties,
        "ok": result.ok,
        "problems": result.problems[:5],
        "requests": len(completions),
    }


if __name__ == "__main__":
    print("RANK_RESULT " + json.dumps(offline_rank(sys.argv[1], int(sys.argv[2]))), flush=True)
