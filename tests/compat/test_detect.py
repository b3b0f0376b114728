# SPDX-License-Identifier: Apache-2.0
"""Generation detection against fake vLLM module trees (no vLLM install needed)."""

from __future__ import annotations

import dataclasses
import re
import sys
import types

import pytest

from vllm_ascend_routing import releases
from vllm_ascend_routing.compat import _detect
from vllm_ascend_routing.compat.interface import SUPPORTED_RELEASES, Generation, UnsupportedVllmError

CAPTURER = "vllm.model_executor.layers.fused_moe.routed_experts_capturer"


def fake_vllm(
    monkeypatch: pytest.MonkeyPatch, version: str, capturer: list[str], outputs: list[str], aux: bool = False
) -> None:
    for name in list(sys.modules):
        if name == "vllm" or name.startswith("vllm."):
            monkeypatch.delitem(sys.modules, name)
    vllm = types.ModuleType("vllm")
    vllm.__version__ = version  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    mod = types.ModuleType(CAPTURER)
    for name in capturer:
        setattr(mod, name, object())
    monkeypatch.setitem(sys.modules, CAPTURER, mod)
    out = types.ModuleType("vllm.v1.outputs")
    for name in outputs:
        setattr(out, name, object())
    monkeypatch.setitem(sys.modules, "vllm.v1.outputs", out)
    if aux:
        monkeypatch.setitem(
            sys.modules,
            "vllm.distributed.aux_output_connector",
            types.ModuleType("vllm.distributed.aux_output_connector"),
        )
    else:  # make the import fail like on a release without it
        monkeypatch.setitem(sys.modules, "vllm.distributed.aux_output_connector", None)
    monkeypatch.setenv("VLLM_ASCEND_ROUTING_VLLM_API", "auto")


@pytest.mark.parametrize(
    ("version", "capturer", "outputs", "aux", "expected"),
    [
        ("0.20.2", ["RoutedExpertsCapturer", "RoutedExpertsReader"], [], False, Generation.SHM),
        (
            "0.23.0",
            ["RoutedExpertsCapturer", "RoutedExpertsManager"],
            ["RoutedExpertsLists"],
            False,
            Generation.RUNNER_OUTPUT,
        ),
        (
            "0.30.0",
            ["RoutedExpertsManager", "bind_routed_experts_capturer"],
            ["RoutedExpertsLists"],
            False,
            Generation.RUNNER_OUTPUT,
        ),
        ("0.32.0", ["RoutedExpertsCapturer"], [], True, Generation.AUX_OUTPUT),
        # Features win over the version string (a source build of main calling itself 0.23.0).
        ("0.23.0+dev", ["RoutedExpertsCapturer"], [], True, Generation.AUX_OUTPUT),
        # No recognisable feature: the version decides.
        ("0.25.1", [], [], False, Generation.RUNNER_OUTPUT),
    ],
    ids=["0.20.2-shm", "0.23-runner-output", "0.30-runner-output", "0.32-aux", "features-win", "version-tiebreak"],
)
def test_detection(
    monkeypatch: pytest.MonkeyPatch,
    version: str,
    capturer: list[str],
    outputs: list[str],
    aux: bool,
    expected: Generation,
) -> None:
    fake_vllm(monkeypatch, version, capturer, outputs, aux)
    assert _detect.detect_generation() is expected


V021_CAPTURER = ["bind_routing_capture_to_model", "split_routed_experts", "RoutedExpertsCapturer"]


def test_0_21_is_the_device_cache_generation(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_vllm(monkeypatch, "0.21.0", V021_CAPTURER, [])
    assert _detect.detect_generation() is Generation.DEVICE_CACHE


def test_a_refused_generation_is_refused_naming_supported_releases(monkeypatch: pytest.MonkeyPatch) -> None:
    refused = dataclasses.replace(releases.span_of(Generation.DEVICE_CACHE), supported=False, delete_when="reverted")
    table = tuple(refused if span.generation is refused.generation else span for span in releases.GENERATIONS)
    monkeypatch.setattr(releases, "GENERATIONS", table)
    fake_vllm(monkeypatch, "0.21.0", V021_CAPTURER, [])
    supported = re.escape(SUPPORTED_RELEASES)  # "0.20.0-<newest>", from releases.py
    with pytest.raises(UnsupportedVllmError, match=rf"0\.21\.0.*device-cache.*reverted.*{supported}"):
        _detect.detect_generation()


def test_unknown_release_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_vllm(monkeypatch, "0.19.1", [], [])
    with pytest.raises(UnsupportedVllmError, match=r"vLLM 0\.19\.1 .*Supported releases"):
        _detect.detect_generation()


def test_missing_vllm_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)
    monkeypatch.setenv("VLLM_ASCEND_ROUTING_VLLM_API", "auto")
    with pytest.raises(UnsupportedVllmError, match="vLLM is not importable"):
        _detect.detect_generation()


def test_env_override(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_vllm(monkeypatch, "0.23.0", ["RoutedExpertsManager"], ["RoutedExpertsLists"])
    monkeypatch.setenv("VLLM_ASCEND_ROUTING_VLLM_API", "shm")
    assert _detect.detect_generation() is Generation.SHM


def test_aux_output_generation_gets_its_adapter(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_ascend_routing import compat
    from vllm_ascend_routing.compat.aux_output.adapter import AuxOutputAdapter

    fake_vllm(monkeypatch, "0.32.0", ["RoutedExpertsCapturer"], [], aux=True)
    compat.adapter.cache_clear()
    try:
        api = compat.adapter()
        assert isinstance(api, AuxOutputAdapter)
        assert api.generation is Generation.AUX_OUTPUT
    finally:
        compat.adapter.cache_clear()
