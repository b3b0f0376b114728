#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""What shared-cache rows (``kv.shared``) cost the scheduler, against held rows alone, in one run
(``make bench-shared-cache``).

    python benchmarks/shared_cache.py [--prompt 4096] [--requests 16] [--store shm|mooncake]

DeepSeek-V3-sized rows (61 layers x top-8, uint8: 488 B a token), prompts of ``--prompt`` tokens, vLLM's block sizes
16 (GPU default) and 128 (Ascend's). Per request, in the scheduler's thread:

  * ``put``: a finished request's rows stored: held only (the baseline: what every served connector does) against
    held + the row store (a pointer per whole block, then the rows once); ``again``: the same prompt finished once
    more (another of ``n`` samples): every block named already, no rows written;
  * ``get``: another instance's hit on the whole prompt's blocks: a name lookup and a ranged read per block.

``--store mooncake`` runs a real ``mooncake_master`` on localhost over TCP (the kit: ``make mooncake-kit``).
Prints ms per request, and the ratio of shared to held for ``put``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

LAYERS, TOP_K = 61, 8


def request(tokens: list[int], salt: str, index: int) -> Any:
    return SimpleNamespace(
        request_id=f"r{index}",
        prompt_token_ids=tokens,
        all_token_ids=tokens + [1],
        cache_salt=salt,
        lora_request=None,
        mm_features=[],
    )


def run(block: int, length: int, count: int) -> dict[str, float]:
    from vllm_ascend_routing.kv.carriers import HeldRowsCarrier, Missing, RowLayout
    from vllm_ascend_routing.kv.shared import SharedCacheCarrier

    layout = RowLayout(LAYERS, TOP_K, "uint8")
    rng = np.random.default_rng(block)
    prompts = [rng.integers(4, 100_000, size=length).tolist() for _ in range(count)]
    rows = [rng.integers(0, 256, size=(length + 1, LAYERS, TOP_K), dtype=np.uint8) for _ in range(count)]
    held = HeldRowsCarrier("MooncakeStoreConnector", layout, block, 1 << 40)
    writer = SharedCacheCarrier(HeldRowsCarrier("MooncakeStoreConnector", layout, block, 1 << 40), "bench")
    reader = SharedCacheCarrier(HeldRowsCarrier("MooncakeStoreConnector", layout, block, 1 << 40), "bench")
    salt = f"bench-{time.time_ns()}"
    timings: dict[str, list[float]] = {"held": [], "shared": [], "again": [], "get": []}
    for index, (tokens, array) in enumerate(zip(prompts, rows, strict=True)):
        # "again": the same prompt finished once more (another of n samples): every block named already
        for name, carrier in (("held", held), ("shared", writer), ("again", writer)):
            started = time.perf_counter()
            carrier.put(request(tokens, salt, index), array)
            timings[name].append(time.perf_counter() - started)
    whole = length // block * block
    for index, (tokens, array) in enumerate(zip(prompts, rows, strict=True)):
        started = time.perf_counter()
        found = reader.get(request(tokens, salt, index), 0, whole)
        timings["get"].append(time.perf_counter() - started)
        if isinstance(found, Missing) or not np.array_equal(found, array[:whole]):
            raise SystemExit(f"block {block}: request {index}'s shared rows were not read back exact: {found}")
    return {name: statistics.median(values) * 1000 for name, values in timings.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--store", default="shm", choices=["shm", "mooncake"])
    args = parser.parse_args()
    os.environ["VLLM_ASCEND_ROUTING_KV_SECRET"] = "bench"
    os.environ["VLLM_ASCEND_ROUTING_STORE_MIB"] = "8192"
    with ExitStack() as stack:
        if args.store == "mooncake":
            from tests.harness.mooncake_master import MooncakeMaster
            from tests.scripts import load

            kit = load("scripts/mooncake_kit.py", "mooncake_kit").kit()
            os.environ.update(kit.env())
            master = stack.enter_context(MooncakeMaster(kit.master_binary, dict(os.environ)))
            os.environ["VLLM_ASCEND_ROUTING_STORE"] = master.url
        else:
            os.environ["VLLM_ASCEND_ROUTING_STORE"] = "shm"  # this user's folder in /dev/shm; removed at exit
        print(f"{args.requests} requests of {args.prompt} tokens, {LAYERS}x{TOP_K} uint8 rows, store {args.store}")
        from vllm_ascend_routing.store import publisher

        def close_publishers() -> None:  # before the master stops (ExitStack: last in, first out)
            for one in publisher._publishers.values():
                one.close()

        stack.callback(close_publishers)
        for block in (16, 128):
            ms = run(block, args.prompt, args.requests)
            print(
                f"block {block:>3}: put held {ms['held']:.2f} ms, held+shared {ms['shared']:.2f} ms "
                f"({ms['shared'] / ms['held']:.1f}x), again (named already) {ms['again']:.2f} ms; "
                f"another instance's get of {args.prompt // block} blocks {ms['get']:.2f} ms (median per request)"
            )


if __name__ == "__main__":
    main()
