# SPDX-License-Identifier: Apache-2.0
"""Exact routed experts from a real vLLM engine (CPU build) vs the transformers reference.

Every returned (token, MoE layer) row must hold the reference's top-k set; dense layers' rows are zero.
Runs inside a per-release venv (``make test``); each scenario is one engine in a subprocess.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.harness import distributed, scenarios
from tests.harness.cpu_moe_choice import CpuMoeKernel, vllm_cpu_moe_kernel
from tests.harness.generation_cases import once_per_generation
from vllm_ascend_routing.preflight import models

pytestmark = [pytest.mark.vllm, pytest.mark.e2e]

NUM_PROMPTS = 10
# Every architecture eager, one compiled (the one with a dense layer): compiling is the costliest part of an
# engine here (about 50 s against 15), and what it can break (the capture op inside the compiled graph) does
# not depend on the model's code. make matrix's doctor runs qwen3_moe compiled on every release.
RUNS = [(arch, "eager") for arch in models.ARCHITECTURES] + [("qwen3_moe_dense", "compiled")]


def expected_arrays(prompts: list[list[int]], arch: str, generation: str) -> list[dict[str, Any]]:
    """The release's documented contract: int32 on 0.20.x (shm), uint8/uint16 from 0.22 on."""
    info = models.build_tiny_moe(arch, scenarios.model_dir() / arch)
    narrow = "uint8" if info.num_experts <= 256 else "uint16"
    dtype = "int32" if generation == "shm" else narrow
    return [
        {"shape": [len(p) + scenarios.MAX_TOKENS - 1, info.num_hidden_layers, info.top_k], "dtype": dtype}
        for p in prompts
    ]


@pytest.mark.parametrize(("arch", "mode"), RUNS)
def test_offline_batch_exact(scenario: Any, generation: str, arch: str, mode: str) -> None:
    result = scenario("offline", "--arch", arch, "--mode", mode, "--prompts", str(NUM_PROMPTS))
    batch = result["batch"]
    assert batch["ok"], batch["problems"]
    assert batch["arrays"] == expected_arrays(models.mixed_prompts(NUM_PROMPTS, seed=1), arch, generation)
    assert batch["rows"] > 0 and batch["matched"] == batch["rows"]
    # The always-on check ran on every step of this in-process engine and found nothing (strict would raise).
    checked = result["sentinel"]
    assert checked["rows_checked"] > 0 and checked["zero_rows"] == 0 and checked["invalid_ids"] == 0, checked


@pytest.mark.parametrize(("arch", "mode"), RUNS)
def test_prefix_cache_repeat_identical(scenario: Any, arch: str, mode: str) -> None:
    repeat = scenario("offline", "--arch", arch, "--mode", mode, "--prompts", str(NUM_PROMPTS))["prefix_repeat"]
    assert repeat["cached_tokens"] > 0, "the repeated prompt was not served from the prefix cache"
    assert repeat["identical_to_first"]
    assert repeat["ok"], repeat["problems"]


@pytest.mark.parametrize(("arch", "mode"), RUNS)
def test_rows_sent_once(scenario: Any, arch: str, mode: str) -> None:
    """The bridge's dedup on the same engine's outputs: the two samples of the prefix-cached prompt share
    their prompt rows (replay.share_prompt: identical, held once), and a second turn of that conversation
    asks only for its new rows (0.22+: routed_experts_prompt_start) and keeps each row once (0.20.x: drops
    the rows held); the conversation's rows are the reference's for every token."""
    result = scenario("offline", "--arch", arch, "--mode", mode, "--prompts", str(NUM_PROMPTS))
    group = result["prefix_repeat"]["shared_prompt"]
    assert "error" not in group, group
    rows = scenarios.LONG_PROMPT + scenarios.MAX_TOKENS - 1
    assert group["rows_before"] == 2 * rows
    assert group["rows_after"] == scenarios.LONG_PROMPT + 2 * (scenarios.MAX_TOKENS - 1)
    assert group["bytes_after"] * group["rows_before"] == group["bytes_before"] * group["rows_after"]
    turn = result["multi_turn"]
    assert "error" not in turn, turn
    assert turn["ok"], turn["problems"]
    assert turn["rows"] == turn["matched"] > 0
    context = rows + 1 + 5  # the first turn's tokens and 5 new ones
    assert turn["rows_kept"] == context + scenarios.MAX_TOKENS - 1
    assert turn["rows_if_resent"] == rows + turn["rows_kept"]
    if turn["prompt_start"]:  # 0.22+: vLLM sends each row once
        assert turn["prompt_start"] == rows and turn["rows_received"] == turn["rows_kept"]
    print(
        f"{arch} {mode}: GRPO pair {group['rows_before']} -> {group['rows_after']} rows; two turns "
        f"{turn['rows_if_resent']} -> {turn['rows_received']} received, {turn['rows_kept']} kept, exact"
    )


