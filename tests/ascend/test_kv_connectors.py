# SPDX-License-Identifier: Apache-2.0
"""vllm-ascend's own KV connectors, as this release registers them (read from its source): its ``kv_p2p`` P/D
connectors whose prefill returns the parameters the proxy passes on (``kv.registry.ASCEND_PARAMS``) are served, rows
(or their row-store key) in those parameters; its push-mode ones are refused by name; every other (``kv_pool``: stores
and offload tiers; its ``MultiConnector``) is served, rows of KV the instance computed held in its scheduler. A new P/D
connector in a later release fails here until it is classified.

The hand-over itself, on the real connector's scheduler side (``torch_npu`` stubbed, Mooncake's transfer engine never
started: the scheduler side does not touch it): a prefill request finishes on a producer, its parameters (what
vllm-ascend's proxy passes on) go to a decode request on a consumer, and the rows the follower puts where vLLM reads
them are exactly the prefill's, inline in the parameters and through a row store."""

from __future__ import annotations

import hashlib
import importlib
import re
import sys
import types
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from tests.ascend.conftest import ASCEND_SRC
from tests.test_kv_transfer import MODEL, StandInRows, rows
from vllm_ascend_routing import kv, validate
from vllm_ascend_routing.kv import carriers, follower, registry, shared

pytestmark = [pytest.mark.vllm, pytest.mark.ascend]

_REGISTERED = re.compile(r'register_connector\(\s*"(\w+)",\s*"([\w.]+)",\s*"(\w+)"')


def registered() -> dict[str, tuple[str, str]]:
    """Connector name -> (the module vllm-ascend registers it from, its class)."""
    root = Path(ASCEND_SRC.split(":")[0]) / "vllm_ascend"
    found: dict[str, tuple[str, str]] = {}
    for path in root.rglob("*.py"):
        found.update(
            (name, (module, cls)) for name, module, cls in _REGISTERED.findall(path.read_text(errors="ignore"))
        )
    return found


def config(name: str) -> object:
    return type("KVTransferConfig", (), {"kv_connector": name, "kv_role": "kv_both", "kv_connector_extra_config": {}})


def test_vllm_ascend_p2p_connectors_are_classified_and_its_stores_served() -> None:
    connectors = registered()
    assert connectors, "no register_connector call found in vllm-ascend's source"
    p2p = {name for name, (module, _) in connectors.items() if ".kv_p2p." in module}
    unclassified = sorted(p2p - set(registry.ASCEND_PARAMS) - set(kv.REFUSED))
    assert not unclassified, f"vllm-ascend P/D connectors neither served nor refused by name: {unclassified}"
    wrong = {name for name in connectors if kv.serves(config(name)) != (name not in kv.REFUSED)}
    assert not wrong, f"classified wrongly: {wrong}"
    carried = {name for name in p2p if kv.serves(config(name))}
    assert carried <= set(registry.ASCEND_PARAMS) and not any(kv.holds_rows(config(n)) for n in carried)
    refused = sorted(p2p - carried)
    held = sorted(n for n in connectors if n not in p2p and kv.holds_rows(config(n)))
    # its KV pool (the kv_pool connector registered as AscendStoreConnector and its older name) is a shared cache:
    # held here, its blocks' rows shared through the row store where the deployment sets one (kv.shared)
    pool = {n for n, (module, _) in connectors.items() if ".kv_pool.ascend_store." in module}
    assert pool <= set(shared.SHARED_CACHES) and pool <= set(held), (pool, held)
    print(
        f"carried in parameters: {', '.join(sorted(carried))}; refused: {', '.join(refused)}; held: {', '.join(held)}"
    )


def _mooncake_engine_stub(monkeypatch: pytest.MonkeyPatch) -> None:
    """TEST-ONLY: ``mooncake.engine`` (Mooncake's transfer engine, imported by the connector module; only its worker
    side uses it) as an empty module."""
    engine = types.ModuleType("mooncake.engine")
    engine.TransferEngine = object  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mooncake", sys.modules.get("mooncake") or types.ModuleType("mooncake"))
    monkeypatch.setitem(sys.modules, "mooncake.engine", engine)


