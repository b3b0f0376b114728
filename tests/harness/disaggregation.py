# SPDX-License-Identifier: Apache-2.0
"""Prefill/decode disaggregation through vLLM's ``ExampleConnector`` (shared-storage KV), every engine of it in
this one process, one after the other (the connector's storage is a folder):

  1. ``producer`` (kv_producer): the prompts of sets A and B prefilled, one token out (vLLM's P/D flow); its
     prompt rows against the reference. The rows of set B's longest prompt are then removed from the storage:
     the KV is there, its rows are not, as after a producer without the plugin or a store that lost them;
  2. ``kv_both``: set C computed (stored, KV and rows), then set A's decode requests (prompt + the producer's
     token) loading the producer's KV into slots C used before;
  3. ``consumer`` (kv_consumer), fresh: set A's decode requests (no warm-up: free slots), a warm-up batch (chunked
     prefills: its slots now hold rows), then set B's and set C's decode requests (stale slots), the one whose
     rows were removed among them: that offer is declined and its prompt computed here (chunked);
  4. ``tier`` (kv_both): a connector the plugin has no carrier for (a TEST-ONLY stand-in,
     ``local_tier_standin``, for an offload tier or cache service): set C's prompts, whose KV the ``kv_both``
     engine stored (computed here instead: its rows are not held here), then set C's decode requests, salted so
     that the local prefix cache finds none of their blocks (as after an eviction), loading the KV this engine
     stored (its rows held in the scheduler), and once more after ``reset_prefix_cache`` (the held rows dropped:
     computed here);
  5. ``single``: a plain engine (no connector) runs every prompt as one request of the same length (the single
     engine each decode request must equal, row for row) and re-prefills each decode request's sequence (the
     re-prefill consistency oracle's independent pass).

Every row of every engine is compared with the transformers reference; the decode requests with the single
engine's arrays and with the oracle. On releases whose generation carries no rows (``kv_rows`` absent), and for a
connector the plugin does not cover, the refusal is recorded instead.
"""

from __future__ import annotations

import gc
import os
import random
import shutil
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from vllm_ascend_routing import kv
from vllm_ascend_routing.kv import carriers
from vllm_ascend_routing.preflight import consistency, models, offline
from vllm_ascend_routing.preflight.scenarios import MAX_TOKENS, _verdict, model_dir

BLOCK_SIZE = 32  # the CPU attention backend's block sizes are multiples of 32
PREFILL_BUDGET = 2048  # ExampleConnector stores a prompt's KV in its first step only: producers never chunk
DECODE_BUDGET = 128  # the consumer and the single engine chunk long prompts
# Prompt lengths: under one block (nothing to load), one to nine whole blocks and a tail. Never a multiple of the
# block size: ExampleConnector's decode side then loads a folder named for one block more than its prefill side
# stored (vLLM's own connector fails with FileNotFoundError, plugin or not).
SET_A = (3, 65, 97, 300)
SET_B = (40, 129, 200, 301)  # the last one's rows are removed from the storage
SET_C = (50, 170)
WARM_UP = (20, 77, 260, 45)
# The TEST-ONLY connector without a carrier, by the module vLLM's connector factory imports it from.
TIER_MODULE = "tests.harness.local_tier_standin"


def prompts(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, models.VOCAB_SIZE) for _ in range(n)] for n in lengths]


def run_disaggregation(arch: str) -> dict[str, Any]:
    from vllm_ascend_routing.compat import adapter as get_adapter

    model = models.build_tiny_moe(arch, model_dir() / arch)
    storage = Path(tempfile.mkdtemp(prefix="vllm_ascend_routing_pd_"))
    try:
        out: dict[str, Any] = {"arch": arch, "generation": get_adapter().generation.value}
        if getattr(get_adapter(), "kv_rows", None) is None:  # this generation refuses every connector
            out["covered"] = _refused_at_load(model, storage)
            out["refused_only"] = True  # no engine ran: no array to validate
            return out
        out["uncovered"] = _refused(model, storage, "NixlPushConnector", "kv_consumer")
        out.update(_disaggregated(model, storage))
        return out
    finally:
        shutil.rmtree(storage, ignore_errors=True)