@pytest.mark.parametrize(("arch", "mode"), RUNS)
def test_chunked_prefill_exact(scenario: Any, arch: str, mode: str) -> None:
    chunked = scenario("offline", "--arch", arch, "--mode", mode, "--prompts", str(NUM_PROMPTS))["chunked_prefill"]
    assert chunked["prompt_tokens"] > chunked["max_num_batched_tokens"]
    assert chunked["ok"], chunked["problems"]
    assert chunked["rows"] == (scenarios.LONG_PROMPT + scenarios.MAX_TOKENS - 1) * len(
        models.build_tiny_moe(arch, scenarios.model_dir() / arch).moe_layers
    )


def test_serve_openai_completions_exact(scenario: Any, generation: str) -> None:
    """Through `vllm serve` (multi-process engine: the plugin loads in the engine-core process too)."""
    if generation == "shm":
        pytest.skip("vLLM 0.20.x has no routed_experts field in its OpenAI API (nothing to return over HTTP)")
    # The front end's and engine core's processes are the generation's; the capture inside is the offline runs'.
    once_per_generation("the serve scenario", distributed.vllm_release())
    result = scenario("serve", "--arch", "mixtral", "--prompts", "4", in_process=False)["serve"]
    assert result["ok"], result["problems"]
    assert result["arrays"] == expected_arrays(models.mixed_prompts(4, seed=2), "mixtral", generation)


def test_plugin_off_leaves_vllm_alone(scenario: Any, generation: str) -> None:
    """Without VLLM_ASCEND_ROUTING nothing is patched and generation is unchanged.

    Where vLLM 0.20-0.27 pick their pure-PyTorch CPU MoE for this model on this CPU (no grouped-GEMM
    kernels in the wheel, or an AMX CPU with float32 weights; vLLM's own choice, asked by
    ``cpu_moe_choice``), vLLM alone crashes (the bug the plugin's CPU compat fix repairs): there
    "unchanged" means exactly that upstream crash. vLLM 0.31+ alone refuses the flag on the CPU build
    (its connector needs Model Runner V2, which needs Triton for the CPU).
    """
    args = ("offline", "--arch", "qwen3_moe", "--mode", "eager", "--prompts", str(NUM_PROMPTS))
    status, output = scenario.run_unchecked(*args, plugin=False)
    on = scenario(*args)
    if generation == "aux-output":
        assert status != 0 and "AuxOutput Connector requires Model Runner V2" in output, output[-3000:]
        assert on["runner_patched"] is True and on["batch"]["ok"]
        print("plugin off: vLLM alone refuses routed experts on the CPU build (needs Model Runner V2)")
        return
    if vllm_cpu_moe_kernel("qwen3_moe") is CpuMoeKernel.PURE_TORCH:
        assert status != 0, "vLLM alone ran its pure-PyTorch CPU MoE: is the compat fix still needed?"
        assert "Current vLLM config is not set" in output and "cpu_fused_moe_torch" in output, output[-3000:]
        assert "vllm-ascend-routing enabled" not in output and on["runner_patched"] is True
        print("plugin off: vLLM alone crashes in its pure-PyTorch CPU MoE (its choice on this CPU), as upstream")
        return
    assert status == 0, output[-3000:]
    off = json.loads(output.split("SCENARIO_RESULT ", 1)[1].splitlines()[0])
    assert off["runner_patched"] is False and on["runner_patched"] is True
    assert off["batch"]["output_ids"] == on["batch"]["output_ids"]
    print(f"plugin off: vLLM's own capture matched {off['batch']['matched']}/{off['batch']['rows']} rows")


def test_tensor_parallel_2_exact(scenario: Any, generation: str) -> None:
    """Two CPU workers (TP=2, multiprocess executor): rank 0's rows reach the user, exact."""
    result = scenario(
        "offline", "--arch", "qwen3_moe", "--mode", "eager", "--prompts", "4", "--tp", "2", in_process=False
    )
    assert result["tensor_parallel"] == 2
    for name in ("batch", "chunked_prefill", "prefix_repeat"):
        assert result[name]["ok"] and result[name]["matched"] == result[name]["rows"] > 0, (name, result[name])