def _registered_with_vllm(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """vLLM's connector factory knows ``name`` as vllm-ascend's platform registers it (this process's only)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    monkeypatch.setattr(KVConnectorFactory, "_registry", dict(KVConnectorFactory._registry))
    if name not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(name, *registered()[name])


def _scheduler_side(name: str, role: str, block_size: int, model_config: Any = None) -> Any:
    """vllm-ascend's connector ``name`` (scheduler role) under a vLLM config naming it, and a scheduler stand-in the
    follower attaches to (its KV config and block size)."""
    import torch
    from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    module, cls = registered()[name]
    connector_cls = getattr(importlib.import_module(module), cls)
    # D2RH sizes its transfers by the prefill and decode instances' TP (its own extra config, as its docs set it)
    extra = {"prefill": {"tp_size": 1}, "decode": {"tp_size": 1}}
    transfer = KVTransferConfig(
        kv_connector=name, kv_role=role, engine_id=f"{role}-engine", kv_port=20000, kv_connector_extra_config=extra
    )
    with_model = {} if model_config is None else {"model_config": model_config}
    vllm_config = VllmConfig(kv_transfer_config=transfer, cache_config=CacheConfig(block_size=block_size), **with_model)
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=8, dtype=torch.float16)
    kv_cache_config = KVCacheConfig(
        num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)]
    )
    connector = connector_cls(vllm_config, KVConnectorRole.SCHEDULER, kv_cache_config)
    scheduler = SimpleNamespace(vllm_config=vllm_config)
    return connector, scheduler


# Served by the parameters carrier (registry.CARRIERS). Its decode side asks the producer's scheduler (ZMQ) from
# get_num_new_matched_tokens, which no producer answers here: the rows in what its real producer returned are read by
# the follower's carrier directly.
DECODE_ASKS_THE_PRODUCER = ("MooncakeD2RHConnectorV1",)
NEED_A_MODEL = ("MooncakeD2RHConnectorV1", "MooncakeHybridConnector")  # their schedulers read the model's config


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny MoE this project builds (``transformers``, random weights: only its config is read), once per module."""
    from vllm_ascend_routing.preflight import models

    return str(models.build_tiny_moe("qwen3_moe", tmp_path_factory.mktemp("model") / "qwen3_moe").path)


class DelayedFrees:
    """TEST-ONLY: in place of the pull-mode producer's scheduler thread (``MooncakeSchedulerSendingThread``, started
    once its workers report their transfer-engine handshake, which no worker does here): the delayed frees it is
    told of, recorded."""

    def __init__(self) -> None:
        self.requests: list[str] = []

    def add_delayed_request(self, request_id: str, *args: Any) -> None:
        self.requests.append(request_id)


def _without_worker_handshake(connector: Any) -> DelayedFrees | None:
    """The stand-in above on a pull-mode producer (``MooncakeConnectorV2``, ``MooncakePullConnector``)."""
    scheduler = getattr(connector, "connector_scheduler", None)
    if scheduler is None or getattr(scheduler, "_sending_thread", False) is not None:
        return None
    scheduler._sending_thread = DelayedFrees()
    return scheduler._sending_thread


def _block_hashes(prompt: list[int], block: int) -> list[bytes]:
    """A request's hashes of its whole blocks, chained over every token before each block's end (as vLLM's)."""
    return [hashlib.sha256(repr(prompt[:end]).encode()).digest() for end in range(block, len(prompt) + 1, block)]


def _finished(connector: Any, request: Any, blocks: list[int]) -> Any:
    """What vLLM's scheduler calls on a finished request: ``request_finished_all_groups`` (block ids per KV cache
    group) for a connector that supports the hybrid allocator, else ``request_finished``."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA
    except ImportError:
        return connector.request_finished(request, blocks)
    if isinstance(connector, SupportsHMA):
        return connector.request_finished_all_groups(request, (blocks,))
    return connector.request_finished(request, blocks)


class LocalBlocks:
    """TEST-ONLY: the blocks vLLM's scheduler allocated for a load (``KVCacheBlocks``), as the connector reads them."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def get_unhashed_block_ids_all_groups(self) -> tuple[list[int], ...]:
        return (self.ids,)

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.ids,)


