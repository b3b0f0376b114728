# SPDX-License-Identifier: Apache-2.0
"""Shared KV caches (``kv.shared``): with a row store and a deployment secret, each whole block of a salted request's
rows is named by model, layout, cache salt and its token chain, so that another instance's hit on the cache loads
them; a block without rows under exactly those (absent, released, another salt, model or layout), a request without a
salt, and a salt used across a prefix-cache reset are declined (computed there). The e2e run:
tests/e2e/test_mooncake_store.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from tests.store.local import deployment_store, shm_ledger
from tests.test_kv_transfer import LAYOUT, MODEL, StandInRows, kv_config, rows
from vllm_ascend_routing import kv
from vllm_ascend_routing.kv import follower
from vllm_ascend_routing.kv.carriers import HeldRowsCarrier, Missing, RowLayout
from vllm_ascend_routing.kv.shared import NO_SALT, SharedCacheCarrier, with_store
from vllm_ascend_routing.store import keys as keys_module
from vllm_ascend_routing.store import publisher as store_publisher
from vllm_ascend_routing.store import reader as stored

BLOCK = 4
SECRET = "VLLM_ASCEND_ROUTING_KV_SECRET"


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node-local store in ``tmp_path``, the deployment's secret set, a fresh publisher for this process."""
    deployment_store(tmp_path, monkeypatch)


def instance(model: str = "tiny-moe", layout: RowLayout = LAYOUT) -> SharedCacheCarrier:
    """One instance's carrier (its own held rows: nothing of another instance's memory)."""
    return SharedCacheCarrier(HeldRowsCarrier("MooncakeStoreConnector", layout, BLOCK, 1 << 20), model)


def finished(prompt: list[int], salt: str | None, outputs: int = 1, request_id: str = "r") -> Any:
    return SimpleNamespace(
        request_id=request_id,
        prompt_token_ids=prompt,
        all_token_ids=prompt + [9] * outputs,
        cache_salt=salt,
        lora_request=None,
        mm_features=[],
    )


def arriving(prompt: list[int], salt: str | None) -> Any:
    return SimpleNamespace(request_id="b", prompt_token_ids=prompt, cache_salt=salt, lora_request=None, mm_features=[])


def test_another_instance_s_hit_loads_the_computing_instance_s_rows_exact(store: None) -> None:
    """Two prompts sharing their first block, each its own rows from the second on, written by A, loaded by B: every
    window (from the start, after a local hit, ending inside a block) is the writer's rows exactly."""
    a, b = instance(), instance()
    first, second = list(range(10, 24)), list(range(10, 14)) + list(range(50, 60))
    a_rows, b_rows = rows(15, 0), np.concatenate([rows(4, 0), rows(11, 40)])
    assert a.put(finished(first, "v1"), a_rows) == 15  # held there: every token's
    assert a.put(finished(second, "v1", request_id="r2"), b_rows) == 11  # its first block is held already
    assert a.names_written == 3 + 2  # whole blocks of the sequences' 15 rows: 3 each, the shared first one once
    for prompt, expected in ((first, a_rows), (second, b_rows)):
        assert np.array_equal(b.get(arriving(prompt, "v1"), 0, 12), expected[:12])
        assert np.array_equal(b.get(arriving(prompt, "v1"), 4, 8), expected[4:12])  # after a local hit of a block
        assert np.array_equal(b.get(arriving(prompt, "v1"), 0, 10), expected[:10])  # ends inside the third block
    assert b.held.held_bytes == 0  # read from the store, nothing taken into B's memory


def test_without_a_salt_nothing_is_shared_and_the_load_is_declined(store: None) -> None:
    a, b = instance(), instance()
    prompt = list(range(30, 42))
    a.put(finished(prompt, None), rows(12))
    assert a.names_written == 0
    declined = b.get(arriving(prompt, None), 0, 8)
    assert isinstance(declined, Missing) and NO_SALT in declined.reason
    assert np.array_equal(a.get(arriving(prompt, None), 0, 8), rows(12)[:8])  # its own KV: held rows, as before


@pytest.mark.parametrize(
    ("reader", "salt", "why"),
    [
        ("tiny-moe", "v2", "another weight version (salt)"),
        ("other-moe", "v1", "another model"),
        ("tiny-moe:layout", "v1", "another layout"),
    ],
)
def test_rows_of_another_salt_model_or_layout_are_never_found(store: None, reader: str, salt: str, why: str) -> None:
    a = instance()
    prompt = list(range(60, 72))
    a.put(finished(prompt, "v1"), rows(12))
    other = instance(layout=RowLayout(3, 2, "int16")) if reader.endswith(":layout") else instance(reader)
    declined = other.get(arriving(prompt, salt), 0, 8)
    assert isinstance(declined, Missing) and "no instance's rows of the block of tokens [4, 8)" in declined.reason, why
    assert np.array_equal(instance().get(arriving(prompt, "v1"), 0, 8), rows(12)[:8])  # the right ones: found


