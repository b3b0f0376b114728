# SPDX-License-Identifier: Apache-2.0
"""Against the installed vLLM (release venvs): the CPU compat fix, generation detection, and start-up
verification of every patch target (one release per generation runs this in ``make test``)."""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Iterator

import pytest
import torch

from vllm_ascend_routing import _cpu_compat, integration, kv, manifest, patching
from vllm_ascend_routing.compat import UnsupportedVllmError
from vllm_ascend_routing.compat import adapter as get_adapter
from vllm_ascend_routing.kv import registry, shared
from vllm_ascend_routing.output import serving
from vllm_ascend_routing.patching import RELY, Patch, resolve
from vllm_ascend_routing.preflight import findings
from vllm_ascend_routing.releases import Generation, generation_of

pytestmark = pytest.mark.vllm

# vLLM's KV connectors reviewed as stores, offload tiers or connectors that load nothing from another instance: served
# (rows of KV the instance computed held in its scheduler; ExampleConnector's carried beside its KV); and NIXL's pull
# mode (NixlConnector, NixlPullConnector: rows carried in its kv_transfer_params). MooncakeConnector is served with a
# row store and a secret only (kv.registry.NEEDS_STORE). A connector a later vLLM adds fails
# test_every_kv_connector_this_vllm_registers_is_classified until it is put here or in kv.REFUSED (it hands KV between
# instances).
SERVED_CONNECTORS = frozenset(
    {
        "ExampleConnector",
        "ExampleHiddenStatesConnector",
        "LMCacheConnectorV1",
        "LMCacheMPConnector",
        "MultiConnector",
        "HiSparseConnector",
        "OffloadingConnector",
        "DecodeBenchConnector",
        "MooncakeStoreConnector",
        "FlexKVConnectorV1",
        "SimpleCPUOffloadConnector",
        "HF3FSKVConnector",
        "NixlConnector",
        "NixlPullConnector",
    }
)


def test_silu_entry_replaced_and_callable_outside_config_context() -> None:
    try:
        cpu_fused_moe = importlib.import_module("vllm.model_executor.layers.fused_moe.cpu_fused_moe")
    except ImportError:
        cpu_fused_moe = None
    table = getattr(cpu_fused_moe, "_CPU_MOE_ACT_FN", None)
    if cpu_fused_moe is None or table is None:  # releases without the faulty table (0.28+)
        assert _cpu_compat.apply() is False
        return
    silu = cpu_fused_moe.MoEActivation.SILU
    original = table[silu]
    x = torch.randn(5, 8)
    if original is not cpu_fused_moe.SiluAndMul.forward_native:
        with pytest.raises(AssertionError, match="config is not set"):  # the crash the fix exists for
            original(x)
    try:
        _cpu_compat.apply()
        assert _cpu_compat.apply() is False  # idempotent: nothing left to change
        # No vLLM config context is set here, exactly as at forward time inside the engine.
        got = table[silu](x)
        torch.testing.assert_close(got, torch.nn.functional.silu(x[:, :4]) * x[:, 4:], rtol=0, atol=0)
    finally:
        table[silu] = original