def _engine(model: models.TinyMoE, storage: Path | None, role: str, budget: int, tier: bool = False) -> Any:
    """An engine with ExampleConnector (``tier``: the stand-in for a connector without a carrier)."""
    from vllm.config import KVTransferConfig

    options: dict[str, Any] = {"max_num_batched_tokens": budget, "enable_prefix_caching": True}
    if storage is not None:
        extra = {"shared_storage_path": str(storage)}
        options["kv_transfer_config"] = KVTransferConfig(
            kv_connector="LocalTierStandIn" if tier else "ExampleConnector",
            kv_role=role,
            kv_connector_extra_config=extra,
            kv_connector_module_path=TIER_MODULE if tier else None,
        )
    return offline.make_llm(model, enforce_eager=True, block_size=BLOCK_SIZE, **options)


def _refused(model: models.TinyMoE, storage: Path, connector: str, role: str) -> dict[str, Any]:
    """Start an engine with ``connector``: the refusal's type and message (or that it started)."""
    from vllm.config import KVTransferConfig

    start = time.monotonic()
    try:
        llm = offline.make_llm(
            model,
            enforce_eager=True,
            block_size=BLOCK_SIZE,
            enable_prefix_caching=True,
            kv_transfer_config=KVTransferConfig(
                kv_connector=connector, kv_role=role, kv_connector_extra_config={"shared_storage_path": str(storage)}
            ),
        )
    except Exception as error:  # the refusal, in whichever process vLLM raised it
        return {"refused": True, "error": type(error).__name__, "message": str(error)[-1500:], "seconds": _since(start)}
    _close(llm)
    return {"refused": False, "seconds": _since(start)}


def _refused_at_load(model: models.TinyMoE, storage: Path) -> dict[str, Any]:
    """The refusal every worker raises at model load (``kv.refuse_uncovered``, from the generation's
    ``prepare``), on vLLM's own config for an ExampleConnector engine: an engine start would show it only in a
    worker process's log (the CPU build's workers run apart on 0.20.x)."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    from vllm_ascend_routing.compat import UnsupportedVllmError
    from vllm_ascend_routing.compat import adapter as get_adapter

    args = EngineArgs(
        model=str(model.path),
        dtype="float32",
        max_model_len=1024,
        enable_return_routed_experts=True,
        block_size=BLOCK_SIZE,
        kv_transfer_config=KVTransferConfig(
            kv_connector="ExampleConnector",
            kv_role="kv_consumer",
            kv_connector_extra_config={"shared_storage_path": str(storage)},
        ),
    )
    try:
        kv.refuse_uncovered(
            args.create_engine_config(), get_adapter().generation.value, get_adapter().kv_rows, kv.RELIED
        )
    except UnsupportedVllmError as error:
        return {"refused": True, "error": type(error).__name__, "message": str(error)}
    return {"refused": False}


def _since(start: float) -> float:
    return round(time.monotonic() - start, 1)


def _close(llm: Any) -> None:
    """Shut the in-process engine down, its worker's connector with it: vLLM keeps that connector in a process
    global, which the next engine of this process would otherwise find and reuse."""
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    llm.llm_engine.engine_core.shutdown()
    ensure_kv_transfer_shutdown()
    del llm
    gc.collect()


def _decode_prompts(prefill: list[offline.Completion]) -> list[list[int]]:
    """vLLM's P/D flow as ExampleConnector serves it: the prompt and the token the producer generated."""
    return [c.prompt_ids + c.output_ids[:1] for c in prefill]


