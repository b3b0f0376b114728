#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""The row store against rows inline and routed experts off, in one run (``make bench-store [RELEASE=0.30.0]``).

    python benchmarks/store.py [--requests 8] [--prompt 1536] [--max-tokens 16] [--rounds 5]

DeepSeek-V3-sized rows (``qwen3_moe_dsv3_rows``, as ``make bench-output``: 58 MoE layers x top-8 of 256, 488 B a token),
long prompts, through ``vllm serve`` (completions, non-streamed). Four servers run at once and take turns, round by
round in a rotating order, on fresh prompts:

  * ``off`` and ``off_again``: started without ``--enable-return-routed-experts``: the baseline and its A/A pair (the
    spread between two identical engines, against which the other ratios are read);
  * ``inline``: the flag, rows in each response (base64 ``.npy``);
  * ``store``: the flag and ``VLLM_ASCEND_ROUTING_STORE=shm``: a key in each response; after each of its rounds this
    process, as the trainer, fetches every key (timed) and releases them.

Then, from one round's keys, a trainer rank of PP=4 x CP=2 packs its shard (``replay.to_megatron`` over keys): the
bytes it read from the store against its slice, and its peak memory (``tracemalloc``: NumPy's allocations) against
the slice and against packing the whole batch from fetched arrays. Written to
``benchmarks/results/store-vllm-<release>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
import tracemalloc
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

ARCH = "qwen3_moe_dsv3_rows"
ENGINES = ("off", "off_again", "inline", "store")
KV_CACHE_BYTES = 512 * 1024 * 1024
PP, CP = 4, 2


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 1024) for _ in range(length)] for _ in range(count)]


def post(url: str, body: dict[str, Any]) -> bytes:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=900) as response:
        return bytes(response.read())


