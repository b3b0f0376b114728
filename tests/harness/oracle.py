# SPDX-License-Identifier: Apache-2.0
"""The re-prefill consistency oracle on an e2e engine: clean, then with each TEST-ONLY fault of
``routing_mutations`` planted in the generation's output (the rows the front end returned, before the oracle
reads them; the re-prefill's rows untouched), as a broken capture or output path would return them.

Runs after the offline scenario's reference checks, on its engine (``run_offline(after=...)``): one generation
and one re-prefill, each mutation analysed on copies of the same outputs. ``stale_step`` plants the previous
step's rows of a simulated schedule (one prefill step, then decode steps), not of the schedule vLLM ran.

Then ``engine_plant``: a second generation and re-prefill on the same engine with one misfiled row planted inside
vLLM's front end as the rows arrive (``engine_plants.late_first_decode_row``: one request's first decode row
carries the previous token's routing, in every layer); the oracle must name that request and token.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from tests.harness import engine_plants, routing_mutations
from vllm_ascend_routing import contract
from vllm_ascend_routing.preflight import consistency, reprefill

NUM_REQUESTS = 8  # not the engine's max_num_seqs + 2 (256 + 2 on the CPU build): the e2e suite's minutes
MAX_TOKENS = 12
PLANT_NTH = 3  # the fourth request to reach its first decode row gets the misfiled row


def oracle_part(llm: Any) -> dict[str, Any]:
    """``{"consistency": clean result, "workload", "mutations": {name: {"expected", "verdict", "wrong", ...}}}``."""
    from vllm import SamplingParams

    start = time.monotonic()
    config = llm.llm_engine.model_config
    dtype = str(config.dtype).removeprefix("torch.")

    def collect() -> reprefill.Collected:
        return reprefill.collect(
            lambda prompts, params: llm.generate(prompts, params, use_tqdm=False),
            lambda n: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True),
            reprefill.Layout.of(llm.llm_engine.vllm_config),
            int(config.get_vocab_size()),
            MAX_TOKENS,
            lambda output: contract.request_rows(output, config.hf_text_config),
            NUM_REQUESTS,
        )

    collected = collect()
    pairs = collected.pairs()
    clean = consistency.analyse(pairs, dtype)
    out: dict[str, Any] = {"consistency": clean.as_dict(), "workload": vars(collected.work), "mutations": {}}
    out["oracle_seconds"] = time.monotonic() - start  # what the oracle adds to the scenario's engine
    rows = [np.asarray(pair.generation) for pair in pairs]
    prompts = [len(output.prompt_token_ids) for output in collected.generation]
    for name, (mutate, expected) in routing_mutations.MUTATIONS.items():
        mutated = mutate(rows, prompts)
        wrong_rows = sum(
            int(np.any(np.sort(m, -1) != np.sort(r, -1), axis=-1).sum()) for m, r in zip(mutated, rows, strict=True)
        )
        result = consistency.analyse(
            [consistency.Pair(p.request, m, p.reprefill) for p, m in zip(pairs, mutated, strict=True)], dtype
        )
        out["mutations"][name] = {
            "expected": expected,
            "verdict": result.verdict,
            "planted_rows": wrong_rows,
            "wrong": result.wrong,
            "failing_layers": result.failing_layers,
            "summary": result.summary(),
        }
    start = time.monotonic()
    with engine_plants.late_first_decode_row(PLANT_NTH) as planted:
        faulted = collect()
    result = consistency.analyse(faulted.pairs(), dtype)
    ids = [str(output.request_id) for output in faulted.generation]
    out["engine_plant"] = {
        # the oracle's name for the planted request (its index among the generation's outputs), and its row
        "request": str(ids.index(planted.request_id)) if planted.request_id in ids else None,
        "row": planted.row,
        "verdict": result.verdict,
        "token_faults": [fault.as_dict() for fault in result.token_faults],
        "wrong": result.wrong,
        "summary": result.summary(),
        "seconds": time.monotonic() - start,
    }
    return out