def test_a_layer_on_the_pure_pytorch_moe_turns_the_compile_cache_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's pure-PyTorch CPU MoE (0.20-0.27) bakes ``id(layer)`` into the graph it caches: where a layer takes that
    path, the process compiles afresh, unless the environment chose (a restart with a warm cache: KeyError)."""
    try:
        owner = resolve(_cpu_compat.TORCH_PATH.target.rpartition(".")[0])
    except LookupError:  # 0.28+: layers keyed by name
        assert _cpu_compat.apply() is False
        return
    original = vars(owner)["init_moe_torch"]
    monkeypatch.delenv(_cpu_compat.COMPILE_CACHE, raising=False)
    layer = torch.nn.Module()
    layer.w13_weight = torch.nn.Parameter(torch.randn(2, 8, 4), requires_grad=False)  # [experts, 2 x inter, hidden]
    layer.w2_weight = torch.nn.Parameter(torch.randn(2, 4, 4), requires_grad=False)  # [experts, hidden, inter]
    try:
        _cpu_compat.apply()
        assert _cpu_compat.apply() is False  # idempotent
        owner.init_moe_torch(object.__new__(owner), layer)
        assert os.environ[_cpu_compat.COMPILE_CACHE] == "1"
        monkeypatch.setenv(_cpu_compat.COMPILE_CACHE, "0")  # the user's choice stays
        owner.init_moe_torch(object.__new__(owner), layer)
        assert os.environ[_cpu_compat.COMPILE_CACHE] == "0"
    finally:
        owner.init_moe_torch = original


def test_features_detect_the_generation_of_this_release() -> None:
    import vllm

    span = generation_of(vllm.__version__)  # the release table
    assert span is not None and get_adapter().generation is span.generation


def _vllm_rows() -> list[Patch]:
    return [patch for patch in manifest.patches_for(get_adapter().generation, "cpu") if patch.package == "vllm"]


def _engine_rows() -> list[Patch]:
    """The rows an engine verifies at start-up: all but the server's (``serving.SERVING``), which are verified when
    vLLM's API server imports their modules (``test_the_servers_targets_are_verified_when_it_imports_them``)."""
    return [patch for patch in _vllm_rows() if patch.feature != serving.SERVING]


def _remove(monkeypatch: pytest.MonkeyPatch, target: str) -> None:
    """Make ``target`` absent, as a release that renamed it would: deleted wherever it is defined (a
    constructor: replaced by one without the parameters the plugin relies on)."""
    module_name, _, qualname = target.partition(":")
    owner_path, _, name = qualname.rpartition(".")
    owner = resolve(f"{module_name}:{owner_path}") if owner_path else importlib.import_module(module_name)
    if name == "__init__":  # cannot be absent: a release that changed it drops a parameter the plugin relies on
        monkeypatch.setattr(owner, name, lambda self, *args, **kwargs: None)
        return
    holders = [klass for klass in owner.__mro__ if name in vars(klass)] if isinstance(owner, type) else [owner]
    if not holders or not hasattr(owner, name):
        raise LookupError(f"{target} is absent in this release")
    for holder in holders:
        monkeypatch.delattr(holder, name)


