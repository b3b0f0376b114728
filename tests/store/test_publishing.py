# SPDX-License-Identifier: Apache-2.0
"""The engine core's hand-off on a store engine, on the stand-in scheduler of tests/output/test_engine.py: each
request's chunks held, published at its last output before that output leaves, only the key sent; inline on
request; the store full: rows inline and the record says why; an aborted request publishes nothing."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from tests.output import test_engine as stand_in
from vllm_ascend_routing import replay
from vllm_ascend_routing.output import engine, frontend, provenance
from vllm_ascend_routing.store import keys as store_keys
from vllm_ascend_routing.store import publisher as store_publisher
from vllm_ascend_routing.store import reader as stored
from vllm_ascend_routing.store import setting, shm


class DistinctRows(stand_in.Scheduler):
    """Each step's chunk of each request is its own: request number, step number and position differ."""

    def __init__(self) -> None:
        super().__init__()
        self.steps = 0
        self.sent: dict[str, list[np.ndarray]] = {}

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> dict[int, Any]:
        self.steps += 1
        outputs = stand_in.Scheduler.update_from_output(self, scheduler_output, model_runner_output)
        for n, output in enumerate(outputs[0].outputs):
            chunk = np.full((1 + n, 3, 2), 10 * self.steps + n, np.uint8)
            chunk[:, 1, 0] += 1  # layers differ too
            output.routed_experts = chunk
            self.sent.setdefault(output.request_id, []).append(chunk)
        return outputs


def hooked(cls: type[DistinctRows]) -> DistinctRows:
    """``cls`` with the output feature's scheduler hooks, on a store engine (``shm``)."""
    scheduler = type("HookedScheduler", (cls,), {})
    scheduler.add_request = engine._adding(cls.add_request, stand_in.REQUESTED)  # type: ignore[method-assign]
    scheduler.update_from_output = engine._updating(cls.update_from_output, stand_in.REQUESTED)  # type: ignore[method-assign]
    scheduler._free_request = engine._freeing(cls._free_request, stand_in.REQUESTED)  # type: ignore[method-assign]
    instance = scheduler()
    publisher = store_publisher.Publisher(setting.Setting("shm", "shm"), dp_rank=1)
    setattr(instance, engine._SCHEDULER_STATE, engine.EngineState(enabled=True, publisher=publisher))
    return instance