def start_servers(stack: ExitStack, model: Any) -> dict[str, Any]:
    from tests.harness.server import Server

    flags = [
        "--max-model-len", "4096", "--max-num-batched-tokens", "2048", "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
        "--enforce-eager",
    ]  # fmt: skip
    base = {**os.environ, "VLLM_ASCEND_ROUTING": "1", "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    base.pop("VLLM_ASCEND_ROUTING_STORE", None)
    servers = {}
    for name in ENGINES:
        env = {**base, **({"VLLM_ASCEND_ROUTING_STORE": "shm"} if name == "store" else {})}
        servers[name] = stack.enter_context(
            Server(model.path, flags, routed_experts=name in ("inline", "store"), env=env)
        )
        print(f"  {name}: up", file=sys.stderr, flush=True)
    return servers


def one_round(server: Any, model: Any, batch: list[list[int]], max_tokens: int) -> dict[str, Any]:
    body = {"model": str(model.path), "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    start = time.perf_counter()
    with ThreadPoolExecutor(len(batch)) as pool:
        raws = list(pool.map(lambda prompt: post(f"{server.url}/v1/completions", {**body, "prompt": prompt}), batch))
    seconds = time.perf_counter() - start
    choices = [json.loads(raw)["choices"][0] for raw in raws]
    return {"seconds": seconds, "requests": len(batch), "bytes": [len(raw) for raw in raws], "choices": choices}


def fetch_and_release(keys: list[str]) -> dict[str, float]:
    from vllm_ascend_routing import replay

    start = time.perf_counter()
    arrays = replay.fetch(keys)
    seconds = time.perf_counter() - start
    nbytes = sum(int(a.nbytes) for a in arrays)
    replay.release(keys)
    return {"bytes": nbytes, "seconds": seconds, "gb_per_s": nbytes / seconds / 1e9}


def shard_reads(keys: list[str], prompt: int, output: int, model: Any) -> dict[str, Any]:
    """Each PP x CP rank's bytes read and peak memory packing its shard from keys; the whole batch, fetched."""
    from vllm_ascend_routing import replay

    moe = list(model.moe_layers)
    stages = [moe[i * len(moe) // PP : (i + 1) * len(moe) // PP] for i in range(PP)]
    ranks = []
    for stage, layers in enumerate(stages):
        for cp_rank in range(CP):
            samples = [replay.align(replay.open_rows(key), prompt, output) for key in keys]
            tracemalloc.start()
            packed = replay.to_megatron(
                samples,
                moe,
                model.num_experts,
                pad_to=2 * CP,
                shard=replay.Shard(layers=layers, cp_rank=cp_rank, cp_size=CP),
            )
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            read = sum(sample.parts[0].reads.bytes for sample in samples)
            recorded = int(packed.valid.sum()) * len(layers) * int(packed.ids.shape[-1])  # uint8: a byte an id
            ranks.append(
                {
                    "stage": stage,
                    "cp_rank": cp_rank,
                    "bytes_read": read,
                    "slice_bytes": recorded,
                    "peak_bytes": peak,
                    "read_vs_slice": read / recorded,
                    "peak_vs_slice": peak / recorded,
                }  # fmt: skip
            )
    tracemalloc.start()
    whole = [replay.align(array, prompt, output) for array in replay.fetch(keys)]
    replay.to_megatron(whole, moe, model.num_experts, pad_to=2 * CP)
    whole_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {
        "ranks": ranks,
        "whole_batch_bytes": sum(sample.nbytes for sample in whole),
        "whole_batch_peak_bytes": whole_peak,
        "max_read_vs_slice": max(r["read_vs_slice"] for r in ranks),
        "max_peak_vs_slice": max(r["peak_vs_slice"] for r in ranks),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=1536)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    os.environ["VLLM_ASCEND_ROUTING_STORE"] = "shm"  # this process reads the store engine's keys
    import vllm

    import tests.harness.model_recipes  # noqa: F401 (the benchmark models' recipes)
    from vllm_ascend_routing.preflight import models
    from vllm_ascend_routing.preflight.scenarios import model_dir

    model = models.build_tiny_moe(ARCH, model_dir() / ARCH)
    results: list[dict[str, Any]] = []
    fetches: list[dict[str, float]] = []
    shard: dict[str, Any] = {}
    with ExitStack() as stack:
        servers = start_servers(stack, model)
        for name in ENGINES:  # warm-up: each engine's first long prefill
            one_round(servers[name], model, prompts(2, args.prompt, 999), 2)
        for round_ in range(args.rounds):
            order = ENGINES[round_ % len(ENGINES) :] + ENGINES[: round_ % len(ENGINES)]
            for index, name in enumerate(order):
                batch = prompts(args.requests, args.prompt, 1 + round_ * 10 + index)
                done = one_round(servers[name], model, batch, args.max_tokens)
                keys = [str((c.get("routed_experts_info") or {}).get("store_key")) for c in done["choices"]]
                record_bytes = [len(json.dumps(c.get("routed_experts_info"))) for c in done["choices"]]
                row = {"round": round_, "engine": name, "seconds": done["seconds"], "requests": done["requests"],
                       "bytes_per_response": statistics.median(done["bytes"]),
                       "record_bytes": statistics.median(record_bytes)}  # fmt: skip
                if name == "store":
                    if round_ == args.rounds - 1:
                        shard = shard_reads(keys, args.prompt, args.max_tokens, model)
                    fetches.append(fetch_and_release(keys))
                results.append(row)
                print(f"  round {round_} {name}: {row}", file=sys.stderr, flush=True)
    rps = {n: [r["requests"] / r["seconds"] for r in results if r["engine"] == n] for n in ENGINES}
    median = {n: statistics.median(v) for n, v in rps.items()}
    per_round = {n: [a / b for a, b in zip(rps[n], rps["off"], strict=True)] for n in ENGINES}
    table = {
        n: {
            "requests_per_s": median[n],
            "vs_off": median[n] / median["off"],
            "vs_off_per_round": per_round[n],
            "bytes_per_response": statistics.median(r["bytes_per_response"] for r in results if r["engine"] == n),
        }
        for n in ENGINES
    }
    report = {
        "vllm": vllm.__version__, "model": ARCH, "workload": vars(args), "table": table, "rounds": results,
        "fetch": {"median_gb_per_s": statistics.median(f["gb_per_s"] for f in fetches), "rounds": fetches},
        "shard": shard,
    }  # fmt: skip
    print_report(report)
    out = ROOT / "benchmarks" / "results" / f"store-vllm-{report['vllm']}.json"
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"written: {out.relative_to(ROOT)}")


def print_report(report: dict[str, Any]) -> None:
    w = report["workload"]
    print(
        f"vLLM {report['vllm']}, {ARCH} (488 B of rows a token); {w['requests']} requests at once, {w['prompt']}-token "
        f"prompts, {w['max_tokens']} generated; medians of {w['rounds']} rounds, engines taking turns"
    )
    print(f"{'engine':<10} {'requests/s':>11} {'vs off':>7} {'per round vs off':>34} {'bytes/response':>15}")
    for name, row in report["table"].items():
        rounds = ", ".join(f"{x:.3f}" for x in row["vs_off_per_round"])
        print(
            f"{name:<10} {row['requests_per_s']:>11.3f} {row['vs_off']:>7.3f} {rounds:>34} "
            f"{row['bytes_per_response']:>15,.0f}"
        )
    print(f"fetch: {report['fetch']['median_gb_per_s']:.2f} GB/s (median over rounds; shm, this process)")
    shard = report["shard"]
    if shard:
        print(
            f"PP={PP} x CP={CP} shard from keys: read / slice at most {shard['max_read_vs_slice']:.3f}, "
            f"peak / slice at most {shard['max_peak_vs_slice']:.2f}; the whole batch {shard['whole_batch_bytes']:,} B, "
            f"packing it peaks at {shard['whole_batch_peak_bytes']:,} B"
        )


if __name__ == "__main__":
    main()
