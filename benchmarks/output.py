#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Bytes returned per request and throughput with routed experts on, off, opted out and omitted, in one run.

    python benchmarks/output.py [--conversations 8] [--turns 3] [--first-prompt 1024] [--rounds 3]
    (make bench-output [RELEASE=0.30.0])

The model has DeepSeek-V3's routed-experts rows on a tiny body (``qwen3_moe_dsv3_rows``: 61 decoder layers, the
first 3 dense, 58 MoE layers choosing top-8 of 256 experts; vLLM's uint8 array is 488 bytes a token). The workload is
multi-turn: ``--conversations`` conversations at once, each a long first prompt, then ``--turns - 1`` more turns whose
prompt is the whole conversation so far plus ``--turn-tokens`` new tokens, ``--max-tokens`` generated each turn
(greedy, EOS ignored). Each configuration runs the same workload shape on fresh prompts (nothing cached across
configurations or rounds), through both transports:

  * ``http``: ``vllm serve`` (completions, non-streamed; bytes = the response body);
  * ``asyncllm``: vLLM's ``AsyncLLM`` in-process, as verl and NeMo RL run it (bytes = the returned array's).

Configurations: ``off`` (an engine started without ``--enable-return-routed-experts``: the baseline), ``on`` (the flag,
every request its rows), ``opted_out`` (the flag, every request ``return_routed_experts: false``) and ``omitted``
(the flag, every request ``routed_experts_omit: "cached"``: a turn's rows from the first token the prefix cache did not
serve). ``off`` runs on its own engine, the others interleaved round by round on the flag's engine. Printed: per
transport and configuration the bytes returned per request and the requests per second (medians over rounds), as
ratios to ``on`` (bytes) and to ``off`` (throughput); written to ``benchmarks/results/output-vllm-<release>.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

ARCH = "qwen3_moe_dsv3_rows"
CONFIGS_ON = ("on", "opted_out", "omitted")
EXTRA_ARGS: dict[str, dict[str, Any] | None] = {
    "off": None,
    "on": None,
    "opted_out": {"return_routed_experts": False},
    "omitted": {"routed_experts_omit": "cached"},
}
ENGINE = {
    "dtype": "float32",
    "max_model_len": 4096,
    "max_num_batched_tokens": 2048,
    "enable_prefix_caching": True,
    "enforce_eager": True,
    "seed": 0,
}
KV_CACHE_BYTES = 256 * 1024 * 1024


def conversations(count: int, seed: int, first: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 1024) for _ in range(first)] for _ in range(count)]


def new_tokens(seed: int, count: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 1024) for _ in range(count)]


def run_workload(ask: Any, args: argparse.Namespace, config: str, seed: int) -> dict[str, Any]:
    """Every turn of every conversation through ``ask(prompts, extra_args) -> [(output_ids, bytes)]``."""
    contexts = conversations(args.conversations, seed, args.first_prompt)
    sent: list[int] = []
    start = time.perf_counter()
    for turn in range(args.turns):
        replies = ask(contexts, EXTRA_ARGS[config])
        sent += [size for _, size in replies]
        contexts = [
            context + output + new_tokens(seed * 1000 + turn * 100 + i, args.turn_tokens)
            for i, (context, (output, _)) in enumerate(zip(contexts, replies, strict=True))
        ]
    seconds = time.perf_counter() - start
    return {"requests": len(sent), "bytes": sum(sent), "seconds": seconds}


# ---- http: vllm serve ----


def http_engine(model: Any, flag: bool, args: argparse.Namespace, configs: tuple[str, ...]) -> list[dict[str, Any]]:
    from tests.harness.server import Server

    flags = [
        "--max-model-len", str(ENGINE["max_model_len"]),
        "--max-num-batched-tokens", str(ENGINE["max_num_batched_tokens"]),
        "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
        "--enforce-eager", "--enable-prefix-caching",
    ]  # fmt: skip
    with Server(model.path, flags, routed_experts=flag, env=dict(os.environ)) as server, ThreadPoolExecutor(64) as pool:

        def one(prompt: list[int], extra_args: dict[str, Any] | None) -> tuple[list[int], int]:
            import urllib.request

            body = {
                "model": str(model.path),
                "prompt": prompt,
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "return_token_ids": True,
                **({"vllm_xargs": extra_args} if extra_args else {}),
            }
            request = urllib.request.Request(
                f"{server.url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=600) as response:
                raw = response.read()
            return list(json.loads(raw)["choices"][0]["token_ids"]), len(raw)

        def ask(prompts: list[list[int]], extra_args: dict[str, Any] | None) -> list[tuple[list[int], int]]:
            return list(pool.map(lambda prompt: one(prompt, extra_args), prompts))

        ask([conversations(1, 99, 16)[0]], None)  # warm-up
        return rounds(ask, args, configs)


def rounds(ask: Any, args: argparse.Namespace, configs: tuple[str, ...]) -> list[dict[str, Any]]:
    results = []
    for round_ in range(args.rounds):
        for index, config in enumerate(configs):
            seed = 1 + round_ * 10 + index + (100 if config == "off" else 0)
            results.append({"round": round_, "config": config, **run_workload(ask, args, config, seed)})
            print(f"  round {round_} {config}: {results[-1]}", file=sys.stderr, flush=True)
    return results


# ---- asyncllm: vLLM's AsyncLLM in this process (a child per engine) ----


def asyncllm_engine(model_path: str, flag: bool, args: argparse.Namespace, configs: tuple[str, ...]) -> list[Any]:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    engine_args = AsyncEngineArgs(
        model=model_path, enable_return_routed_experts=flag, kv_cache_memory_bytes=KV_CACHE_BYTES, **ENGINE
    )
    loop = asyncio.new_event_loop()
    engine = loop.run_until_complete(_make(AsyncLLM, engine_args))

    async def one(prompt: list[int], extra_args: dict[str, Any] | None) -> tuple[list[int], int]:
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True, extra_args=extra_args)
        final = None
        async for output in engine.generate({"prompt_token_ids": prompt}, params, request_id=uuid.uuid4().hex):
            final = output
        assert final is not None
        sample = final.outputs[0]
        routed = sample.routed_experts
        return list(sample.token_ids), 0 if routed is None else int(routed.nbytes)

    def ask(prompts: list[list[int]], extra_args: dict[str, Any] | None) -> list[tuple[list[int], int]]:
        async def every() -> list[tuple[list[int], int]]:
            return list(await asyncio.gather(*(one(prompt, extra_args) for prompt in prompts)))

        return loop.run_until_complete(every())

    try:
        ask([conversations(1, 99, 16)[0]], None)  # warm-up
        return rounds(ask, args, configs)
    finally:
        engine.shutdown()


