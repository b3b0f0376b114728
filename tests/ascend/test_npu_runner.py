# SPDX-License-Identifier: Apache-2.0
"""The plugin on vllm-ascend's real ``NPUModelRunner``: registered on the NPU platform, patched when the
worker imports the runner module, capturer created by the real ``init_routed_experts_capturer``, rows
handed off by vllm-ascend's own runner statements, over real MoE forwards — see ``npu_runner_step``.
Runs in a fresh process: the post-import patch must see the runner module's first import."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from vllm_ascend_routing.compat import get_api
from vllm_ascend_routing.compat.base import Generation

pytestmark = [pytest.mark.vllm, pytest.mark.ascend]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def steps() -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "tests.ascend.npu_runner_step"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-6000:]
    return json.loads(lines[-1].removeprefix("RESULT "))  # type: ignore[no-any-return]


def test_the_runner_is_patched_when_the_worker_imports_it(steps: dict[str, Any]) -> None:
    assert steps["imported_before_register"] is False
    assert steps["hooked"] == sorted(
        ["load_model", "execute_model", "init_routed_experts_capturer", "_bind_routed_experts_capturer"]
    )


def test_vllm_ascend_own_binder_and_capture_stay_off(steps: dict[str, Any]) -> None:
    assert steps["vllm_ascend_binder_ran"] is False  # its per-layer capturer attribute was never set
    if get_api().generation is Generation.SHM:
        assert steps["capturer"] == "ShmRoutedExpertsCapturer"
        assert steps["vllm_ascend_own_capturer"] == "None"  # its MoE method finds no capturer instance
    else:
        assert steps["capturer"] == "RoutedExpertsCapturer"  # vLLM's own, handed the plugin's buffer


def test_the_runner_source_has_the_routed_experts_statements_run(steps: dict[str, Any]) -> None:
    blocks = steps["blocks"]
    assert blocks["start"] and blocks["after"], blocks  # found in the real source, so they really ran
    if get_api().generation is not Generation.SHM:
        assert blocks["slots"], blocks


def test_every_step_hands_off_the_exact_rows(steps: dict[str, Any]) -> None:
    for step in steps["steps"]:
        num_tokens = len(step["slots"])
        if get_api().generation is Generation.SHM:
            assert step["stored_rows"] == step["expected"]
        else:
            assert step["shipped_dtype"] == "int16"
            assert step["shipped_rows"] == step["expected"]
            assert step["shipped_slots"] == step["slots"]
        assert all(row[1] == [0, 0] and row[3] == [0, 0] for row in step["expected"][:num_tokens])  # dense
