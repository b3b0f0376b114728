# SPDX-License-Identifier: Apache-2.0
"""vllm-ascend configurations whose routing no hook can see are refused (xlite), only with vllm-ascend loaded;
Model Runner V2 without routed-experts capture is refused on the runner-output generation."""

from __future__ import annotations

import sys
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from vllm_ascend_routing import backends
from vllm_ascend_routing.backends import ascend_config
from vllm_ascend_routing.compat.base import UnsupportedVllmError
from vllm_ascend_routing.compat.runner_output import RunnerOutputAPI


def config(additional: Any) -> Any:
    return SimpleNamespace(additional_config=additional)


@pytest.mark.parametrize(
    ("additional", "on"),
    [
        ({"xlite_graph_config": {"enabled": True}}, True),
        ({"xlite_graph_config": {"enabled": True, "full_mode": True}}, True),
        ({"xlite_graph_config": {"enabled": False}}, False),
        ({"xlite_graph_config": SimpleNamespace(enabled=True)}, True),
        ({}, False),
        (None, False),
    ],
)
def test_xlite_switch(additional: Any, on: bool) -> None:
    assert ascend_config.xlite_enabled(config(additional)) is on


def test_xlite_is_refused_only_where_vllm_ascend_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    xlite = config({"xlite_graph_config": {"enabled": True}})
    monkeypatch.delitem(sys.modules, "vllm_ascend", raising=False)
    backends.refuse_unsupported_config(xlite)  # no vllm-ascend: the key means nothing
    monkeypatch.setitem(sys.modules, "vllm_ascend", ModuleType("vllm_ascend"))
    with pytest.raises(UnsupportedVllmError, match="xlite graph mode .* routed experts would be zeros"):
        backends.refuse_unsupported_config(xlite)
    backends.refuse_unsupported_config(config({}))


def test_model_runner_v2_without_capture_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_ascend_routing.compat import runner_output

    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(enable_return_routed_experts=True), use_v2_model_runner=True
    )
    monkeypatch.setattr(runner_output, "_v2_runner_captures", lambda: False)
    with pytest.raises(UnsupportedVllmError, match="Model Runner V2 has no routed-experts capture"):
        RunnerOutputAPI().prepare(None, vllm_config, None)  # type: ignore[arg-type]
