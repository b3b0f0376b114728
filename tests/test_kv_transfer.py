# SPDX-License-Identifier: Apache-2.0
"""Rows follow a KV connector's loads and saves in the scheduler (no vLLM needed: stand-ins for the connector,
the carrier and the generation's store; the real ones run end to end in tests/e2e/test_disaggregation.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from vllm_ascend_routing import kv, patching, validate
from vllm_ascend_routing.compat.interface import UnsupportedVllmError
from vllm_ascend_routing.kv import Missing, RowLayout, carriers, follower, registry
from vllm_ascend_routing.patching import RELY

LAYOUT = RowLayout(3, 2, "uint8")
MODEL = validate.ModelRouting(num_experts=8, num_layers=3, moe_layers=frozenset({0, 2}))


def rows(count: int, start: int = 0) -> np.ndarray:
    """Valid rows of tokens ``[start, start + count)``: two distinct experts in MoE layers 0 and 2, layer 1 dense."""
    base = (np.arange(start, start + count)[:, None] + np.array([0, 3])[None, :]) % 7
    out = np.zeros((count, 3, 2), dtype=np.uint8)
    out[:, [0, 2], 0], out[:, [0, 2], 1] = base, base + 1
    return out


class OfferingConnector:
    """TEST-ONLY: the scheduler half of a connector that offers ``offers[request]`` tokens after the local hit."""

    def __init__(self, offers: dict[str, int]) -> None:
        self.offers = offers
        self.allocated: list[tuple[str, int]] = []
        self.finished: list[str] = []

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return self.offers.get(request.request_id, 0), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.allocated.append((request.request_id, num_external_tokens))

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, None]:
        self.finished.append(request.request_id)
        return False, None


class StandInCarrier:
    """TEST-ONLY: rows stored per request id, as a carrier would keep them beside the KV."""

    connector = "OfferingConnector"

    def __init__(self, connector: Any, layout: RowLayout) -> None:
        self.stored: dict[str, np.ndarray] = {}
        self.puts: list[tuple[str, int]] = []
        self.finished: list[Any] = []  # what the connector's request_finished returned, per put

    def put(self, request: Any, prompt_rows: np.ndarray, finished: Any = None) -> int:
        self.puts.append((request.request_id, len(prompt_rows)))
        self.finished.append(finished)
        return len(prompt_rows)

    def get(self, request: Any, start: int, count: int) -> np.ndarray | Missing:
        stored = self.stored.get(request.request_id)
        if stored is None:
            return Missing("no routing rows are stored beside that KV (test)")
        return stored[start : start + count]


class StandInRows:
    """TEST-ONLY: a generation's store, recording what it is given."""

    layout = LAYOUT

    def __init__(self) -> None:
        self.injected: list[tuple[str, int, np.ndarray]] = []
        self.prompts: dict[str, np.ndarray] = {}
        self.forgotten: list[str] = []

    def finished_rows(self, request: Any, block_ids: Any) -> np.ndarray | None:
        return self.prompts.get(request.request_id)

    def inject(self, request: Any, blocks: Any, start: int, carried: np.ndarray) -> None:
        self.injected.append((request.request_id, start, carried))

    def forget(self, request_id: str) -> None:
        self.forgotten.append(request_id)


def request(request_id: str, outputs: int = 0) -> Any:
    return SimpleNamespace(request_id=request_id, num_output_tokens=outputs, num_prompt_tokens=20)


def follow(offers: dict[str, int]) -> tuple[OfferingConnector, StandInCarrier, StandInRows]:
    connector, store = OfferingConnector(offers), StandInRows()
    followed = follower.Follower(connector, store, StandInCarrier(connector, LAYOUT), MODEL)
    carrier = followed.carrier
    assert isinstance(carrier, StandInCarrier)
    for name, make in (
        ("get_num_new_matched_tokens", followed.matched),
        ("update_state_after_alloc", followed.allocated),
        ("request_finished", followed.finished),
    ):
        setattr(connector, name, make(getattr(connector, name)))
    return connector, carrier, store