@pytest.fixture
def nothing_patched(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # A refused start-up must patch nothing: fail the test if the adapter's install is reached.
    monkeypatch.setattr(type(get_adapter()), "install", lambda self: pytest.fail("patched before verification"))
    yield


def test_start_up_verifies_every_target_of_this_generation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ASCEND_ROUTING_VALIDATE", "strict")
    findings = manifest.verify(get_adapter().generation, "cpu")
    assert [f.patch.target for f in findings if f.problem] == []
    assert {f.patch.target for f in findings} == {p.target for p in _engine_rows()}
    assert any(f.present and f.patch.target.endswith(".load_model") for f in findings)


def test_each_required_target_removed_is_refused_at_start_up_by_name(
    monkeypatch: pytest.MonkeyPatch, nothing_patched: None
) -> None:
    monkeypatch.setenv("VLLM_ASCEND_ROUTING_VALIDATE", "strict")  # its targets are checked too
    required = [patch for patch in _engine_rows() if patch.required]
    assert len(required) >= 8
    for patch in required:
        with monkeypatch.context() as removed:
            _remove(removed, patch.target)
            with pytest.raises(UnsupportedVllmError) as refused:
                integration.install()
        message = str(refused.value)
        assert patch.target.partition(":")[2].rsplit(".", 1)[-1] in message, message
        assert patch.target.partition(":")[0] in message and "not supported yet" in message


def test_the_servers_targets_are_verified_when_it_imports_them(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [patch for patch in _vllm_rows() if patch.feature == serving.SERVING]
    if get_adapter().generation not in (Generation.RUNNER_OUTPUT, Generation.AUX_OUTPUT):
        assert rows == []  # no routed experts in vLLM's server before 0.22: nothing streamed or recorded there
        return
    assert [patching.problem(patch) for patch in rows] == [None] * len(rows)
    required = [patch for patch in rows if patch.required]
    assert len(required) >= 4  # completions and chat, streamed and not
    for patch in required:
        with monkeypatch.context() as removed:
            _remove(removed, patch.target)
            with pytest.raises(UnsupportedVllmError, match=patch.target.rpartition(".")[2]):
                serving._patch_module(patch.target.partition(":")[0])  # refused before anything is patched


def test_a_moved_binder_group_with_no_member_left_is_refused(
    monkeypatch: pytest.MonkeyPatch, nothing_patched: None
) -> None:
    groups: dict[str, list[Patch]] = {}
    for patch in _vllm_rows():
        if patch.one_of:
            groups.setdefault(patch.one_of, []).append(patch)
    if get_adapter().generation.value in ("aux-output", "device-cache"):
        # aux-output: vLLM's connector binder is one required target; device-cache (0.21.0): vLLM's capturer is
        # never created under the plugin, so nothing of it is handed a buffer
        assert groups == {}
        return
    assert groups, "0.20-0.30 hand vLLM's capturer the buffer through a method or a module binder"
    for name, members in groups.items():
        with monkeypatch.context() as removed:
            for patch in members:
                with contextlib.suppress(LookupError):  # absent in this release: the other member is in use
                    _remove(removed, patch.target)
            with pytest.raises(UnsupportedVllmError, match=name):
                integration.install()


def test_validation_targets_are_checked_only_while_validation_is_on(monkeypatch: pytest.MonkeyPatch) -> None:
    target = "vllm.v1.engine.output_processor:RequestState._new_completion_output"
    assert target in {patch.target for patch in _vllm_rows()}
    _remove(monkeypatch, target)
    monkeypatch.setenv("VLLM_ASCEND_ROUTING_VALIDATE", "0")
    manifest.verify(get_adapter().generation, "cpu")  # not relied on: start-up goes on
    monkeypatch.setenv("VLLM_ASCEND_ROUTING_VALIDATE", "1")
    with pytest.raises(UnsupportedVllmError, match="_new_completion_output"):
        manifest.verify(get_adapter().generation, "cpu")


def test_doctor_lists_every_verified_target() -> None:
    lines, verified, total, missing = findings.target_report("cpu")
    assert missing is None and verified == total == len(_vllm_rows())
    for patch in _vllm_rows():
        relied = " (relied on)" if patch.action == RELY else ""
        assert any(line.strip().endswith(patch.target + relied) for line in lines), patch.target
    required_ok = [line for line in lines if line.strip().startswith("ok ")]
    assert len(required_ok) >= sum(patch.required for patch in _vllm_rows())


def test_every_kv_connector_this_vllm_registers_is_classified() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    registered = set(KVConnectorFactory._registry)
    assert registered, "vLLM's KV connector registry is empty"
    with_store = set(registry.NEEDS_STORE)  # served with a row store and a secret only (MooncakeConnector)
    unclassified = registered - SERVED_CONNECTORS - set(kv.REFUSED) - with_store
    assert not unclassified, f"KV connectors neither served nor refused: {sorted(unclassified)}"
    for name in registered:
        config = type("KVTransferConfig", (), {"kv_connector": name, "kv_role": "kv_both"})
        assert kv.serves(config) is (name in SERVED_CONNECTORS), name  # no store set here
    # The shared caches this vLLM registers are held-rows connectors (kv.shared wraps their carrier): their KV keys
    # are vLLM's block hashes, which include the cache salt (MooncakeStoreConnector on 0.30+).
    for name in set(shared.SHARED_CACHES) & registered:
        config = type("KVTransferConfig", (), {"kv_connector": name, "kv_role": "kv_both"})
        assert kv.holds_rows(config), name
