# SPDX-License-Identifier: Apache-2.0
"""Rows after vLLM's level-2 sleep and wake-up, every one against the transformers reference (docs/output.md,
"Sleep mode").

vLLM's CPU build has no sleep mode: the test-only stand-in ``tests/harness/sleep_stand_in.py`` does in the worker
what the cycle does to device memory (everything lost but the model's registered buffers, which vLLM restores). The
GPU run does the real cycle (``scripts/gpu_e2e/cases.py``, ``graphs_f32``). No engine of its own: reads the offline
``qwen3_moe`` eager run of ``test_routed_experts.py``, which runs the stand-in before the weight reload.
"""

from __future__ import annotations

from typing import Any

import pytest

from vllm_ascend_routing.preflight import weight_reload

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]


def test_rows_after_a_level_2_sleep_are_exact(scenario: Any, generation: str) -> None:
    sleep = scenario("offline", "--arch", "qwen3_moe", "--mode", "eager", "--prompts", "10")["sleep"]
    # The stand-in lost the plugin's state: the capture's buffer and its invalid-id counter at least, which the
    # wake-up restored as one of the model's buffers.
    for worker in sleep["workers"]:
        assert worker["plugin_tensors_lost"] >= 2, sleep["workers"]
        assert "vllm_ascend_routing_invalid_id_count" in worker["plugin_buffers_restored"], sleep["workers"]
    # The weights stay: the same tokens, every row exact after it, no invalid id or zero row counted.
    assert all(sleep["same_tokens"]) and weight_reload.failures(sleep) == [], sleep
    print(
        f"{generation}: after a level-2 sleep (CPU stand-in) {sleep['after']['matched']}/{sleep['after']['rows']} "
        f"rows exact; the always-on check counted {sleep['checked_after']}"
    )
