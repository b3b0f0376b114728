# SPDX-License-Identifier: Apache-2.0
"""vLLM's ``MooncakeConnector`` P/D (``kv.named``): the prefill's rows go into the row store under a name derived from
the transfer id with the deployment's secret; the decode request, sent at the same time, waits for them (vLLM asks
again) up to ``VLLM_ASCEND_ROUTING_KV_ROWS_WAIT_S``, then loads them exact or declines; loaded rows are freed. Served
only with a store and a secret. The e2e run: tests/e2e/test_mooncake_pd.py."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from tests.store.local import deployment_store
from tests.test_kv_transfer import LAYOUT, MODEL, StandInRows, kv_config, rows
from vllm_ascend_routing import kv
from vllm_ascend_routing.errors import UnsupportedVllmError
from vllm_ascend_routing.kv import follower, registry
from vllm_ascend_routing.kv.carriers import Missing, Pending
from vllm_ascend_routing.kv.named import TransferIdCarrier
from vllm_ascend_routing.store import keys, layout, shm
from vllm_ascend_routing.store import publisher as store_publisher
from vllm_ascend_routing.store import reader as stored

SECRET = "VLLM_ASCEND_ROUTING_KV_SECRET"


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A node-local store in ``tmp_path``, the deployment's secret set, a fresh publisher for this process."""
    return deployment_store(tmp_path, monkeypatch)


def prefill(prompt: list[int], transfer: str, outputs: list[int] | None = None) -> Any:
    params = {"do_remote_decode": True, "transfer_id": transfer}
    return SimpleNamespace(
        request_id=f"p-{transfer}",
        prompt_token_ids=prompt,
        all_token_ids=prompt + (outputs or [7]),
        kv_transfer_params=params,
        num_output_tokens=1,
    )


def decode(prompt: list[int], transfer: str | None, request_id: str = "d") -> Any:
    params: dict[str, Any] = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_bootstrap_addr": "x"}
    if transfer is not None:
        params["transfer_id"] = transfer
    return SimpleNamespace(request_id=request_id, prompt_token_ids=prompt, kv_transfer_params=params)


LENT = (True, None)  # what MooncakeConnector's request_finished returns for blocks it lends (no parameters)


def test_keys_derive_names_that_only_the_secret_and_the_id_make() -> None:
    name = keys.derive(b"a", "mooncake-transfer", "t-1")
    assert keys.is_name(name) and name == keys.derive(b"a", "mooncake-transfer", "t-1")
    assert name != keys.derive(b"b", "mooncake-transfer", "t-1") != keys.derive(b"a", "mooncake-transfer", "t-2")
    assert name != keys.derive(b"a", "other-scope", "t-1")
    assert keys.object_of(name) == name and not keys.is_name(keys.Namespace.mint().key())
    with pytest.raises(keys.MalformedKeyError):
        keys.object_of("rxn.0123")  # too short: neither a name nor a key


def test_the_prefill_s_rows_reach_the_decode_request_by_transfer_id_exact(store: Path) -> None:
    carrier = TransferIdCarrier(object(), LAYOUT)
    prompt, other = list(range(100, 111)), list(range(200, 211))
    consumer = TransferIdCarrier(object(), LAYOUT)  # another instance, the same secret
    waiting = consumer.get(decode(prompt, "t-1"), 0, 11)
    assert isinstance(waiting, Pending) and "not in the row store" in waiting.reason  # the prefill has not finished
    assert carrier.put(prefill(prompt, "t-1"), rows(11), LENT) == 11
    assert carrier.put(prefill(other, "t-2"), rows(11, start=5), LENT) == 11
    assert np.array_equal(consumer.get(decode(prompt, "t-1"), 0, 11), rows(11))
    assert np.array_equal(consumer.get(decode(prompt, "t-1"), 4, 7), rows(11)[4:11])  # after a local hit of 4
    assert np.array_equal(consumer.get(decode(other, "t-2"), 0, 11), rows(11, start=5))  # each transfer its own
    swapped = consumer.get(decode(prompt, "t-2"), 0, 11)  # a prompt sent with another transfer's id
    assert isinstance(swapped, Missing) and "other tokens than this prompt's first 11" in swapped.reason
    past = consumer.get(decode(prompt + [1, 2], "t-1"), 0, 13)
    assert isinstance(past, Missing)  # tokens 11 and 12 have no row: never guessed
    no_id = consumer.get(decode(prompt, None), 0, 11)
    assert isinstance(no_id, Missing) and "no transfer_id" in no_id.reason
    wider = TransferIdCarrier(object(), type(LAYOUT)(3, 4, "uint8")).get(decode(prompt, "t-1"), 0, 11)
    assert isinstance(wider, Missing) and "another model or configuration" in wider.reason


