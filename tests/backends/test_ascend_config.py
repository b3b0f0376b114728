# SPDX-License-Identifier: Apache-2.0
"""Configurations that split a step's tokens across TP ranks before routing are recognised (not refused):
the capture then assembles the shards over TP (``parallel``; proven on vllm-ascend's source in
``tests/ascend/test_token_split.py``)."""

from __future__ import annotations

import sys
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from vllm_ascend_routing.backends import ascend_config
from vllm_ascend_routing.compat._common import rank_layout, refuse_unsupported_config
from vllm_ascend_routing.parallel import RankLayout


def config(tp: int, ep: bool = False, sp: bool = False, dp: int = 1, dp_rank: int = 0, sp_moe: bool = False) -> Any:
    return SimpleNamespace(
        parallel_config=SimpleNamespace(
            tensor_parallel_size=tp,
            enable_expert_parallel=ep,
            data_parallel_size=dp,
            data_parallel_rank=dp_rank,
            use_sequence_parallel_moe=sp_moe,
        ),
        compilation_config=SimpleNamespace(pass_config=SimpleNamespace(enable_sequence_parallelism=sp)),
        kv_transfer_config=None,
    )


@pytest.mark.parametrize(
    ("tp", "ep", "sp", "split"),
    [(1, True, True, False), (2, False, False, False), (2, True, False, True), (4, False, True, True)],
)
def test_token_splitting_layouts_are_recognised(tp: int, ep: bool, sp: bool, split: bool) -> None:
    assert ascend_config.splits_tokens(config(tp, ep, sp)) is split


def test_vllm_ascend_sequence_parallel_switch_is_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    utils = ModuleType("vllm_ascend.utils")
    utils.enable_sp = lambda vllm_config: True  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm_ascend.utils", utils)
    assert ascend_config.splits_tokens(config(2)) is True


def test_rank_layout_per_configuration(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "vllm_ascend", raising=False)
    assert rank_layout(config(1)) is None  # a single rank: the capture path is unchanged
    assert rank_layout(config(2, ep=True)) is None  # vLLM without DP: TP ranks route the whole batch
    assert rank_layout(config(1, dp=2, dp_rank=1)) == RankLayout(1, 1, False)
    assert rank_layout(config(2, ep=True, dp=2, sp_moe=True)) == RankLayout(0, 2, True)  # vLLM's SP MoE
    monkeypatch.setitem(sys.modules, "vllm_ascend", ModuleType("vllm_ascend"))
    assert rank_layout(config(2, ep=True)) == RankLayout(0, 2, True)  # vllm-ascend MC2 / all-to-all
    refuse_unsupported_config(config(2, ep=True, dp=2), "runner-output")  # no longer refused


def test_dual_batch_overlap_is_refused_naming_the_flag() -> None:
    from vllm_ascend_routing.compat.interface import UnsupportedVllmError

    overlapped = config(1)
    overlapped.parallel_config.enable_dbo = True  # micro-batches would overwrite each other's rows
    with pytest.raises(UnsupportedVllmError, match="--enable-dbo"):
        refuse_unsupported_config(overlapped, "aux-output")
