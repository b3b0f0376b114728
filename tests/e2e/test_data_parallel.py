# SPDX-License-Identifier: Apache-2.0
"""Data parallel serving (``--data-parallel-size 2``, one core per engine) with the plugin: every completed
request's rows equal the reference exactly, whichever DP engine served it.

Two layouts: one ``vllm serve`` with both engines (and a row store: half the requests' rows fetched by key, both
engines' keys in one batch, the other half inline), and the multi-node form on loopback (rank 0's server with
``--data-parallel-size-local 1`` plus a ``--headless`` process for rank 1); on vLLM 0.20.x (no routed experts
over HTTP) one offline ``LLM`` per DP rank process instead. Requests of very different lengths
go in concurrently, so the ranks' token counts differ every step and a rank runs dummy batches while the
other works. Which case the router sees depends on the release: all DP ranks' tokens gathered before routing
(vLLM's naive dispatch: 0.20-0.27's CPU MoE), or only local tokens (dispatch inside the modular kernel:
0.28+). vLLM's CPU build cannot run an MoE under DP alone; the engines get the TEST-ONLY collectives stand-in
(``tests/harness/cpu_dp_collectives.py``).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.harness import data_parallel, distributed, scenarios
from tests.harness.generation_cases import once
from vllm_ascend_routing.preflight import models

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]


def layouts_for(generation: str) -> list[str]:
    # vLLM 0.20.x has no routed_experts in its OpenAI API: there DP runs offline, one LLM per rank process.
    return ["offline"] if generation == "shm" else ["server", "headless"]


@pytest.mark.parametrize("layout", ["server", "headless", "offline"])
def test_data_parallel_rows_exact(scenario: Any, generation: str, layout: str) -> None:
    if layout not in layouts_for(generation):
        pytest.skip(f"{layout} DP is tested on another generation ({generation} runs {layouts_for(generation)})")
    if layout == "headless":
        # Which tokens the router sees (naive dispatch up to 0.27, local tokens from 0.28) and how each engine's
        # rows reach the front end are the server layout's case on each release: the headless rank differs from
        # it only in where rank 1's engine process is launched (and how it finds the coordinator).
        once("headless DP", distributed.vllm_release())
    result = scenario("data-parallel", "--layout", layout, in_process=False)
    print(
        f"DP=2 {layout}: {result['matched']}/{result['rows']} rows, requests per rank "
        f"{result['requests_per_rank']}, dummy batches per rank {result['dummy_batches_per_rank']}"
    )
    assert result["ok"], result["problems"]
    assert result["requests"] == len(data_parallel.REQUESTS)
    moe_layers = len(models.build_tiny_moe("qwen3_moe", scenarios.model_dir() / "qwen3_moe").moe_layers)
    expected_rows = sum(n + m - 1 for n, m in data_parallel.REQUESTS) * moe_layers
    assert result["rows"] == result["matched"] == expected_rows
    # Each engine served its own share (10 and 6): each rank's own rows were returned, not one engine's only.
    shares = {str(rank): data_parallel.rank_requests(rank) for rank in (0, 1)}
    assert result["requests_per_rank"] == {rank: len(share) for rank, share in shares.items()}, result
    if layout == "server":  # with a row store: the odd requests by key (each DP engine's own), the even inline
        keyed = {rank: sum(i % 2 for i in share) for rank, share in shares.items()}
        assert result["keys_per_rank"] == keyed and min(keyed.values()) >= 1, result["keys_per_rank"]