async def _make(async_llm: Any, engine_args: Any) -> Any:
    return async_llm.from_engine_args(engine_args)


def child(transport: str, flag: bool, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One engine's rounds in a fresh process (each engine's memory and threads gone with it)."""
    command = [sys.executable, __file__, "--child", transport, "--flag", str(int(flag)), *sys.argv[1:]]
    env = {**os.environ, "VLLM_ASCEND_ROUTING": "1", "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(command, env=env, stdout=subprocess.PIPE, text=True, check=True, cwd=Path.home())
    line = [text for text in done.stdout.splitlines() if text.startswith("BENCH_RESULT ")][-1]
    return list(json.loads(line.removeprefix("BENCH_RESULT ")))


def summarise(results: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    table: dict[str, dict[str, float]] = {}
    for config in ("off", *CONFIGS_ON):
        mine = [r for r in results if r["config"] == config]
        table[config] = {
            "bytes_per_request": statistics.median(r["bytes"] / r["requests"] for r in mine),
            "requests_per_s": statistics.median(r["requests"] / r["seconds"] for r in mine),
        }
    for row in table.values():
        row["bytes_vs_on"] = row["bytes_per_request"] / max(table["on"]["bytes_per_request"], 1)
        row["throughput_vs_off"] = row["requests_per_s"] / table["off"]["requests_per_s"]
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--first-prompt", type=int, default=1024)
    parser.add_argument("--turn-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--transports", default="http,asyncllm")
    parser.add_argument("--child", choices=["http", "asyncllm"], help=argparse.SUPPRESS)
    parser.add_argument("--flag", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    import tests.harness.model_recipes  # noqa: F401 (the benchmark models' recipes)
    from vllm_ascend_routing.preflight import models
    from vllm_ascend_routing.preflight.scenarios import model_dir

    model = models.build_tiny_moe(ARCH, model_dir() / ARCH)
    if args.child:
        configs = CONFIGS_ON if args.flag else ("off",)
        if args.child == "http":
            result = http_engine(model, bool(args.flag), args, configs)
        else:
            result = asyncllm_engine(str(model.path), bool(args.flag), args, configs)
        print("BENCH_RESULT " + json.dumps(result), flush=True)
        return
    import vllm

    report: dict[str, Any] = {"vllm": vllm.__version__, "model": ARCH, "workload": vars(args), "transports": {}}
    for transport in args.transports.split(","):
        print(f"{transport}: engine without routed experts", file=sys.stderr, flush=True)
        results = child(transport, False, args)
        print(f"{transport}: engine with --enable-return-routed-experts", file=sys.stderr, flush=True)
        results += child(transport, True, args)
        report["transports"][transport] = {"rounds": results, "table": summarise(results)}
    print_table(report)
    out = ROOT / "benchmarks" / "results" / f"output-vllm-{report['vllm']}.json"
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"written: {out.relative_to(ROOT)}")


def print_table(report: dict[str, Any]) -> None:
    workload = report["workload"]
    print(
        f"vLLM {report['vllm']}, {ARCH} (58 MoE layers x top-8 of 256, 488 B a token); {workload['conversations']} "
        f"conversations x {workload['turns']} turns, first prompt {workload['first_prompt']} tokens, "
        f"+{workload['turn_tokens']} a turn, {workload['max_tokens']} generated; medians of {workload['rounds']} rounds"
    )
    print(f"{'transport':<10} {'config':<10} {'bytes/request':>14} {'vs on':>7} {'requests/s':>11} {'vs off':>7}")
    for transport, data in report["transports"].items():
        for config, row in data["table"].items():
            print(
                f"{transport:<10} {config:<10} {row['bytes_per_request']:>14,.0f} {row['bytes_vs_on']:>7.3f} "
                f"{row['requests_per_s']:>11.3f} {row['throughput_vs_off']:>7.3f}"
            )


if __name__ == "__main__":
    main()