def _disaggregated(model: models.TinyMoE, storage: Path) -> dict[str, Any]:
    reference = offline.reference_for(model)
    sets = {"A": prompts(SET_A, 31), "B": prompts(SET_B, 32), "C": prompts(SET_C, 33)}
    out: dict[str, Any] = {"storage_rows_files": 0, "phases": {}}
    phases: dict[str, Any] = out["phases"]
    started = time.monotonic()

    def phase(name: str, llm: Any, batch: list[list[int]], max_tokens: int, salt: str = "") -> list[offline.Completion]:
        before = kv.stats()
        done = offline.generate(llm, batch, max_tokens, cache_salt=salt)
        after = kv.stats()
        verdict = _verdict(offline.check(reference, model, done))
        verdict["rows_loaded"] = after.rows_loaded - before.rows_loaded
        # what each request's provenance record says was loaded (routed_experts_info, output/engine.py)
        verdict["info_loaded"] = [None if c.info is None else c.info["loaded"] for c in done]
        verdict["rows_declined"] = after.rows_declined - before.rows_declined
        verdict["rows_stored"] = after.rows_stored - before.rows_stored
        verdict["cached_tokens"] = [c.num_cached_tokens for c in done]
        verdict["requests"] = len(done)
        phases[name] = verdict
        return done

    producer = _engine(model, storage, "kv_producer", PREFILL_BUDGET)
    prefill = phase("producer", producer, sets["A"] + sets["B"], 1)
    out["sentinel_producer"] = offline.sentinel_totals(producer)
    _close(producer)
    out["storage_rows_files"] = len(list(storage.rglob(carriers.ROWS_FILE)))
    decode = {"A": _decode_prompts(prefill[: len(SET_A)]), "B": _decode_prompts(prefill[len(SET_A) :])}
    # Set B's longest prompt: its KV stays, its rows go (a producer without the plugin leaves exactly this).
    removed = _remove_rows(storage, decode["B"][-1])

    both = _engine(model, storage, "kv_both", PREFILL_BUDGET)
    computed_c = phase("kv_both_computes", both, sets["C"], MAX_TOKENS)
    phase("kv_both_loads_after_use", both, decode["A"], MAX_TOKENS - 1)
    decode["C"] = [c.prompt_ids + c.output_ids[:1] for c in computed_c]
    out["sentinel_kv_both"] = offline.sentinel_totals(both)
    _close(both)

    consumer = _engine(model, storage, "kv_consumer", DECODE_BUDGET)
    loaded = {"A": phase("consumer_fresh", consumer, decode["A"], MAX_TOKENS - 1)}
    phase("consumer_warm_up", consumer, prompts(WARM_UP, 34), MAX_TOKENS)
    loaded["B"] = phase("consumer_after_warm_up", consumer, decode["B"], MAX_TOKENS - 1)
    loaded["C"] = phase("consumer_loads_kv_both", consumer, decode["C"], MAX_TOKENS - 1)
    out["sentinel_consumer"] = offline.sentinel_totals(consumer)
    _close(consumer)
    out["reports"] = kv.first_reports()
    out["removed_rows_file"] = removed

    tier = _engine(model, storage, "kv_both", PREFILL_BUDGET, tier=True)
    phase("tier_computes_kv_stored_elsewhere", tier, sets["C"], MAX_TOKENS)
    # Salted: the local prefix cache holds none of it, as after an eviction; the connector's storage (unsalted) does.
    loaded["C_tier"] = phase("tier_reloads_its_own_kv", tier, decode["C"], MAX_TOKENS - 1, salt="evicted")
    out["tier_held"] = _held_against_returned(tier, loaded["C_tier"])
    tier.reset_prefix_cache()  # as RL frameworks do after a weight update: the rows held here are dropped
    phase("tier_after_prefix_cache_reset", tier, decode["C"], MAX_TOKENS - 1, salt="reset")
    out["sentinel_tier"] = offline.sentinel_totals(tier)
    _close(tier)

    single = _engine(model, None, "", DECODE_BUDGET)
    out["single"] = {}
    for name, group in sets.items():
        whole = offline.generate(single, group, MAX_TOKENS)
        out["single"][name] = _against_single(whole, loaded[name])
        if name == "C":
            out["single"]["C_tier"] = _against_single(whole, loaded["C_tier"])
    out["oracle"] = _oracle(single, [c for name in loaded for c in loaded[name]])
    _close(single)
    out["seconds"] = _since(started)
    return out