def test_a_load_is_served_by_the_name_of_the_block_it_ends_in_or_declined_whole(store: None) -> None:
    """That block's name commits to every token before it, and its object holds the whole prefix's rows: a load
    ending there is served from it whatever became of the earlier blocks' names, and declined whole without it."""
    a, b = instance(), instance()
    prompt = list(range(70, 82))
    a.put(finished(prompt, "v1"), rows(12))
    request = arriving(prompt, "v1")
    keys = [key for _, key, _, _ in a.held.chain(request, np.asarray(prompt, dtype=np.int64), 12)]
    assert stored.release(a.name("v1", keys[1])) == 1  # the second block's name gone (evicted, expired)
    assert np.array_equal(b.get(request, 0, 12), rows(12))  # ends in the third block: its name holds [0, 12)
    assert np.array_equal(b.get(request, 2, 2), rows(12)[2:4])  # ends in the first
    declined = b.get(request, 4, 4)  # ends in the second
    assert isinstance(declined, Missing) and "block of tokens [4, 8)" in declined.reason
    assert stored.release(a.name("v1", keys[2])) == 1
    declined = b.get(request, 0, 12)
    assert isinstance(declined, Missing) and "block of tokens [8, 12)" in declined.reason


def test_a_load_ending_in_the_partial_last_block_is_declined(store: None) -> None:
    a, b = instance(), instance()
    prompt = list(range(80, 90))  # 10 tokens: blocks [0, 4), [4, 8) whole, [8, 10) partial
    a.put(finished(prompt, "v1", outputs=4), rows(14))  # the generated tokens complete the block, not the prompt
    declined = b.get(arriving(prompt, "v1"), 4, 5)
    assert isinstance(declined, Missing) and "partial block" in declined.reason
    assert np.array_equal(b.get(arriving(prompt, "v1"), 4, 4), rows(14)[4:8])  # at the whole blocks' end: found


def test_the_first_instance_s_rows_are_kept_as_the_cache_keeps_its_first_kv(store: None) -> None:
    a, c, b = instance(), instance(), instance()
    prompt = list(range(90, 102))
    a.put(finished(prompt, "v1"), rows(12, 0))
    ledger = _ledger()
    held = dict(ledger.entries)
    c.put(finished(prompt, "v1"), rows(12, 3))  # the same block computed again elsewhere (or another sample here)
    assert (a.names_written, c.names_written) == (3, 0)
    assert ledger.entries == held  # every block named already: no rows written for it
    assert np.array_equal(b.get(arriving(prompt, "v1"), 0, 12), rows(12, 0))
    longer = prompt + list(range(300, 304))  # one more block: only its name is new, and rows up to its end stored
    c.put(finished(longer, "v1"), rows(16, 3))
    assert c.names_written == 1 and len(ledger.entries) == len(held) + 2  # the rows and one pointer
    assert np.array_equal(b.get(arriving(longer, "v1"), 0, 16), rows(16, 3))  # ends in C's block: C's prefix


def test_rows_the_store_cannot_take_leave_no_name_behind(store: None) -> None:
    """Past the byte cap the rows are not stored, and the names written for them are removed again: another instance
    computes those blocks instead of finding a name without rows for good."""
    a, b = instance(), instance()
    prompt = list(range(140, 152))
    ledger = _ledger()
    ledger.cap_bytes = ledger.live_bytes + 100  # the pointers fit, the rows (a header and 72 bytes) do not
    a.put(finished(prompt, "v1"), rows(12))
    assert a.names_written == 0 and ledger.entries == {}
    chain = a.held.chain(arriving(prompt, "v1"), np.asarray(prompt, dtype=np.int64), 12)
    assert [stored.client().size(a.name("v1", key)) for _, key, _, _ in chain] == [None] * 3  # none left behind
    declined = b.get(arriving(prompt, "v1"), 0, 12)
    assert isinstance(declined, Missing) and "no instance's rows of the block of tokens [8, 12)" in declined.reason


def _ledger() -> Any:
    publisher = store_publisher.for_engine()
    assert publisher is not None
    return publisher.ledger()


def test_a_salt_used_across_a_prefix_cache_reset_is_refused_and_a_new_one_served(store: None) -> None:
    """The weight-version rule: a salt seen before a reset (a weight update) and again after it names no version."""
    a, b = instance(), instance()
    prompt = list(range(110, 122))
    a.put(finished(prompt, "step-1"), rows(12, 0))
    assert np.array_equal(b.get(arriving(prompt, "step-1"), 0, 8), rows(12, 0)[:8])  # seen by B: at reset 0
    b.clear()  # the weights were updated on B
    stale = b.get(arriving(prompt, "step-1"), 0, 8)
    assert isinstance(stale, Missing) and "does not name one weight version" in stale.reason
    a.clear()
    a.put(finished(prompt, "step-1"), rows(12, 5))  # A too: the salt reused after its update, not stored again
    assert a.names_written == 3
    a.put(finished(prompt, "step-2"), rows(12, 5))
    assert a.names_written == 6 and np.array_equal(b.get(arriving(prompt, "step-2"), 0, 12), rows(12, 5))