def test_loaded_tokens_get_the_rows_carried_with_their_kv() -> None:
    connector, carrier, store = follow({"r1": 8})
    carrier.stored["r1"] = rows(20)
    before = kv.stats()
    r1 = request("r1")
    assert connector.get_num_new_matched_tokens(r1, 4) == (8, False)  # local hit of 4, 8 more offered
    connector.update_state_after_alloc(r1, "blocks", 8)
    (injected,) = store.injected
    assert injected[:2] == ("r1", 4) and np.array_equal(injected[2], rows(20)[4:12])
    assert kv.loaded_span(r1) == (4, 8) and kv.loaded_rows(r1) == 8
    assert kv.loaded_rows(request("r2")) == 0 and kv.loaded_span(request("r2")) is None
    after = kv.stats()
    assert (after.requests_loaded - before.requests_loaded, after.rows_loaded - before.rows_loaded) == (1, 8)


def test_an_offer_without_rows_is_declined_and_reported_by_request_and_token() -> None:
    connector, _, store = follow({"r7": 12})
    before = kv.stats()
    r7 = request("r7")
    assert connector.get_num_new_matched_tokens(r7, 4) == (0, False)  # declined: vLLM computes them here
    connector.update_state_after_alloc(r7, "blocks", 0)
    assert store.injected == [] and kv.loaded_rows(r7) == 0
    after = kv.stats()
    assert (after.offers_declined - before.offers_declined, after.rows_declined - before.rows_declined) == (1, 12)
    assert any("request r7" in text and "[4, 16)" in text and "no routing rows" in text for text in kv.first_reports())


@pytest.mark.parametrize("strict", [False, True])
def test_carried_rows_that_break_the_contract_are_never_passed_on(
    monkeypatch: pytest.MonkeyPatch, strict: bool
) -> None:
    monkeypatch.setenv("VLLM_ASCEND_ROUTING_VALIDATE", "strict" if strict else "1")
    connector, carrier, store = follow({"r3": 8})
    carrier.stored["r3"] = rows(20)
    carrier.stored["r3"][6, 0] = 0  # an all-zero MoE row: a slot never written
    if strict:
        with pytest.raises(validate.RoutingValidationError, match="request r3"):
            connector.get_num_new_matched_tokens(request("r3"), 0)
        return
    assert connector.get_num_new_matched_tokens(request("r3"), 0) == (0, False)
    assert store.injected == []


def test_loading_tokens_no_rows_were_carried_for_is_refused() -> None:
    connector, carrier, _ = follow({"r4": 4})
    carrier.stored["r4"] = rows(20)
    connector.get_num_new_matched_tokens(request("r4"), 0)
    with pytest.raises(RuntimeError, match="r4 loads 6 tokens"):
        connector.update_state_after_alloc(request("r4"), "blocks", 6)


def test_a_finished_request_stores_its_prompt_rows_beside_its_kv() -> None:
    connector, carrier, store = follow({})
    store.prompts["done"] = rows(20)
    store.prompts["aborted"] = rows(20)
    before = kv.stats()
    assert connector.request_finished(request("done", outputs=1), [0, 1]) == (False, None)
    connector.request_finished(request("aborted", outputs=0), [0, 1])  # its prompt rows may be incomplete
    assert carrier.puts == [("done", 20)]
    assert connector.finished == ["done", "aborted"] and store.forgotten == ["done", "aborted"]
    assert kv.stats().rows_stored - before.rows_stored == 20
    store.prompts["bad"] = rows(20)
    store.prompts["bad"][3, 1] = 5  # a dense layer with ids: not routing, not stored
    connector.request_finished(request("bad", outputs=1), [0, 1])
    assert carrier.puts == [("done", 20)]


def kv_config(name: str | None, role: str = "kv_consumer", extra: Any = None) -> Any:
    return SimpleNamespace(kv_connector=name, kv_role=role, kv_connector_extra_config=extra)


