# SPDX-License-Identifier: Apache-2.0
"""Token-split layouts on vllm-ascend's real source: 3 real processes in a gloo group, each a TP rank
running every real MoE method's ``apply`` (and its ``select_experts``) on its TP shard, split by vllm-ascend's
own MC2 / all-to-all ``prepare`` or arriving split as flash-comm leaves it (``token_split_rank``). The plugin
assembles the shards over vLLM's TP group inside the step: on every rank the buffer equals the unsplit
step's router top-k, for batches smaller than the TP size, uneven all-to-all splits and padded MC2 ones.
The same processes as DP ranks (``dp-eager`` / ``dp-padded``): vllm-ascend's real all-gather ``prepare`` pads
each rank's tokens to the widest and gathers them before routing; every rank keeps exactly its own rows, with
the forward context's counts raw (eager) or padded to the widest (vllm-ascend's graph-mode formula)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.harness.server import free_port

pytestmark = [pytest.mark.vllm, pytest.mark.ascend]

ROOT = Path(__file__).resolve().parents[2]


def run_ranks(world: int) -> list[dict[str, Any]]:
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.ascend.token_split_rank", str(rank), str(world), str(port)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
        )
        for rank in range(world)
    ]
    results = []
    for proc in procs:
        output, _ = proc.communicate(timeout=600)
        lines = [line for line in output.splitlines() if line.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, output[-6000:]
        results.append(json.loads(lines[-1].removeprefix("RESULT ")))
    return results


# 3 ranks, not 2 or 4: with 3, the last rank's offset is the sum of two uneven shards before it (with 2 it is
# rank 0's size, which a wrong formula also gets right), 1- and 2-token batches are smaller than the TP size, and
# MC2 pads to a multiple of 3, not of a power of two. Each rank imports vLLM and vllm-ascend (about 15 s of CPU):
# a fourth rank added nothing these do not check, for about 15 s per Ascend release.
@pytest.mark.parametrize("world", [3])
def test_every_rank_holds_the_whole_step(world: int) -> None:
    results = run_ranks(world)
    assert [r["rank"] for r in results] == list(range(world))
    for result in results:
        for mode in ("mc2", "alltoall", "flashcomm", "dp-eager", "dp-padded"):
            assert result[mode], f"no MoE method ran in {mode}"
            wrong = {method: [n for n, ok in counts.items() if not ok] for method, counts in result[mode].items()}
            assert not any(wrong.values()), (result["rank"], mode, wrong)