@pytest.mark.parametrize("name", registry.ASCEND_PARAMS)
@pytest.mark.parametrize("store", ["inline", "shm"])
def test_rows_cross_from_a_prefill_to_a_decode_request_through_the_real_connector(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any, store: str, name: str, tiny_model: str
) -> None:
    from vllm.v1.request import RequestStatus

    from vllm_ascend_routing.compat import adapter
    from vllm_ascend_routing.errors import UnsupportedVllmError

    if name not in registered():
        pytest.skip(f"this vllm-ascend release has no {name}")
    if adapter().kv_rows is None:  # vLLM 0.20.x / 0.21.0: no store for loaded rows, every connector refused at load
        with pytest.raises(UnsupportedVllmError, match=f"KV connector {name} .* is served from vLLM 0.22 on"):
            kv.refuse_uncovered(SimpleNamespace(kv_transfer_config=config(name)), "this", None)
        return
    _mooncake_engine_stub(monkeypatch)
    _registered_with_vllm(monkeypatch, name)
    monkeypatch.setenv("VLLM_ASCEND_ROUTING_KV_SECRET", "ascend-pd")
    if store == "shm":
        from tests.store.local import shm_ledger
        from vllm_ascend_routing.store import publisher as store_publisher

        shm_ledger(tmp_path, monkeypatch)
        monkeypatch.setattr(store_publisher, "_publishers", {})
    monkeypatch.setattr(validate.ModelRouting, "from_vllm_config", staticmethod(lambda config: MODEL))
    block = 16
    model = None
    if name in NEED_A_MODEL:
        from vllm.config import ModelConfig

        model = ModelConfig(model=tiny_model, dtype="float32")
    producer, produced = _scheduler_side(name, "kv_producer", block, model), StandInRows()
    consumer, consumed = _scheduler_side(name, "kv_consumer", block, model), StandInRows()
    block = int(producer[1].vllm_config.cache_config.block_size)  # a model's config may set its own
    delayed = _without_worker_handshake(producer[0])
    follower.follow(producer[1], producer[0], produced)
    follower.follow(consumer[1], consumer[0], consumed)
    prompts = {"a": list(range(100, 140)), "b": list(range(300, 353))}  # two prompts, each its own rows
    params = {}
    for n, (rid, prompt) in enumerate(prompts.items()):
        request = SimpleNamespace(
            request_id=rid,
            prompt_token_ids=prompt,
            all_token_ids=[*prompt, 7],
            output_token_ids=[7],
            num_output_tokens=1,
            num_tokens=len(prompt) + 1,
            num_prompt_tokens=len(prompt),
            block_hashes=_block_hashes(prompt, block),
            status=RequestStatus.FINISHED_LENGTH_CAPPED,
            kv_transfer_params={"do_remote_decode": True},
            mm_features=[],
        )
        produced.prompts[rid] = rows(len(prompt), start=10 * n)
        blocks = list(range(1 + 4 * n, 1 + 4 * n + -(-len(prompt) // block)))
        delay, returned = _finished(producer[0], request, blocks)
        assert delay is True and isinstance(returned, dict)
        carrier = registry.CARRIERS[name]
        assert (carrier.KEY_FIELD in returned) == (store == "shm") and (carrier.FIELD in returned) == (store != "shm")
        params[rid] = returned
    for rid, prompt in prompts.items():
        decode = SimpleNamespace(
            request_id=f"d-{rid}",
            prompt_token_ids=prompt,
            num_tokens=len(prompt),
            num_prompt_tokens=len(prompt),
            block_hashes=_block_hashes(prompt, block),
            kv_transfer_params=dict(params[rid]),
            mm_features=[],
        )
        if name in DECODE_ASKS_THE_PRODUCER:  # the follower's carrier on what the producer's connector returned
            carried = carriers.TransferParamsCarrier(consumer[0], consumed.layout, name=name).get(
                decode, 0, len(prompt)
            )
            assert isinstance(carried, np.ndarray) and np.array_equal(carried, produced.prompts[rid]), carried
            continue
        count, load_async = consumer[0].get_num_new_matched_tokens(decode, 0)
        assert count == len(prompt) and load_async is True
        consumer[0].update_state_after_alloc(decode, LocalBlocks(list(range(40, 40 + -(-count // block)))), count)
        request_id, start, carried = consumed.injected[-1]
        assert (request_id, start) == (f"d-{rid}", 0)
        assert np.array_equal(carried, produced.prompts[rid][:count])
    swapped = SimpleNamespace(
        request_id="d-swapped",
        prompt_token_ids=list(range(500, 540)),
        num_tokens=40,
        num_prompt_tokens=40,
        block_hashes=_block_hashes(list(range(500, 540)), block),
        kv_transfer_params=dict(params["b"]),
        mm_features=[],
    )
    if name in DECODE_ASKS_THE_PRODUCER:
        refused = carriers.TransferParamsCarrier(consumer[0], consumed.layout, name=name).get(swapped, 0, 40)
        assert "other tokens" in getattr(refused, "reason", ""), refused
    else:
        assert consumer[0].get_num_new_matched_tokens(swapped, 0) == (0, False)  # rows of other tokens: computed here
    assert delayed is None or delayed.requests == list(prompts)  # a pull-mode producer kept both prompts' blocks