@pytest.fixture
def shm_store(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(engine, "selecting", set())
    monkeypatch.setattr(engine, "opted_out", set())
    monkeypatch.setattr(engine, "inline", set())
    monkeypatch.setattr(shm, "SHM_ROOT", str(tmp_path))
    monkeypatch.setattr(shm.ShmBackend.__init__, "__defaults__", (str(tmp_path),))
    monkeypatch.setenv("VLLM_ASCEND_ROUTING_STORE", "shm")
    monkeypatch.setattr(stored, "_clients", {})


@pytest.fixture
def store_engine(shm_store: None) -> DistinctRows:
    return hooked(DistinctRows)


def run(scheduler: DistinctRows, plan: list[tuple[list[str], list[str], list[str]]]) -> dict[str, list[Any]]:
    seen: dict[str, list[Any]] = {}
    for scheduled, new, finishing in plan:
        for request_id, output in stand_in.step(scheduler, scheduled, new, finishing, 1).items():
            seen.setdefault(request_id, []).append(output)
    return seen


def test_only_a_key_leaves_and_it_fetches_every_chunk_exactly(store_engine: DistinctRows) -> None:
    for name in ("a", "b", "c"):
        store_engine.add_request(stand_in.request(name, 30))
    seen = run(
        store_engine,
        [
            (["a", "b", "c"], ["a", "b", "c"], []),
            (["a", "b", "c"], [], ["b"]),
            (["a", "c"], [], []),
            (["a", "c"], [], ["a", "c"]),
        ],
    )
    keys = {}
    for name, outputs in seen.items():
        assert all(output.routed_experts is None for output in outputs)  # no chunk left the engine core
        record = outputs[-1].kv_transfer_params[engine.RECORD_KEY]
        keys[name] = record[provenance.STORE_KEY]
        expected = np.concatenate(store_engine.sent[name])
        assert record["shape"] == list(expected.shape) and record["dtype"] == "uint8"
        fetched = replay.fetch(keys[name])
        assert fetched.dtype == np.uint8 and np.array_equal(fetched, expected)  # readable when the key is seen
    assert len(set(keys.values())) == 3 and all(".dp1." in key for key in keys.values())


def test_a_request_asking_inline_gets_its_rows_inline(store_engine: DistinctRows) -> None:
    store_engine.add_request(stand_in.request("inline", 30, {"routed_experts_transport": "inline"}))
    store_engine.add_request(stand_in.request("stored", 30))
    seen = run(
        store_engine,
        [(["inline", "stored"], ["inline", "stored"], []), (["inline", "stored"], [], ["inline", "stored"])],
    )
    inline_rows = [output.routed_experts for output in seen["inline"]]
    assert all(chunk is not None for chunk in inline_rows)
    assert np.array_equal(np.concatenate(inline_rows), np.concatenate(store_engine.sent["inline"]))
    assert provenance.STORE_KEY not in seen["inline"][-1].kv_transfer_params[engine.RECORD_KEY]
    assert provenance.STORE_KEY in seen["stored"][-1].kv_transfer_params[engine.RECORD_KEY] and not engine.inline


def test_a_full_store_returns_the_rows_inline_and_says_why(
    store_engine: DistinctRows, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_ASCEND_ROUTING_STORE_MIB", "0")
    store_engine.add_request(stand_in.request("full", 30))
    seen = run(store_engine, [(["full"], ["full"], []), (["full"], [], ["full"])])
    last = seen["full"][-1]
    record = last.kv_transfer_params[engine.RECORD_KEY]
    assert provenance.STORE_KEY not in record and "VLLM_ASCEND_ROUTING_STORE_MIB=0" in record[provenance.FALLBACK]
    assert np.array_equal(last.routed_experts, np.concatenate(store_engine.sent["full"]))  # every row, inline


def test_an_aborted_request_publishes_nothing(store_engine: DistinctRows) -> None:
    store_engine.add_request(stand_in.request("gone", 30))
    run(store_engine, [(["gone"], ["gone"], [])])
    publisher = getattr(store_engine, engine._SCHEDULER_STATE).publisher
    assert "gone" in publisher.chunks
    store_engine._free_request(store_engine.requests["gone"])  # an abort: freed outside update_from_output
    assert "gone" not in publisher.chunks and publisher._ledger is None


def test_the_record_names_the_key_and_the_stored_shape() -> None:
    part = {
        "first_token": 3,
        "cached": 0,
        "loaded": 0,
        "weight_version": {},
        provenance.STORE_KEY: "k",
        "shape": [12, 4, 2],
        "dtype": "uint8",
    }
    info = provenance.complete(part, None, "aux-output", "0.32.0")
    assert info["store_key"] == "k" and info["rows"] == 12 and info["num_layers"] == 4 and info["top_k"] == 2
    assert info["computed"] == 12 and info["dtype"] == "uint8" and provenance.FALLBACK not in info


def test_publisher_for_engine_follows_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_publisher, "_publishers", {})
    monkeypatch.delenv("VLLM_ASCEND_ROUTING_STORE", raising=False)
    assert store_publisher.for_engine(0) is None
    monkeypatch.setenv("VLLM_ASCEND_ROUTING_STORE", "shm")
    found = store_publisher.for_engine(2)
    assert found is not None and found.dp_rank == 2 and store_publisher.for_engine(2) is found
    assert store_publisher.for_engine() is found  # the KV carrier's rows: the same ledger, cap and lease
    monkeypatch.setattr(store_publisher, "_publishers", {})
    first = store_publisher.for_engine()
    assert first is not None and first.dp_rank == 0 and store_publisher.for_engine(0) is first


class ContractRows(DistinctRows):
    """Rows of a 3-layer model whose layer 1 routes (top-2 of 64): request "broken" repeats an id in a row."""

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> dict[int, Any]:
        outputs = DistinctRows.update_from_output(self, scheduler_output, model_runner_output)
        for output in outputs[0].outputs:
            chunk = np.zeros_like(output.routed_experts)
            chunk[:, 1, 0] = output.routed_experts[:, 1, 1] % 60
            chunk[:, 1, 1] = chunk[:, 1, 0] + (0 if output.request_id == "broken" else 1)
            output.routed_experts = chunk
            self.sent[output.request_id][-1] = chunk
        return outputs


@pytest.mark.parametrize("mode", ["strict", "1"])
def test_validation_mode_checks_rows_before_they_are_stored(
    shm_store: None, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """The front end never sees stored rows, so validation mode checks them in the engine core: strict stores nothing
    broken and fails that request in the front end; "1" stores them and lists what broke in the record."""
    import functools

    from vllm_ascend_routing import validate

    monkeypatch.setenv("VLLM_ASCEND_ROUTING_VALIDATE", mode)
    store_engine = hooked(ContractRows)
    model = validate.ModelRouting(num_experts=64, num_layers=3, moe_layers=frozenset({1}))
    getattr(store_engine, engine._SCHEDULER_STATE).violations = functools.partial(engine._violations, model=model)
    for name in ("broken", "fine"):
        store_engine.add_request(stand_in.request(name, 30))
    seen = run(
        store_engine, [(["broken", "fine"], ["broken", "fine"], []), (["broken", "fine"], [], ["broken", "fine"])]
    )
    fine = seen["fine"][-1].kv_transfer_params[engine.RECORD_KEY]
    assert provenance.VIOLATIONS not in fine
    assert np.array_equal(replay.fetch(fine[provenance.STORE_KEY]), np.concatenate(store_engine.sent["fine"]))
    broken = seen["broken"][-1].kv_transfer_params[engine.RECORD_KEY]
    assert any("twice" in text or "repeat" in text or "duplicate" in text for text in broken[provenance.VIOLATIONS])
    output = SimpleNamespace(routed_experts=None, finish_reason="stop")
    if mode == "strict":
        assert provenance.STORE_KEY not in broken and seen["broken"][-1].routed_experts is None
        with pytest.raises(validate.RoutingValidationError):
            frontend._attach(output, broken, generation="runner-output", vllm="0.30.0")
    else:
        assert np.array_equal(replay.fetch(broken[provenance.STORE_KEY]), np.concatenate(store_engine.sent["broken"]))
        frontend._attach(output, broken, generation="runner-output", vllm="0.30.0")
        assert output.routed_experts_info[provenance.VIOLATIONS] == broken[provenance.VIOLATIONS]


def test_the_front_end_cuts_a_stored_request_to_the_tokens_it_kept() -> None:
    """vLLM 0.31+'s front end drops tokens accepted past a stop string (and their rows from an inline array): a stored
    request's record and key then name only the kept tokens' rows (``@rows``); otherwise both stay as stored."""
    key = store_keys.Namespace.mint().key()

    def record(rows: int) -> dict[str, Any]:
        return {"first_token": 3, provenance.STORE_KEY: key, "shape": [rows, 3, 2], "dtype": "uint8"}

    state = SimpleNamespace(prompt_len=10, detokenizer=SimpleNamespace(num_output_tokens=lambda: 5))
    cut = record(16)  # stored: 16 rows from token 3; kept: 10 + 5 - 1 - 3 = 11
    frontend._kept_rows(state, cut)
    assert cut["shape"] == [11, 3, 2] and cut[provenance.STORE_KEY] == f"{key}@11"
    whole = record(11)  # nothing dropped: at the boundary, unchanged
    frontend._kept_rows(state, whole)
    assert whole == record(11)
    frontend._kept_rows(SimpleNamespace(prompt_len=10, detokenizer=None), untouched := record(16))
    assert untouched == record(16)  # no detokenizer (skip_tokenizer_init): nothing to count, nothing cut