def test_a_store_and_a_secret_make_a_cache_service_s_carrier_shared(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = HeldRowsCarrier("MooncakeStoreConnector", LAYOUT, BLOCK, 1 << 20)
    monkeypatch.setattr(store_publisher, "_publishers", {})
    monkeypatch.delenv("VLLM_ASCEND_ROUTING_STORE", raising=False)
    monkeypatch.setenv(SECRET, "deployment-a")
    assert with_store(held, "MooncakeStoreConnector", "m") is held  # no store
    shm_ledger(tmp_path, monkeypatch)
    monkeypatch.setenv("VLLM_ASCEND_ROUTING_STORE", "shm")
    assert isinstance(with_store(held, "MooncakeStoreConnector", "m"), SharedCacheCarrier)
    assert isinstance(with_store(held, "AscendStoreConnector", "m"), SharedCacheCarrier)  # vllm-ascend's KV pool
    assert with_store(held, "LMCacheConnectorV1", "m") is held  # keys not known to include the salt
    assert with_store(held, "OffloadingConnector", "m") is held  # one instance's tier: nothing to share
    monkeypatch.delenv(SECRET)
    assert with_store(held, "MooncakeStoreConnector", "m") is held  # no secret: names another could plant


class CacheLike:
    """TEST-ONLY: the scheduler half of a shared cache as the follower sees it: ``hits[prompt length]`` tokens found
    in the cache after the local hit, loaded at once."""

    def __init__(self, hits: dict[int, int]) -> None:
        self.hits = hits
        self.allocated: list[tuple[str, int]] = []

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        return max(self.hits.get(len(request.prompt_token_ids), 0) - num_computed_tokens, 0), False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self.allocated.append((request.request_id, num_external_tokens))

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, None]:
        return False, None


def followed(monkeypatch: pytest.MonkeyPatch, hits: dict[int, int]) -> tuple[CacheLike, StandInRows, Any]:
    from vllm_ascend_routing import validate

    monkeypatch.setattr(validate.ModelRouting, "from_vllm_config", staticmethod(lambda config: MODEL))
    scheduler = SimpleNamespace(
        vllm_config=SimpleNamespace(
            kv_transfer_config=kv_config("MooncakeStoreConnector", "kv_both"),
            cache_config=SimpleNamespace(block_size=BLOCK),
            model_config=SimpleNamespace(model="/models/tiny-moe"),
        ),
        reset_prefix_cache=lambda: True,
    )
    connector, rows_store = CacheLike(hits), StandInRows()
    follower.follow(scheduler, connector, rows_store)
    return connector, rows_store, scheduler


def test_followed_schedulers_load_another_instance_s_rows_and_a_reset_stops_the_old_salt(
    store: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two schedulers, each with its own connector: B's hit on KV A computed loads A's rows; after B's prefix-cache
    reset the same salt is declined (computed there)."""
    computing, computed, _ = followed(monkeypatch, {})
    cache, loaded, scheduler_b = followed(monkeypatch, {14: 12})
    prompt = list(range(200, 214))
    computed.prompts["a1"] = rows(15, 2)
    request = finished(prompt, "step-1", request_id="a1")
    request.num_output_tokens = 1
    before = kv.stats()
    computing.request_finished(request, ([0, 1, 2],))
    assert kv.stats().rows_stored - before.rows_stored == 15  # held on A; its three whole blocks named too

    b1 = arriving(prompt, "step-1")
    assert cache.get_num_new_matched_tokens(b1, 4) == (8, False)  # local hit of 4, 8 more from the cache
    cache.update_state_after_alloc(b1, "blocks", 8)
    (injected,) = loaded.injected
    assert injected[:2] == ("b", 4) and np.array_equal(injected[2], rows(15, 2)[4:12])

    scheduler_b.reset_prefix_cache()
    before = kv.stats()
    assert cache.get_num_new_matched_tokens(arriving(prompt, "step-1"), 4) == (0, False)  # declined: computed
    after = kv.stats()
    assert (after.offers_declined - before.offers_declined, after.rows_declined - before.rows_declined) == (1, 8)


def test_a_name_pointing_at_fewer_rows_than_its_block_ends_at_is_declined(store: None) -> None:
    """A pointer under a block's name to the first rows of an object, fewer than the block's end (a writer's fault,
    or one planted with the secret): never read as that prefix's rows."""
    b = instance()
    prompt = list(range(120, 132))
    request = arriving(prompt, "v1")
    *_, (_, chain, _, _) = b.held.chain(request, np.asarray(prompt, dtype=np.int64), 12)
    publisher = store_publisher.for_engine()
    assert publisher is not None
    ledger = publisher.ledger()
    key = ledger.publish(rows(12), 0)
    ledger.name(b.name("v1", chain), keys_module.parse(key).with_rows(10))  # ends inside the last block
    declined = b.get(request, 0, 12)
    assert isinstance(declined, Missing) and "are (10, 3, 2) uint8: not these" in declined.reason
