# SPDX-License-Identifier: Apache-2.0
"""xlite on vllm-ascend's real source: the switch the plugin reads is the one vllm-ascend's own config parser
reads, and an engine with it on is refused at start-up (the check runs where the MoE layers are bound, before
any forward). xlite's runner (``XliteModelRunner``) runs decode, and prefill in full mode, in xlite's native
runtime: no MoE Python runs there, so no plugin (nor vllm-ascend's own capture) can record those tokens."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any

import pytest

from tests.ascend.conftest import ASCEND_SRC
from vllm_ascend_routing.backends import ascend_config
from vllm_ascend_routing.compat._common import refuse_unsupported_config
from vllm_ascend_routing.compat.interface import UnsupportedVllmError

pytestmark = [pytest.mark.vllm, pytest.mark.ascend]

XLITE = {"xlite_graph_config": {"enabled": True, "full_mode": False}}


def vllm_config(additional: dict[str, Any]) -> Any:
    from vllm.config import VllmConfig

    config = VllmConfig()
    config.additional_config = additional
    return config


def vllm_ascend_reads_xlite(monkeypatch: pytest.MonkeyPatch, config: Any) -> bool:
    """vllm-ascend's own parse of ``additional_config`` (``init_ascend_config``, as its platform runs it); its
    process-wide config is put back afterwards."""
    module = importlib.import_module("vllm_ascend.ascend_config")
    monkeypatch.setattr(module, "_ASCEND_CONFIG", None)  # parsed afresh (it keeps the first one otherwise)
    module.init_ascend_config(config)
    return bool(module.get_ascend_config().xlite_graph_config.enabled)


def test_the_release_has_the_xlite_runner() -> None:
    assert ASCEND_SRC
    spec = importlib.util.find_spec("vllm_ascend")
    assert spec is not None and spec.submodule_search_locations
    runner = Path(list(spec.submodule_search_locations)[0]) / "xlite" / "xlite_model_runner.py"
    assert "class XliteModelRunner(NPUModelRunner)" in runner.read_text()


def test_the_switch_is_vllm_ascends_and_xlite_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    on, off = vllm_config(XLITE), vllm_config({})
    assert vllm_ascend_reads_xlite(monkeypatch, on) is True
    assert vllm_ascend_reads_xlite(monkeypatch, off) is False
    assert ascend_config.xlite_enabled(on) is True and ascend_config.xlite_enabled(off) is False
    with pytest.raises(UnsupportedVllmError, match="xlite graph mode"):
        refuse_unsupported_config(on, "runner-output")
    refuse_unsupported_config(off, "runner-output")  # ACL graph modes and eager: not refused