def test_refusals_name_the_connector_and_what_to_do() -> None:
    nccl = kv.refusal(kv_config("P2pNcclConnector"), "runner-output")
    assert "P2pNcclConnector (kv_consumer) is not covered" in nccl and "RDMA/NCCL" in nccl
    assert "remove --kv-transfer-config" in nccl and kv.DOCS in nccl and "Served: NixlConnector" in nccl
    push = kv.refusal(kv_config("NixlPushConnector"), "aux-output")
    assert "NixlPushConnector (kv_consumer) is not covered: in NIXL's push mode" in push and "use NixlConnector" in push
    inside = [{"kv_connector": "NixlConnector"}, {"kv_connector": "OffloadingConnector"}]
    nixl_inside = kv.refusal(kv_config("MultiConnector", "kv_both", {"connectors": inside}), "aux-output")
    assert "NixlConnector (inside MultiConnector) (kv_both) is not covered" in nixl_inside
    assert "configure it alone" in nixl_inside
    inner = [{"kv_connector": "OffloadingConnector"}, {"kv_connector": "MooncakeConnector"}]
    multi = kv.refusal(kv_config("MultiConnector", "kv_both", {"connectors": inner}), "aux-output")
    assert "MooncakeConnector (inside MultiConnector) (kv_both) is not covered" in multi
    old = kv.refusal(kv_config("ExampleConnector"), "shm", carried_here=False)
    assert "served from vLLM 0.22 on" in old and "'shm'" in old


@pytest.mark.parametrize(
    ("name", "extra", "served", "held"),
    [
        ("ExampleConnector", None, True, False),  # rows carried beside its KV
        ("OffloadingConnector", None, True, True),  # offload tiers, cache services, custom connectors: held here
        ("LMCacheConnectorV1", None, True, True),
        ("MyConnector", None, True, True),
        ("MultiConnector", {"connectors": [{"kv_connector": "OffloadingConnector"}]}, True, True),
        ("MultiConnector", {"connectors": [{"kv_connector": "NixlConnector"}]}, False, False),  # alone only
        ("MultiConnector", {"connectors": [{"kv_connector": "ExampleConnector"}]}, True, True),
        ("NixlConnector", None, True, False),  # rows carried in its kv_transfer_params
        ("NixlPullConnector", None, True, False),  # vLLM's name for the same connector
        ("NixlPushConnector", None, False, False),  # KV handed over between instances another way: refused
        ("P2pNcclConnector", None, False, False),
        ("MooncakeConnector", None, False, False),  # without a row store and a secret (below: with them)
        ("MooncakeConnectorV1", None, True, False),  # vllm-ascend's P/D, rows in its parameters (tests/ascend/)
        ("MooncakeHybridConnector", None, True, False),
        ("MooncakeLayerwiseConnector", None, False, False),  # vllm-ascend's push P/D: no parameters
        ("MultiConnector", {"connectors": [{"kv_connector": "MooncakeConnectorV1"}]}, False, False),  # alone only
        ("MooncakeConnectorStoreV1", None, True, True),  # vllm-ascend's KV pool: a store
        (None, None, False, False),
    ],
)
def test_which_connectors_are_served_and_how(name: str | None, extra: Any, served: bool, held: bool) -> None:
    config = kv_config(name, "kv_both", extra)
    assert (kv.serves(config), kv.holds_rows(config)) == (served, held)
    assert not kv.serves(None) and kv.connector_name(kv_config(None)) is None


def test_refuse_uncovered_at_model_load() -> None:
    carrying: Any = SimpleNamespace(patches=())
    kv.refuse_uncovered(SimpleNamespace(kv_transfer_config=None), "runner-output", carrying)
    kv.refuse_uncovered(SimpleNamespace(kv_transfer_config=kv_config(None)), "runner-output", carrying)
    kv.refuse_uncovered(SimpleNamespace(kv_transfer_config=kv_config("ExampleConnector")), "runner-output", carrying)
    kv.refuse_uncovered(SimpleNamespace(kv_transfer_config=kv_config("OffloadingConnector")), "aux-output", carrying)
    kv.refuse_uncovered(SimpleNamespace(kv_transfer_config=kv_config("NixlConnector")), "aux-output", carrying)
    with pytest.raises(UnsupportedVllmError, match="MooncakeConnector"):
        kv.refuse_uncovered(SimpleNamespace(kv_transfer_config=kv_config("MooncakeConnector")), "aux-output", carrying)
    with pytest.raises(UnsupportedVllmError, match="served from vLLM 0.22 on"):  # a generation without kv_rows
        kv.refuse_uncovered(SimpleNamespace(kv_transfer_config=kv_config("ExampleConnector")), "shm", None)
    absent = carriers.patches()[0]
    for lacking, relied in ((SimpleNamespace(patches=(absent,)), ()), (carrying, (absent,))):
        with pytest.raises(UnsupportedVllmError, match="lacks what the plugin carries its rows with"):
            kv.refuse_uncovered(
                SimpleNamespace(kv_transfer_config=kv_config("ExampleConnector")), "aux", lacking, relied
            )