def _held_against_returned(llm: Any, done: list[offline.Completion]) -> dict[str, Any]:
    """What the in-process scheduler holds for each finished request (prompt and generated tokens but the last),
    against the array the engine returned for it: the whole sequence's rows on 0.22-0.30 (the slot buffer gives
    them), the prompt's on 0.31+."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    held = kv.held_rows(scheduler)
    if held is None:
        return {"held": None}
    whole = prompt = 0
    for c in done:
        returned = c.routed_experts
        assert returned is not None, "the engine returned no routed experts"
        sequence = c.prompt_ids + c.output_ids[:-1]
        stand_in = SimpleNamespace(request_id="held-check", prompt_token_ids=sequence, mm_features=[])
        rows = held.get(stand_in, 0, len(sequence))
        whole += int(isinstance(rows, np.ndarray) and np.array_equal(rows, returned))
        rows = held.get(stand_in, 0, len(c.prompt_ids))
        prompt += int(isinstance(rows, np.ndarray) and np.array_equal(rows, returned[: len(c.prompt_ids)]))
    return {"requests": len(done), "whole_sequence_held": whole, "prompt_held": prompt, "bytes": held.held_bytes}


def _remove_rows(storage: Path, decode_prompt: list[int]) -> bool:
    """Remove the rows file beside the KV of ``decode_prompt``'s loaded prefix (found by its token ids)."""
    for path in storage.rglob(carriers.ROWS_FILE):
        with np.load(path) as stored:
            tokens = stored["token_ids"]
        if len(tokens) and list(tokens) == decode_prompt[: len(tokens)] and len(tokens) > 256:
            os.unlink(path)
            return True
    return False


def _against_single(whole: list[offline.Completion], decoded: list[offline.Completion]) -> dict[str, Any]:
    """Each decode request (prompt + first token, the rest) against one engine's request (prompt, all tokens)."""
    same_tokens = same_rows = 0
    for one, two in zip(whole, decoded, strict=True):
        same_tokens += int(one.output_ids == two.prompt_ids[len(one.prompt_ids) :] + two.output_ids)
        same_rows += int(
            one.routed_experts is not None
            and two.routed_experts is not None
            and np.array_equal(one.routed_experts, two.routed_experts)
        )
    return {"requests": len(whole), "same_tokens": same_tokens, "same_rows": same_rows}


def _oracle(single: Any, decoded: list[offline.Completion], extra_args: dict[str, Any] | None = None) -> dict[str, Any]:
    """The re-prefill consistency oracle: each decode request's sequence prefilled again by the plain engine
    (a cache salt of its own: no prefix-cache row), its rows against the decode request's. ``extra_args``: each
    request's (a store engine's ``routed_experts_transport: inline``)."""
    from vllm import SamplingParams

    salt = f"pd-{time.monotonic_ns()}"
    again = [
        {"prompt_token_ids": c.prompt_ids + c.output_ids[:-1], "cache_salt": f"{salt}-{i}"}
        for i, c in enumerate(decoded)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=1, **({"extra_args": extra_args} if extra_args else {}))
    redone = single.generate(again, params, use_tqdm=False)
    pairs = [
        consistency.Pair(str(i), c.routed_experts, r.outputs[0].routed_experts)
        for i, (c, r) in enumerate(zip(decoded, redone, strict=True))
    ]
    result = consistency.analyse(pairs, "float32")
    cached = sum(int(getattr(r, "num_cached_tokens", 0) or 0) for r in redone)
    return {"verdict": result.verdict, "wrong": result.wrong, "requests": len(pairs), "cached_tokens": cached}
