# SPDX-License-Identifier: Apache-2.0
"""Configurations that split a step's tokens across TP ranks before vllm-ascend routes are refused."""

from __future__ import annotations

import sys
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from vllm_ascend_routing.backends import ascend, refusal
from vllm_ascend_routing.compat._common import refuse_unsupported_config
from vllm_ascend_routing.compat.base import UnsupportedVllmError


def config(tp: int, ep: bool = False, sp: bool = False) -> Any:
    return SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, enable_expert_parallel=ep),
        compilation_config=SimpleNamespace(pass_config=SimpleNamespace(enable_sequence_parallelism=sp)),
        kv_transfer_config=None,
    )


@pytest.mark.parametrize(
    ("tp", "ep", "sp", "refused"),
    [(1, True, True, False), (2, False, False, False), (2, True, False, True), (4, False, True, True)],
)
def test_token_splitting_layouts_are_refused(tp: int, ep: bool, sp: bool, refused: bool) -> None:
    reason = ascend.check_config(config(tp, ep, sp))
    assert (reason is not None) == refused
    if refused:
        assert f"tensor_parallel_size={tp}" in str(reason)


def test_vllm_ascend_sequence_parallel_switch_is_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    utils = ModuleType("vllm_ascend.utils")
    utils.enable_sp = lambda vllm_config: True  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm_ascend.utils", utils)
    assert "sequence parallelism" in str(ascend.check_config(config(2)))


def test_start_up_refusal_only_with_vllm_ascend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "vllm_ascend", raising=False)
    assert refusal(config(2, ep=True)) is None  # CUDA/CPU: experts are not split this way
    monkeypatch.setitem(sys.modules, "vllm_ascend", ModuleType("vllm_ascend"))
    with pytest.raises(UnsupportedVllmError, match="drop --enable-expert-parallel"):
        refuse_unsupported_config(config(2, ep=True), "runner-output")
