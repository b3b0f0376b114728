# SPDX-License-Identifier: Apache-2.0
"""Where each generation puts the rows of tokens a KV connector loaded (no vLLM needed: stand-ins shaped as
vLLM 0.30's ``RoutedExpertsManager`` and 0.32's AuxOutput connectors; the real ones run end to end in
tests/e2e/test_disaggregation.py), and the lift of vLLM 0.22-0.30's refusal at its one check."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from vllm_ascend_routing import patching
from vllm_ascend_routing.compat._lift import Site
from vllm_ascend_routing.compat.aux_output import kv_rows as _kv_aux
from vllm_ascend_routing.compat.aux_output import requests as _aux_requests
from vllm_ascend_routing.compat.interface import UnsupportedVllmError
from vllm_ascend_routing.compat.runner_output import kv_rows as _kv_slots
from vllm_ascend_routing.output import engine

BLOCK = 4


def rows(count: int, value: int) -> np.ndarray:
    out = np.zeros((count, 3, 2), dtype=np.uint8)
    out[..., 0], out[..., 1] = value, value + 1
    return out


class SlotManager:
    """TEST-ONLY: vLLM 0.22-0.30's scheduler-side slot buffer (``RoutedExpertsManager``)."""

    attn_gid = 0
    block_size = BLOCK

    def __init__(self, num_blocks: int = 8) -> None:
        self.routed_experts_by_slot = np.zeros((num_blocks * BLOCK, 3, 2), dtype=np.uint8)

    def store_batch(self, data: np.ndarray, slot_mapping: np.ndarray) -> None:
        self.routed_experts_by_slot[slot_mapping] = data

    def get(self, block_ids: list[int], num_tokens: int, token_start: int = 0) -> np.ndarray:
        slots = (np.asarray(block_ids)[:, None] * BLOCK + np.arange(BLOCK)).ravel()[:num_tokens]
        return self.routed_experts_by_slot[slots[token_start:]].copy()


def blocks(*ids: int) -> Any:
    return SimpleNamespace(get_block_ids=lambda: (list(ids),))


def test_loaded_rows_land_in_the_loaded_tokens_slots_and_survive_a_late_step() -> None:
    manager = SlotManager()
    manager.routed_experts_by_slot[:] = 9  # another request's rows: what a loaded token's slot holds
    store = _kv_slots._SlotStore(manager)
    request = SimpleNamespace(request_id="r", num_output_tokens=0, num_prompt_tokens=10, num_computed_tokens=8)
    carried = np.concatenate([rows(3, 1), rows(3, 2)])
    store.inject(request, blocks(5, 2, 7), 2, carried)  # tokens 2..7: slots 22, 23, 8, 9, 10, 11
    assert np.array_equal(manager.get([5, 2, 7], 8, token_start=2), carried)
    # A step still in flight for the slots' former owner writes them after the load: undone at once.
    manager.store_batch(rows(2, 5), np.array([23, 9]))
    assert np.array_equal(manager.get([5, 2, 7], 8, token_start=2), carried)
    request.num_output_tokens = 1  # its prompt rows were read: the slots are the request's own again
    manager.store_batch(rows(1, 5), np.array([23]))
    assert manager.routed_experts_by_slot[23, 0, 0] == 5 and store.pending == {}


def test_a_preempted_request_s_rows_leave_the_slots_to_their_next_owner() -> None:
    manager = SlotManager()
    store = _kv_slots._SlotStore(manager)
    request = SimpleNamespace(request_id="r", num_output_tokens=0, num_prompt_tokens=10, num_computed_tokens=9)
    store.inject(request, blocks(5, 2, 7), 0, rows(8, 1))
    request.num_computed_tokens = 0  # preempted: its blocks went back to the pool
    manager.store_batch(rows(1, 6), np.array([21]))  # another request computed into one of them
    assert manager.routed_experts_by_slot[21, 0, 0] == 6 and store.pending == {}


