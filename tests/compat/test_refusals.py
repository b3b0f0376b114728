# SPDX-License-Identifier: Apache-2.0
"""The configurations every generation refuses at start-up (``compat/_common.refuse_unsupported_config``): each
parallel layout and KV transfer whose rows the plugin cannot place exactly, named in the message with what to
change; the layouts it serves pass."""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Any

import pytest

from vllm_ascend_routing.compat._common import refuse_unsupported_config
from vllm_ascend_routing.compat.interface import UnsupportedVllmError


def config(kv_transfer_config: Any = None, **parallel: Any) -> Any:
    """A vLLM config as the refusals read it: one engine, no KV transfer, unless overridden."""
    fields = {
        "pipeline_parallel_size": 1,
        "decode_context_parallel_size": 1,
        "prefill_context_parallel_size": 1,
        "tensor_parallel_size": 2,
        "data_parallel_size": 2,
        "enable_dbo": False,
        **parallel,
    }
    return SimpleNamespace(parallel_config=SimpleNamespace(**fields), kv_transfer_config=kv_transfer_config)


@pytest.fixture(autouse=True)
def no_vllm_ascend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "vllm_ascend", raising=False)  # its own refusals: tests/backends


def test_served_layouts_pass() -> None:
    refuse_unsupported_config(config(), "runner-output")  # TP 2 x DP 2: served
    refuse_unsupported_config(config(pipeline_parallel_size=None), "runner-output")  # unset reads as 1


@pytest.mark.parametrize(
    ("attr", "what"),
    [
        ("pipeline_parallel_size", "pipeline parallelism"),
        ("decode_context_parallel_size", "decode context parallelism"),
        ("prefill_context_parallel_size", "prefill context parallelism"),
    ],
)
@pytest.mark.parametrize("size", [2, 4])
def test_pipeline_and_context_parallelism_are_refused_naming_the_setting(attr: str, what: str, size: int) -> None:
    with pytest.raises(UnsupportedVllmError, match=rf"{what} \({attr}={size}\).*aux-output API; set {attr}=1"):
        refuse_unsupported_config(config(**{attr: size}), "aux-output")


def test_dual_batch_overlap_is_refused() -> None:
    with pytest.raises(UnsupportedVllmError, match="remove --enable-dbo"):
        refuse_unsupported_config(config(enable_dbo=True), "runner-output")


def test_a_kv_transfer_connector_is_refused() -> None:
    """A connector whose loaded tokens' rows the plugin does not carry (``kv``: any on 0.20/0.21, those that hand KV
    between instances without a carrier from 0.22) is refused at model load, naming it and what to change."""
    connector = SimpleNamespace(kv_connector="MooncakeConnector", kv_role="kv_both")
    with pytest.raises(UnsupportedVllmError, match="MooncakeConnector.*remove --kv-transfer-config"):
        refuse_unsupported_config(config(kv_transfer_config=connector), "shm", None)  # no kv_rows (0.20, 0.21)
    carrying: Any = SimpleNamespace(patches=())
    with pytest.raises(UnsupportedVllmError, match="MooncakeConnector.*is not covered.*remove --kv-transfer-config"):
        refuse_unsupported_config(config(kv_transfer_config=connector), "runner-output", carrying)