def test_the_scheduler_hook_follows_only_a_connector_with_routed_experts(monkeypatch: pytest.MonkeyPatch) -> None:
    followed: list[Any] = []
    monkeypatch.setattr(follower, "follow", lambda scheduler, connector, rows: followed.append(connector))
    store = StandInRows()

    class KvRows:
        patches = ()

        def install(self) -> None: ...

        def attach(self, scheduler: Any) -> Any:
            return store if scheduler.routed else None

    def init(self: Any, connector: Any, routed: bool) -> None:
        self.connector, self.routed = connector, routed

    wrapped = follower.attaching(init, KvRows())
    for connector, routed in (("c1", True), (None, True), ("c3", False)):
        wrapped(SimpleNamespace(), connector, routed)
    assert followed == ["c1"]


def test_connector_rows_are_relied_on_not_replaced() -> None:
    rows_ = follower.connector_patches()
    assert [row.target.rpartition(".")[2] for row in rows_] == [
        "get_num_new_matched_tokens",
        "update_state_after_alloc",
        "request_finished",
        "request_finished_all_groups",
        "_update_waiting_for_remote_kv",  # the scheduler's: a declined MooncakeConnector load discarded (kv.named)
    ]
    assert all(row.action == RELY and not row.required for row in rows_)  # checked once a connector is configured