def test_a_finished_request_s_rows_are_read_from_its_blocks_all_but_the_last_token() -> None:
    manager = SlotManager()
    store = _kv_slots._SlotStore(manager)
    manager.store_batch(rows(7, 3), np.array([12, 13, 14, 15, 4, 5, 6]))
    manager.store_batch(rows(1, 9), np.array([7]))  # the last token's slot: no forward computed it for this request
    request = SimpleNamespace(request_id="r", num_prompt_tokens=6, num_tokens=8)  # 6 prompt, 2 generated tokens
    assert np.array_equal(store.finished_rows(request, [3, 1]), rows(7, 3))  # one KV group: a list
    assert np.array_equal(store.finished_rows(request, ([3, 1],)), rows(7, 3))  # all groups: a tuple
    assert store.finished_rows(request, [3]) is None  # blocks short of the tokens: unknown
    prompt_only = SimpleNamespace(request_id="p", num_prompt_tokens=6, num_tokens=6)
    assert np.array_equal(store.finished_rows(prompt_only, [3, 1]), rows(6, 3))
    assert store.layout == _kv_slots.RowLayout(3, 2, "uint8")


class KvConfig:
    """TEST-ONLY: vLLM's ``KVTransferConfig`` property."""

    def __init__(self, name: str | None) -> None:
        self.kv_connector, self.kv_role = name, "kv_consumer"

    @property
    def is_kv_transfer_instance(self) -> bool:
        return self.kv_connector is not None


class Config:
    """TEST-ONLY: the shape of vLLM 0.22-0.30's ``VllmConfig.__post_init__``: another reader of the property,
    then the refusal of routed experts with KV connectors."""

    def __init__(self, kv: KvConfig, routed: bool) -> None:
        self.kv_transfer_config = kv
        self.connector_in_use = kv.is_kv_transfer_instance  # e.g. vLLM's CUDA-graph mode for connectors
        if routed and (  # the check as vLLM writes it: the property read on a line of its own
            self.kv_transfer_config is not None
            and self.kv_transfer_config.is_kv_transfer_instance
        ):  # fmt: skip
            raise ValueError(
                "--enable-return-routed-experts is incompatible with KV "
                "connectors (PD disaggregation, KV cache offload)."
            )


@pytest.fixture
def lifted(monkeypatch: pytest.MonkeyPatch) -> None:
    code = Config.__init__.__code__
    line = _kv_slots.guarding_line(code)
    assert line is not None
    monkeypatch.setattr(_kv_slots, "refusal_site", lambda: Site(code, line))
    original = KvConfig.__dict__["is_kv_transfer_instance"]
    patching.wrap(KvConfig, "is_kv_transfer_instance", _kv_slots._lifting)
    yield
    monkeypatch.setattr(KvConfig, "is_kv_transfer_instance", original)


def test_the_refusal_site_is_the_read_before_vllm_s_message() -> None:
    line = _kv_slots.guarding_line(Config.__init__.__code__)
    first_read = Config.__init__.__code__.co_firstlineno + 3
    assert line is not None and line > first_read  # the second read, not the first


@pytest.mark.usefixtures("lifted")
def test_vllm_s_refusal_is_lifted_for_a_served_connector_only() -> None:
    config = Config(KvConfig("ExampleConnector"), routed=True)  # vLLM's check passes
    assert config.connector_in_use is True  # every other reader sees vLLM's answer
    assert Config(KvConfig("OffloadingConnector"), routed=True).connector_in_use is True  # rows held here
    assert KvConfig("ExampleConnector").is_kv_transfer_instance is True
    assert Config(KvConfig("NixlConnector"), routed=True).connector_in_use is True  # rows in its parameters
    with pytest.raises(UnsupportedVllmError, match="MooncakeConnector .kv_consumer. is not covered"):
        Config(KvConfig("MooncakeConnector"), routed=True)
    assert Config(KvConfig("MooncakeConnector"), routed=False).connector_in_use is True


