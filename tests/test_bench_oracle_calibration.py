# SPDX-License-Identifier: Apache-2.0
"""``benchmarks/oracle_calibration.py`` (make bench-oracle): its statistics on synthetic oracle results: per-layer
rates split into prompt and decode rows, the per-token histogram against independence, and a cascade of near-ties
in one token: named by the tail alone, measured as its share of the layers, passed by the oracle as shipped."""

from __future__ import annotations

import numpy as np
import pytest

from tests import scripts
from tests.preflight.test_token_faults import deep_truth, isolated_flips, pairs
from vllm_ascend_routing.preflight import consistency

calibration = scripts.load("benchmarks/oracle_calibration.py", "_bench_oracle_calibration")


def test_rates_split_into_prompt_and_decode_rows_and_the_histogram_counts_every_token() -> None:
    rows, prompts = deep_truth(1)
    reprefill = [r.copy() for r in rows]
    reprefill[0][prompts[0] + 2, 3, -1] = np.setdiff1d(np.arange(64), rows[0][prompts[0] + 2, 3])[0]  # a decode row
    reprefill[2][7, 3, -1] = np.setdiff1d(np.arange(64), rows[2][7, 3])[0]  # a prompt row
    found = calibration.summarise([consistency.analyse(pairs(rows, reprefill, prompts), "float32")])
    layer = found["layers"][3]
    tokens = sum(len(r) for r in rows)
    decode = sum(len(r) - p for r, p in zip(rows, prompts, strict=True))
    assert layer["rows"] == tokens and layer["rate"] == 2 / tokens
    assert layer["prompt_rate"] == 1 / (tokens - decode) and layer["decode_rate"] == 1 / decode
    assert all(row["rate"] == 0 for i, row in enumerate(found["layers"]) if i != 3)
    assert found["disagreeing_layers_observed"][:2] == [tokens - 2, 2] and found["tokens"] == tokens
    assert abs(sum(found["disagreeing_layers_expected"]) - tokens) < 1e-6
    assert found["false_alarms"] == [] and found["tail_alone"] == [] and found["failing_runs"] == 0
    assert found["worst_row_class_rate"] == 1 / decode  # the decode row's layer 3, over decode rows alone
    assert found["suggested_budget"] == round(1.25 / decode, 4)


def test_a_cascade_in_one_token_is_measured_against_the_whole_token_share() -> None:
    """Independent near-ties at 1%, and one token whose flip carries on through 6 of 24 layers: the tail alone
    names it (6 layers are more than independent near-ties explain), it holds 6/24 of the layers, below
    WHOLE_TOKEN: the oracle as shipped passes the run."""
    rows, prompts = deep_truth(2)
    reprefill = isolated_flips(rows, np.full(24, 0.01), 64, seed=2)
    reprefill[4][30, 10:16, -1] = [np.setdiff1d(np.arange(64), rows[4][30, layer])[0] for layer in range(10, 16)]
    result = consistency.analyse(pairs(rows, reprefill, prompts), "bfloat16")
    found = calibration.summarise([result])
    assert [(f["request"], f["row"], f["kind"]) for f in found["tail_alone"]] == [("4", 30, "any")]
    assert found["largest_share"] == 6 / 24 < found["whole_token"]
    assert found["false_alarms"] == [] and found["failing_runs"] == 0, result.summary()
    lines = calibration.report({**found, "dtype": "bfloat16", "device": "cpu", "vllm": "x"})
    assert any(line.startswith("  tokens disagreeing in k MoE layers") for line in lines)
    assert any("tail alone: request 4 token 30" in line for line in lines)


def test_sensitivity_plants_each_first_decode_row_and_each_fault_on_the_runs_rows() -> None:
    rows, prompts = deep_truth(3)
    reprefill = isolated_flips(rows, np.full(24, 0.01), 64, seed=3)
    found = calibration.sensitivity(pairs(rows, reprefill, prompts), "bfloat16")
    assert found["single_rows_planted"] == len(rows) == found["single_rows_named"], found["missed"]
    assert found["mutations"] == 6 == found["mutations_named"], found["missed"]


def test_sensitivity_counts_what_an_oracle_blind_to_single_rows_misses(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the per-token analysis naming nothing (the oracle before #51), every planted row is missed."""
    from vllm_ascend_routing.preflight import token_faults

    monkeypatch.setattr(token_faults, "find", lambda *args, **kwargs: ([], {}))
    rows, prompts = deep_truth(3)
    found = calibration.sensitivity(pairs(rows, [r.copy() for r in rows], prompts), "bfloat16")
    assert found["single_rows_named"] == 0 and len(found["missed"]) >= len(rows)
