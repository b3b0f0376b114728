# SPDX-License-Identifier: Apache-2.0
"""The start-up check of the row store, the request option that asks for rows inline, and the setting's forms."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from vllm_ascend_routing import store
from vllm_ascend_routing.compat import adapter_class
from vllm_ascend_routing.context import InstallContext
from vllm_ascend_routing.errors import UnsupportedVllmError
from vllm_ascend_routing.output import frontend, options
from vllm_ascend_routing.output.serving import _finished_arrays
from vllm_ascend_routing.releases import Generation
from vllm_ascend_routing.store import setting, shm


def context(generation: Generation, vllm: str) -> InstallContext:
    return InstallContext(adapter_class(generation), "cpu", vllm)


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(store, "_checked", set())
    monkeypatch.setattr(shm.ShmBackend.__init__, "__defaults__", (str(tmp_path),))


@pytest.mark.parametrize(("generation", "vllm"), [(Generation.SHM, "0.20.2"), (Generation.DEVICE_CACHE, "0.21.0")])
def test_a_release_without_per_request_rows_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch, generation: Generation, vllm: str
) -> None:
    monkeypatch.setenv("VLLM_ASCEND_ROUTING_STORE", "shm")
    with pytest.raises(UnsupportedVllmError, match=f"needs vLLM 0.22 or later; vLLM {vllm}'s"):
        store.install(context(generation, vllm))


@pytest.mark.parametrize(
    ("generation", "vllm"), [(Generation.RUNNER_OUTPUT, "0.30.0"), (Generation.AUX_OUTPUT, "0.32.0")]
)
def test_served_releases_start_and_without_a_store_nothing_is_checked(
    monkeypatch: pytest.MonkeyPatch, generation: Generation, vllm: str
) -> None:
    monkeypatch.delenv("VLLM_ASCEND_ROUTING_STORE", raising=False)
    store.install(context(Generation.SHM, "0.20.2"))  # no store: nothing refused anywhere
    monkeypatch.setenv("VLLM_ASCEND_ROUTING_STORE", "shm")
    store.install(context(generation, vllm))
    assert store._checked == {"shm"}


def test_an_unusable_store_is_refused_at_start_up(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("VLLM_ASCEND_ROUTING_STORE", "shm")
    monkeypatch.setattr(shm.ShmBackend.__init__, "__defaults__", (str(tmp_path / "no-such-folder"),))
    with pytest.raises(UnsupportedVllmError, match="cannot be used: .*is not a folder"):
        store.install(context(Generation.RUNNER_OUTPUT, "0.30.0"))


@pytest.mark.parametrize("value", ["redis://x", "SHM ", "mooncake:/nohost", "file:///tmp"])
def test_a_setting_of_another_form_names_the_forms(value: str) -> None:
    with pytest.raises(ValueError, match="VLLM_ASCEND_ROUTING_STORE"):
        setting.current(value)


def test_the_transport_option() -> None:
    assert options.parse({"routed_experts_transport": "inline"}).inline
    assert options.parse({"routed_experts_transport": "store", "routed_experts_omit": 3}).transport == "store"
    assert not options.parse({"return_routed_experts": True}).inline
    with pytest.raises(options.RequestOptionError, match="routed_experts_transport='rdma'"):
        options.parse({"routed_experts_transport": "rdma"})
    asks_store = options.parse({"routed_experts_transport": "store"})
    with pytest.raises(options.RequestOptionError, match="no row store"):
        frontend.check(asks_store, "runner-output", True, True, stores=False)
    frontend.check(asks_store, "runner-output", True, True, stores=True)
    frontend.check(options.parse({"routed_experts_transport": "inline"}), "runner-output", True, True, stores=False)


def test_a_streamed_choice_with_a_key_and_no_rows_gets_its_record() -> None:
    keyed = SimpleNamespace(
        index=0, finish_reason="length", routed_experts=None, routed_experts_info={"store_key": "k"}
    )
    bare = SimpleNamespace(index=1, finish_reason="length", routed_experts=None, routed_experts_info=None)
    running = SimpleNamespace(index=2, finish_reason=None, routed_experts=None, routed_experts_info={"x": 1})
    found = _finished_arrays((0, SimpleNamespace(outputs=[keyed, bare, running])), True, 3)
    assert found == {0: keyed}