class AuxScheduler:
    """TEST-ONLY: vLLM 0.32's ``AuxOutputSchedulerConnector``, the two calls the rows follow."""

    def take_output(self, request: Any, output: dict[str, Any] | None) -> np.ndarray | None:
        entry = output[request.request_id] if output else None
        return None if entry is None else entry.rows

    def build_connector_meta(self, scheduler_output: Any, requests: dict[str, Any]) -> Any:
        return SimpleNamespace(requests=dict(scheduler_output.num_scheduled_tokens))


def aux_config(experts: int = 8) -> Any:
    model_config = SimpleNamespace(
        get_num_experts=lambda: experts, get_total_num_hidden_layers=lambda: 3, get_num_experts_per_tok=lambda: 2
    )
    return SimpleNamespace(model_config=model_config)


def test_the_aux_store_keeps_prompt_rows_and_sends_carried_rows_with_the_step() -> None:
    aux = AuxScheduler()
    store = _kv_aux._BlockStore(aux, aux_config())
    assert store.layout == _kv_aux.RowLayout(3, 2, "uint8")
    assert _kv_aux._BlockStore(AuxScheduler(), aux_config(300)).layout.dtype == "uint16"
    request = SimpleNamespace(request_id="r", num_prompt_tokens=5)
    later = SimpleNamespace(token_start=5, rows=rows(1, 4))
    assert aux.take_output(request, {"r": SimpleNamespace(token_start=0, rows=rows(6, 2))}) is not None
    aux.take_output(request, {"r": later})  # a later chunk: not the prompt's
    assert np.array_equal(store.finished_rows(request, None), rows(5, 2))
    # rows from token 3 on, however many, are not the prompt's: kept only from an output starting at token 0
    short = SimpleNamespace(request_id="s", num_prompt_tokens=2)
    aux.take_output(short, {"s": SimpleNamespace(token_start=3, rows=rows(4, 6))})
    assert store.finished_rows(short, None) is None
    request.num_computed_tokens = 8  # local hit of 4 and the 4 loaded: this step computes from token 8
    store.inject(request, None, 4, rows(4, 1))
    idle = aux.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"x": 1}), {})
    assert not hasattr(idle, _kv_aux._CARRIED)  # not scheduled yet: kept for its step
    step = aux.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"r": 3}), {})
    carried = getattr(step, _kv_aux._CARRIED)
    assert list(carried) == ["r"] and carried["r"][0] == 4 and np.array_equal(carried["r"][1], rows(4, 1))
    # A load whose KV arrived between steps (NIXL) of every prompt token: vLLM computes the last one again, so the
    # step computes from token 7; the carried row of token 7 is that step's own (a capture cursor never goes back).
    again = SimpleNamespace(request_id="a", num_prompt_tokens=8, num_computed_tokens=7)
    store.inject(again, None, 0, rows(8, 1))
    step = aux.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"a": 1}), {})
    assert np.array_equal(getattr(step, _kv_aux._CARRIED)["a"][1], rows(7, 1))
    failed = SimpleNamespace(request_id="f", num_prompt_tokens=8, num_computed_tokens=0)  # its load failed whole
    store.inject(failed, None, 0, rows(8, 1))
    assert not hasattr(aux.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"f": 8}), {}), _kv_aux._CARRIED)
    store.forget("r")
    assert store.finished_rows(request, None) is None and store.carried == {}


