# SPDX-License-Identifier: Apache-2.0
"""``python -m vllm_ascend_routing replay-check``: its verdict, and a real run on this release."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.harness import distributed
from tests.harness.generation_cases import once_per_generation
from tests.harness.vllm_cache import fresh_cache_root
from vllm_ascend_routing.preflight import replay_check


def mode(agreement: float, mean_abs: float, k3: float) -> dict[str, Any]:
    return {
        "routing_agreement": agreement,
        "rows": 100,
        "tokens": 50,
        "mean_abs_delta": mean_abs,
        "max_abs_delta": 3 * mean_abs,
        "k3": k3,
        "share_abs_delta_over_ln2": 0.0,
    }


def test_passes_only_on_full_agreement_and_strictly_lower_mismatch() -> None:
    ok, detail = replay_check.verdict({"natural": mode(0.98, 0.02, 6e-4), "replay": mode(1.0, 0.01, 1e-4)})
    assert ok and "k3 6.0x" in detail
    ok, detail = replay_check.verdict({"natural": mode(0.98, 0.02, 6e-4), "replay": mode(0.99, 0.01, 1e-4)})
    assert not ok and "agreement 99.00%" in detail
    ok, detail = replay_check.verdict({"natural": mode(0.98, 0.02, 6e-4), "replay": mode(1.0, 0.03, 1e-4)})
    assert not ok and "mean_abs_delta" in detail and "k3" not in detail.partition(";")[2]
    ok, detail = replay_check.verdict({"natural": mode(1.0, 1e-6, 1e-12), "replay": mode(1.0, 1e-6, 1e-12)})
    assert not ok and "already agrees" in detail


def test_report_prints_both_modes() -> None:
    result = {
        "arch": "qwen3_moe_dense",
        "num_layers": 3,
        "moe_layers": [0, 2],
        "num_experts": 8,
        "top_k": 2,
        "prompts": 8,
        "max_tokens": 32,
        "vllm": "0.23.0",
        "mode": "compiled",
        "dtype": "bfloat16",
        "natural": mode(0.984, 0.0186, 6.4e-4),
        "replay": mode(1.0, 0.0119, 1.1e-4),
    }
    rows = [line for line in replay_check.report(result) if line.startswith(("natural", "replay"))]
    assert [row.split()[0] for row in rows] == ["natural", "replay"]
    assert "98.40% (   98/  100 rows)" in rows[0] and "100.00% (  100/  100 rows)" in rows[1]
    assert "1.10e-04" in rows[1]


@pytest.mark.vllm
@pytest.mark.e2e
def test_replay_check_passes_on_this_release(tmp_path: Path) -> None:
    # What it adds to the offline runs (the arrays handed to a trainer, replayed) is the generation's output.
    once_per_generation("replay-check", distributed.vllm_release())
    env = {**os.environ, "VLLM_CACHE_ROOT": str(fresh_cache_root(tmp_path / "cache"))}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "vllm_ascend_routing",
            "replay-check",
            "--prompts",
            "4",
            "--max-tokens",
            "16",
            "--mode",
            "eager",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        cwd=tmp_path,
    )
    lines = done.stdout.splitlines()
    results = [
        json.loads(line.removeprefix(replay_check.RESULT)) for line in lines if line.startswith(replay_check.RESULT)
    ]
    assert done.returncode == 0 and len(results) == 1, done.stdout[-3000:] + done.stderr[-3000:]
    result = results[0]
    assert result["ok"] and result["moe_layers"] == [0, 2]
    assert result["replay"]["routing_agreement"] == 1.0 and result["natural"]["routing_agreement"] < 1.0
    rows = 2 * sum(len(prompt) + 16 - 1 for prompt in replay_check.prompts(4))  # 2 MoE layers, T - 1 rows each
    assert result["replay"]["rows"] == result["natural"]["rows"] == rows
    assert any(line.startswith(replay_check.VERDICT + "PASS") for line in lines)