def test_model_load_refuses_through_the_kv_rules(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_common.refuse_unsupported_config`` (every generation's prepare) asks ``refuse_uncovered``: a covered
    connector passes where the generation carries rows, anything else is refused by name."""
    from vllm_ascend_routing.compat import _common

    def config(name: str) -> Any:
        return SimpleNamespace(parallel_config=SimpleNamespace(), kv_transfer_config=kv_config(name))

    carrying: Any = SimpleNamespace(patches=())
    monkeypatch.setattr(kv, "RELIED", ())  # no vLLM here: nothing it relies on resolves
    _common.refuse_unsupported_config(config("ExampleConnector"), "runner-output", carrying)
    _common.refuse_unsupported_config(config("LMCacheConnectorV1"), "runner-output", carrying)
    with pytest.raises(UnsupportedVllmError, match="P2pNcclConnector .kv_consumer. is not covered"):
        _common.refuse_unsupported_config(config("P2pNcclConnector"), "runner-output", carrying)
    with pytest.raises(UnsupportedVllmError, match="served from vLLM 0.22 on"):
        _common.refuse_unsupported_config(config("ExampleConnector"), "device-cache", None)


def test_a_connector_without_a_carrier_serves_the_rows_this_instance_computed(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``_follow`` with an offload tier: rows of a finished prompt are held in the scheduler, a load of that KV gets
    them, a load of KV computed elsewhere is declined, and vLLM's prefix-cache reset drops what is held."""
    monkeypatch.setattr(validate.ModelRouting, "from_vllm_config", staticmethod(lambda config: MODEL))
    monkeypatch.setenv("VLLM_ASCEND_ROUTING_KV_HELD_ROWS_MIB", "1")
    resets: list[bool] = []

    class Scheduler:
        def reset_prefix_cache(self) -> bool:
            resets.append(True)
            return True

    # As in vLLM with the plugin: the class's reset_prefix_cache is already another patch's replacement.
    patching.wrap(Scheduler, "reset_prefix_cache", lambda original: lambda self: original(self))
    config = SimpleNamespace(
        kv_transfer_config=kv_config("OffloadingConnector", "kv_both"),
        cache_config=SimpleNamespace(block_size=4),
        model_config=SimpleNamespace(model="/models/tiny-moe"),
    )
    scheduler = Scheduler()
    scheduler.vllm_config = config  # type: ignore[attr-defined]
    connector, store = OfferingConnector({"tier": 8, "elsewhere": 8}), StandInRows()
    follower.follow(scheduler, connector, store)
    held = kv.held_rows(scheduler)
    assert held is not None and held.capacity == 1 << 20  # VLLM_ASCEND_ROUTING_KV_HELD_ROWS_MIB=1

    def prompt_request(request_id: str, prompt: list[int], outputs: int = 0) -> Any:
        return SimpleNamespace(
            request_id=request_id, prompt_token_ids=prompt, num_output_tokens=outputs, mm_features=[]
        )

    prompt = list(range(30, 42))
    store.prompts["first"] = rows(12)
    connector.request_finished(prompt_request("first", prompt, outputs=1), [0, 1, 2])  # computed here: held
    tier = prompt_request("tier", prompt)
    assert connector.get_num_new_matched_tokens(tier, 0) == (8, False)
    connector.update_state_after_alloc(tier, "blocks", 8)
    assert np.array_equal(store.injected[-1][2], rows(12)[:8]) and kv.loaded_span(tier) == (0, 8)
    elsewhere = prompt_request("elsewhere", list(range(50, 62)))  # KV computed by another instance
    assert connector.get_num_new_matched_tokens(elsewhere, 0) == (0, False)
    assert scheduler.reset_prefix_cache() is True and resets == [True]
    again = prompt_request("tier", prompt)
    assert connector.get_num_new_matched_tokens(again, 0) == (0, False)  # the weights may have changed since
    assert any("request elsewhere" in r.message and "not held on this instance" in r.message for r in caplog.records)


@pytest.mark.parametrize(
    ("name", "lifted"),
    [("NixlConnector", True), ("NixlPullConnector", True), ("ExampleConnector", True), ("NixlPushConnector", False)],
)
def test_vllm_s_own_refusal_is_lifted_only_for_connectors_with_a_carrier(name: str, lifted: bool) -> None:
    assert kv.lifts(kv_config(name), name) is lifted
    assert not kv.lifts(kv_config("OffloadingConnector"), "NixlConnector")  # not configured: not lifted
    inside = kv_config("MultiConnector", "kv_both", {"connectors": [{"kv_connector": "NixlConnector"}]})
    assert not kv.lifts(inside, "NixlConnector")  # refused inside MultiConnector


class HybridConnector(OfferingConnector):
    """TEST-ONLY: a connector that supports vLLM's hybrid allocator (SupportsHMA: NIXL, the offload connectors,
    MultiConnector): the scheduler calls ``request_finished_all_groups`` for it, never ``request_finished``."""

    def request_finished_all_groups(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any]]:
        self.finished.append(request.request_id)
        return True, {"do_remote_prefill": True, "remote_block_ids": block_ids}


def test_a_hybrid_allocator_connector_s_finished_requests_are_followed(monkeypatch: pytest.MonkeyPatch) -> None:
    """``_follow`` wraps both finishing calls: a finished request's rows go to the carrier with what the connector
    returned (NIXL's rows ride in those parameters), and the generation's per-request rows are dropped."""
    monkeypatch.setattr(validate.ModelRouting, "from_vllm_config", staticmethod(lambda config: MODEL))
    made: list[StandInCarrier] = []

    def carrier(connector: Any, layout: RowLayout) -> StandInCarrier:
        made.append(StandInCarrier(connector, layout))
        return made[-1]

    monkeypatch.setitem(registry.CARRIERS, "HybridConnector", carrier)
    scheduler = SimpleNamespace(
        vllm_config=SimpleNamespace(
            kv_transfer_config=kv_config("HybridConnector", "kv_producer"), cache_config=SimpleNamespace(block_size=4)
        )
    )
    connector, store = HybridConnector({}), StandInRows()
    follower.follow(scheduler, connector, store)
    store.prompts["p1"] = rows(20)
    returned = connector.request_finished_all_groups(request("p1", outputs=1), ([0, 1],))
    assert returned == (True, {"do_remote_prefill": True, "remote_block_ids": ([0, 1],)})
    assert store.forgotten == ["p1"] and connector.finished == ["p1"]
    (stand_in,) = made
    assert stand_in.puts == [("p1", 20)] and stand_in.finished == [returned]