def test_the_aux_store_wraps_around_the_per_request_options_on_the_connector_class(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The per-request options replace ``take_output`` and ``build_connector_meta`` on vLLM's class on every engine
    (compat/_aux_requests.py); the store's per-instance wrappers must go around them, not be skipped as if already
    installed (P/D on 0.32.0 then stored no prompt rows at all). An opted-out request's prompt rows are kept too:
    they travel with its KV (before, a P/D prefill of an opted-out request lent KV without rows, and the decode
    instance computed that prompt again)."""
    monkeypatch.setattr(engine, "opted_out", {"out"})

    class OptionsInstalled(AuxScheduler):
        pass

    patching.wrap(OptionsInstalled, "take_output", lambda m: _aux_requests._taking(m, engine.SELECTION))
    patching.wrap(OptionsInstalled, "build_connector_meta", lambda m: _aux_requests._building(m, engine.SELECTION))
    aux = OptionsInstalled()
    store = _kv_aux._BlockStore(aux, aux_config())
    request = SimpleNamespace(request_id="r", num_prompt_tokens=5, num_computed_tokens=8, num_output_tokens=0)
    assert aux.take_output(request, {"r": SimpleNamespace(token_start=0, rows=rows(6, 2))}) is not None
    assert np.array_equal(store.finished_rows(request, None), rows(5, 2))
    store.inject(request, None, 4, rows(4, 1))
    step = aux.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"r": 3}), {"r": request})
    assert list(getattr(step, _kv_aux._CARRIED)) == ["r"]
    out = SimpleNamespace(request_id="out", num_prompt_tokens=5, num_output_tokens=0, num_tokens=5)
    step = aux.build_connector_meta(SimpleNamespace(num_scheduled_tokens={"out": 5}), {"out": out})
    assert step.requests == {"out": 0}  # emitted from its first prompt token, not never
    assert aux.take_output(out, {"out": SimpleNamespace(token_start=0, rows=rows(5, 3))}) is not None
    assert np.array_equal(store.finished_rows(out, None), rows(5, 3))
    # rows asked from prompt token 3 (vLLM's routed_experts_prompt_start, or routed_experts_omit): all 5 kept for its
    # KV, vLLM given those from token 3
    later = SimpleNamespace(request_id="l", num_prompt_tokens=5, sampling_params=SimpleNamespace(
        routed_experts_prompt_start=3))  # fmt: skip
    taken = aux.take_output(later, {"l": SimpleNamespace(token_start=0, rows=rows(5, 4))})
    assert np.array_equal(taken, rows(5, 4)[3:]) and np.array_equal(store.finished_rows(later, None), rows(5, 4))


class AuxWorker:
    """TEST-ONLY: vLLM 0.32's ``AuxOutputWorkerConnector``: per-request state, staging buffer, publication."""

    def __init__(self, first_rank: bool = True) -> None:
        self._lock = threading.Lock()
        self._requests: dict[str, Any] = {}
        self._buffer = SimpleNamespace(capture=self.capture) if first_rank else None
        self.log: list[Any] = []

    def capture(self, request_id: str, token_start: int, staged: np.ndarray) -> list[tuple[int, np.ndarray]]:
        self.log.append(("capture", request_id, token_start, len(staged)))
        return [(token_start, staged)]

    def _publish_blocks(self, batches: list[Any]) -> None:
        self.log.append(("publish", [start for _, completed in batches for start, _ in completed]))

    def begin_step(self, metadata: Any) -> None:
        for request_id in metadata.requests:
            self._requests.setdefault(request_id, SimpleNamespace(capture_cursor=None))
        self.log.append(("begin",))


def test_the_worker_stages_carried_rows_after_vllm_s_begin_step() -> None:
    begin_step = _kv_aux._staging_carried(AuxWorker.begin_step)
    worker = AuxWorker()
    metadata = SimpleNamespace(requests={"r": 0}, **{_kv_aux._CARRIED: {"r": (4, rows(8, 1))}})
    begin_step(worker, metadata)
    assert worker.log == [("begin",), ("capture", "r", 4, 8), ("publish", [4])]
    assert worker._requests["r"].capture_cursor == 12  # the step's own capture continues at token 12
    other = AuxWorker(first_rank=False)  # a TP rank without the store: nothing to stage
    begin_step(other, metadata)
    assert other.log == [("begin",)]
