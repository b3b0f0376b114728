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
from vllm_ascend_routing.compat.interface import UnsupportedVllmError
from vllm_ascend_routing.compat.runner_output.adapter import RunnerOutputAdapter


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


V2_RUNNER_MODULE = "vllm.v1.worker.gpu.model_runner"  # vLLM's Model Runner V2, written out (not imported)


def _v2_runner(monkeypatch: pytest.MonkeyPatch, with_capture: bool | None) -> None:
    """vLLM's Model Runner V2 module as 0.28+ (``with_capture``), 0.26-0.27 (not) or 0.25 (``None``: absent)
    ship it: a class with or without ``init_routed_experts_capturer``."""
    monkeypatch.delitem(sys.modules, V2_RUNNER_MODULE, raising=False)
    if with_capture is None:
        monkeypatch.setitem(sys.modules, V2_RUNNER_MODULE, None)  # import fails: no such module
        return
    runner = type("GPUModelRunner", (), {"init_routed_experts_capturer": lambda self: None} if with_capture else {})
    module = ModuleType(V2_RUNNER_MODULE)
    module.GPUModelRunner = runner  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, V2_RUNNER_MODULE, module)


@pytest.mark.parametrize("with_capture", [False, None])
def test_model_runner_v2_without_capture_is_refused(monkeypatch: pytest.MonkeyPatch, with_capture: bool | None) -> None:
    from vllm_ascend_routing.compat.runner_output import adapter as runner_output

    _v2_runner(monkeypatch, with_capture)
    assert runner_output._v2_runner_captures() is False
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(enable_return_routed_experts=True), use_v2_model_runner=True
    )
    with pytest.raises(UnsupportedVllmError, match="Model Runner V2 has no routed-experts capture"):
        RunnerOutputAdapter().prepare(None, vllm_config, None)  # type: ignore[arg-type]


def test_model_runner_v2_with_capture_is_recognised(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_ascend_routing.compat.runner_output import adapter as runner_output

    _v2_runner(monkeypatch, with_capture=True)
    assert runner_output._v2_runner_captures() is True


@pytest.mark.vllm
def test_model_runner_v2_capture_on_the_installed_vllm() -> None:
    """On the real vLLM of a runner-output release: Model Runner V2 captures from 0.28.0 on (the refusal's
    claim), read from the installed source."""
    from vllm_ascend_routing import releases
    from vllm_ascend_routing.compat import _detect
    from vllm_ascend_routing.compat.runner_output import adapter as runner_output

    version = _detect.vllm_version()
    span = releases.generation_of(version)
    if span is None or span.generation is not releases.Generation.RUNNER_OUTPUT:
        pytest.skip(f"Model Runner V2's refusal is a runner-output (0.22-0.30) question; this is vLLM {version}")
    expected = releases.version_key(version) >= (0, 28, 0)
    assert runner_output._v2_runner_captures() is expected
