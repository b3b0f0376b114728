# SPDX-License-Identifier: Apache-2.0
"""The registry of features (``features.FEATURES``): every feature has the same surface, the manifest and the
installation read the one list, and what a feature needs of the adapter decides both."""

from __future__ import annotations

from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from vllm_ascend_routing import compat, features, manifest
from vllm_ascend_routing.context import InstallContext, satisfied
from vllm_ascend_routing.features import FEATURES, Feature
from vllm_ascend_routing.patching import Patch
from vllm_ascend_routing.releases import Generation


def test_every_feature_has_the_same_surface_and_one_place() -> None:
    names = [feature.name for feature in FEATURES]
    assert len(set(names)) == len(names) and names[0] == "capture"  # the runner hooks first: they bind at load
    modules = [feature.module for feature in FEATURES]
    assert len({id(module) for module in modules}) == len(modules)
    for feature in FEATURES:
        assert isinstance(feature.patches, tuple) and all(isinstance(row, Patch) for row in feature.patches)
        assert isinstance(feature.needs, tuple) and callable(feature.module.install), feature.name


def test_capabilities_decide_which_rows_apply() -> None:
    """A feature's rows apply only where the adapter has what the feature and the row need; the output features'
    record rows (``per_request_output``) and the KV rows (``kv_rows``) only on 0.22+."""
    shm, runner_output = compat.adapter_class(Generation.SHM), compat.adapter_class(Generation.RUNNER_OUTPUT)
    assert shm is not None and runner_output is not None
    for feature in FEATURES:
        old = {row.target for row in features.rows_of(feature, shm, "cpu")}
        new = {row.target for row in features.rows_of(feature, runner_output, "cpu")}
        needing = {row.target for row in feature.patches if row.needs or feature.needs}
        assert not old & needing, f"{feature.name}: rows needing a capability shm lacks"
        if feature.name in ("KV rows", "weight versions", "HTTP serving"):
            assert new and not old
    targets = {row.target for row in manifest.patches_for(Generation.SHM, "cpu")}
    assert "vllm.v1.engine.input_processor:InputProcessor.process_inputs" in targets  # the options check: everywhere
    assert "vllm.v1.core.sched.scheduler:Scheduler.update_from_output" not in targets


def test_satisfied_reads_capabilities_as_truth() -> None:
    adapter = SimpleNamespace(per_request_output=True, kv_rows=None)
    assert satisfied(adapter, ()) and satisfied(adapter, ("per_request_output",))
    assert not satisfied(adapter, ("kv_rows",)) and not satisfied(adapter, ("per_request_output", "kv_rows"))
    assert not satisfied(adapter, ("no_such_capability",))


def test_integration_installs_exactly_the_served_features_in_the_registrys_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from vllm_ascend_routing import integration

    installed: list[str] = []

    def feature(name: str, needs: tuple[str, ...]) -> Feature:
        module = ModuleType(name)
        module.PATCHES = ()  # type: ignore[attr-defined]
        module.NEEDS = needs  # type: ignore[attr-defined]
        module.install = lambda ctx: installed.append(name)  # type: ignore[attr-defined]
        return Feature(name, module)

    registry = (feature("first", ()), feature("per-request", ("per_request_output",)), feature("last", ()))
    adapter: Any = SimpleNamespace(
        generation=Generation.SHM, runner_classes={"cpu": ()}, per_request_output=False, kv_rows=None
    )
    monkeypatch.setattr(integration, "FEATURES", registry)
    monkeypatch.setattr(integration.compat, "adapter", lambda: adapter)
    monkeypatch.setattr(integration.manifest, "verify", lambda *args: [])
    monkeypatch.setattr(integration, "vllm_version", lambda: "0.20.2")
    import sys

    monkeypatch.setitem(
        sys.modules, "vllm.platforms", SimpleNamespace(current_platform=SimpleNamespace(device_type="cpu"))
    )
    integration.install()
    assert installed == ["first", "last"]  # the adapter lacks per_request_output
    adapter.per_request_output = True
    installed.clear()
    integration.install()
    assert installed == ["first", "per-request", "last"]


def test_the_context_carries_the_adapter_to_every_feature() -> None:
    adapter = object()
    ctx = InstallContext(adapter, "cpu", "0.30.0")
    assert ctx.adapter is adapter and ctx.verify("vllm_ascend") is None  # no later package to verify by default