def test_only_lent_kv_is_published_and_a_name_is_written_once(store: Path) -> None:
    carrier = TransferIdCarrier(object(), LAYOUT)
    prompt = list(range(100, 111))
    assert carrier.put(prefill(prompt, "t-1"), rows(11), (False, None)) == 0  # blocks freed at once: nothing lent
    request = prefill(prompt, "t-1")
    request.kv_transfer_params = {"do_remote_decode": False, "transfer_id": "t-1"}
    assert carrier.put(request, rows(11), LENT) == 0  # not a prefill for another instance
    assert list(store.glob("n-*")) == []
    assert carrier.put(prefill(prompt, "t-1"), rows(11), LENT) == 11
    assert carrier.put(prefill(prompt, "t-1"), rows(11, start=3), LENT) == 0  # the name is taken: first stays
    assert len(list(store.glob("n-*"))) == 1 and len([p for p in store.iterdir() if "-" in p.stem]) == 2
    assert np.array_equal(carrier.get(decode(prompt, "t-1"), 0, 11), rows(11))


def test_another_secret_finds_nothing_and_a_planted_pointer_is_refused(
    store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt = list(range(100, 111))
    TransferIdCarrier(object(), LAYOUT).put(prefill(prompt, "t-1"), rows(11), LENT)
    monkeypatch.setenv(SECRET, "deployment-b")
    foreign = TransferIdCarrier(object(), LAYOUT).get(decode(prompt, "t-1"), 0, 11)
    assert isinstance(foreign, Pending)  # its name differs: the rows are not found, never another's
    carrier = TransferIdCarrier(object(), LAYOUT)
    name, other = carrier.name("t-9"), carrier.name("t-1")
    (store / f"n-{name.split('.', 1)[1]}").write_bytes(b"".join(layout.encode_pointer(other, "rx1.x", "deadbeef")))
    planted = carrier.get(decode(prompt, "t-9"), 0, 11)
    assert isinstance(planted, Missing) and "points for another name" in planted.reason


def test_loaded_rows_are_freed_and_a_dead_prefill_s_pointer_is_swept(store: Path) -> None:
    carrier = TransferIdCarrier(object(), LAYOUT)
    prompt = list(range(100, 111))
    carrier.put(prefill(prompt, "t-1"), rows(11), LENT)
    key = stored.resolve(carrier.name("t-1"))
    carrier.settled(decode(prompt, "t-1"))
    assert stored.client().size(key) is None and stored.client().size(carrier.name("t-1")) is None
    assert isinstance(carrier.get(decode(prompt, "t-1"), 0, 11), Pending)
    carrier.put(prefill(prompt, "t-2"), rows(11), LENT)
    assert len(list(store.glob("n-*"))) == 1
    store_publisher.for_engine().close()  # type: ignore[union-attr]  # the prefill engine exits
    assert list(store.glob("n-*")) == []  # its shutdown removed the name with the rows
    carrier = TransferIdCarrier(object(), LAYOUT)
    store_publisher._publishers.clear()
    carrier.put(prefill(prompt, "t-3"), rows(11), LENT)
    publisher = store_publisher.for_engine()
    assert publisher is not None
    ledger = publisher.ledger()
    for lease in list(ledger.backend._leases.values()):  # type: ignore[attr-defined]  # SIGKILL: no shutdown ran
        __import__("os").close(lease)
    ledger.backend._leases.clear()  # type: ignore[attr-defined]
    shm.ShmBackend(str(store.parent)).sweep()
    assert list(store.glob("n-*")) == [] and list(store.glob("*-*")) == []


def test_rows_the_store_could_not_take_are_declined_at_once_with_the_reason(
    store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows the prefill could not store (its byte cap, VLLM_ASCEND_ROUTING_STORE_MIB, is 0 here): none lent, and the
    name says so, so the decode request declines at once, with the reason, instead of waiting."""
    monkeypatch.setenv("VLLM_ASCEND_ROUTING_STORE_MIB", "0")
    carrier = TransferIdCarrier(object(), LAYOUT)
    prompt = list(range(100, 111))
    assert carrier.put(prefill(prompt, "t-1"), rows(11), LENT) == 0
    assert len(list(store.glob("n-*"))) == 1 and not [p for p in store.iterdir() if p.name[:1] != "n" and "-" in p.stem]
    declined = TransferIdCarrier(object(), LAYOUT).get(decode(prompt, "t-1"), 0, 11)
    assert isinstance(declined, Missing) and "stored no rows" in declined.reason and "StoreFullError" in declined.reason
    assert isinstance(carrier.get(decode(prompt, "t-2"), 0, 11), Pending)  # another transfer: still to come


class MooncakeLike:
    """TEST-ONLY: the scheduler half of vLLM's MooncakeConnector as the follower sees it: every prompt token but the
    local hit offered for a remote prefill, loaded asynchronously."""

    def __init__(self) -> None:
        self.allocated: list[tuple[str, int]] = []

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return len(request.prompt_token_ids) - num_computed_tokens, True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.allocated.append((request.request_id, num_external_tokens))

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, None]:
        return True, None


def followed(monkeypatch: pytest.MonkeyPatch, role: str) -> tuple[MooncakeLike, StandInRows, Any]:
    from vllm_ascend_routing import validate

    monkeypatch.setattr(validate.ModelRouting, "from_vllm_config", staticmethod(lambda config: MODEL))
    promoted: list[tuple[str, int, bool]] = []
    scheduler = SimpleNamespace(
        vllm_config=SimpleNamespace(
            kv_transfer_config=kv_config("MooncakeConnector", role), cache_config=SimpleNamespace(block_size=4)
        ),
        failed_recving_kv_req_ids=set(),
        promoted=promoted,
    )

    def update_waiting_for_remote_kv(request: Any) -> None:  # vLLM's: the received KV cached, or a failed load's not
        failed = request.request_id in scheduler.failed_recving_kv_req_ids
        scheduler.failed_recving_kv_req_ids.discard(request.request_id)
        promoted.append((request.request_id, request.num_computed_tokens, failed))

    scheduler._update_waiting_for_remote_kv = update_waiting_for_remote_kv
    connector, rows_store = MooncakeLike(), StandInRows()
    follower.follow(scheduler, connector, rows_store)
    return connector, rows_store, scheduler


def test_the_decode_request_waits_for_the_rows_then_loads_them(store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ASCEND_ROUTING_STORE", "shm")
    producer, produced, _ = followed(monkeypatch, "kv_producer")
    consumer, consumed, scheduler = followed(monkeypatch, "kv_consumer")
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    prompt = list(range(100, 120))
    request = decode(prompt, "t-1", "d1")
    assert consumer.get_num_new_matched_tokens(request, 4) == (None, False)  # not yet: vLLM asks again
    clock[0] += follower.POLL_S
    assert consumer.get_num_new_matched_tokens(request, 4) == (None, False)
    produced.prompts["p-t-1"] = rows(20)
    producer.request_finished(prefill(prompt, "t-1"), ([0, 1],))
    clock[0] += follower.POLL_S
    assert consumer.get_num_new_matched_tokens(request, 4) == (16, True)
    consumer.update_state_after_alloc(request, "blocks", 16)
    (injected,) = consumed.injected
    assert injected[:2] == ("d1", 4) and np.array_equal(injected[2], rows(20)[4:20])
    assert kv.loaded_span(request) == (4, 16)
    assert stored.client().size(TransferIdCarrier(object(), LAYOUT).name("t-1")) is None  # freed once loaded
    request.num_computed_tokens = 20  # the KV received
    scheduler._update_waiting_for_remote_kv(request)
    assert scheduler.promoted == [("d1", 20, False)]  # loaded, kept


def test_a_waiting_request_asks_the_store_at_most_every_poll_interval(
    store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM asks again at every scheduler step; a Mooncake store answers each look-up over the network: a waiting
    request's store is asked again only once POLL_S has passed (below it: not; at it: again)."""
    consumer, _, _ = followed(monkeypatch, "kv_consumer")
    asked: list[str] = []
    resolve = stored.resolve
    monkeypatch.setattr(stored, "resolve", lambda name, **kw: asked.append(name) or resolve(name, **kw))
    clock = [0.0]  # exact in binary at the interval's boundary
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    first, second = decode(list(range(100, 120)), "t-a", "da"), decode(list(range(200, 220)), "t-b", "db")
    for request in (first, second):
        assert consumer.get_num_new_matched_tokens(request, 0) == (None, False)
    assert len(asked) == 2  # each its own look-up
    clock[0] = follower.POLL_S * 0.95  # the next step, just below the interval: no look-up
    for request in (first, second):
        assert consumer.get_num_new_matched_tokens(request, 0) == (None, False)
    assert len(asked) == 2
    clock[0] = follower.POLL_S  # at it: asked again
    assert consumer.get_num_new_matched_tokens(first, 0) == (None, False)
    assert len(asked) == 3


@pytest.mark.parametrize("wait_s", [0, 1])
def test_rows_that_never_come_are_declined_at_the_deadline_and_the_kv_discarded(
    store: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, wait_s: int
) -> None:
    """Past the wait the load is declined, as vLLM declines a failed load: its hand-over still runs to its end (the
    connector reports the pull), then the received KV is discarded and the prompt computed from the local hit."""
    import logging
    import time

    caplog.set_level(logging.WARNING)
    monkeypatch.setenv("VLLM_ASCEND_ROUTING_KV_ROWS_WAIT_S", str(wait_s))
    consumer, consumed, scheduler = followed(monkeypatch, "kv_consumer")
    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    request = decode(list(range(100, 120)), "t-lost", "d2")
    before = kv.stats()
    if wait_s:
        assert consumer.get_num_new_matched_tokens(request, 4) == (None, False)
        clock[0] += wait_s - 0.01  # just below the deadline: still waiting
        assert consumer.get_num_new_matched_tokens(request, 4) == (None, False)
        clock[0] += 0.01  # at it
    assert consumer.get_num_new_matched_tokens(request, 4) == (16, True)  # the hand-over runs, to be discarded
    consumer.update_state_after_alloc(request, "blocks", 16)
    assert consumed.injected == [] and kv.loaded_span(request) is None
    request.num_computed_tokens = 20  # the KV received
    scheduler._update_waiting_for_remote_kv(request)
    assert scheduler.promoted == [("d2", 4, True)]  # vLLM's failed-load path: the local hit kept, the rest computed
    after = kv.stats()
    assert (after.offers_declined - before.offers_declined, after.rows_declined - before.rows_declined) == (1, 16)
    assert after.requests_waited - before.requests_waited == 1
    reported = [r.getMessage() for r in caplog.records if "request d2" in r.getMessage()]
    assert any("t-lost" in text and "VLLM_ASCEND_ROUTING_KV_ROWS_WAIT_S" in text for text in reported), reported
    assert any("its KV is received, then discarded" in text for text in reported), reported
    other = decode(list(range(100, 120)), "t-other", "d3")  # a load that was never discarded: promoted unchanged
    other.num_computed_tokens = 20
    scheduler._update_waiting_for_remote_kv(other)
    assert scheduler.promoted[-1] == ("d3", 20, False)


def test_mooncake_connector_is_served_only_with_a_store_and_a_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    config = kv_config("MooncakeConnector", "kv_consumer")
    for store_value, secret in (("", ""), ("shm", ""), ("", "s")):
        monkeypatch.setenv("VLLM_ASCEND_ROUTING_STORE", store_value)
        monkeypatch.setenv(SECRET, secret)
        assert not kv.serves(config)
        message = kv.refusal(config, "runner-output")
        assert "VLLM_ASCEND_ROUTING_STORE" in message and "VLLM_ASCEND_ROUTING_KV_SECRET" in message
        with pytest.raises(UnsupportedVllmError, match="MooncakeConnector"):
            kv.refuse_uncovered(
                SimpleNamespace(kv_transfer_config=config), "runner-output", SimpleNamespace(patches=())
            )
    monkeypatch.setenv("VLLM_ASCEND_ROUTING_STORE", "shm")
    monkeypatch.setenv(SECRET, "s")
    assert kv.serves(config) and not kv.holds_rows(config) and kv.lifts(config, "MooncakeConnector")
    assert registry.CARRIERS["MooncakeConnector"] is TransferIdCarrier
