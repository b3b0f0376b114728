# SPDX-License-Identifier: Apache-2.0
"""Rows beside ExampleConnector's KV (no vLLM needed: a stand-in with the connector's folder naming; the real
connector is run end to end by tests/e2e/test_disaggregation.py)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from vllm_ascend_routing.kv import carriers
from vllm_ascend_routing.kv.carriers import ROWS_FILE, Missing, RowLayout, SharedStorageCarrier

LAYOUT = RowLayout(3, 2, "uint8")
BLOCK = 4


def align(num_tokens: int, block_size: int) -> int:
    """ExampleConnector's rule: the whole blocks strictly before the last token."""
    return (num_tokens - 1) // block_size * block_size


class StandInConnector:
    """TEST-ONLY: ExampleConnector's block size and folder naming (a hash of the prefix's token ids)."""

    def __init__(self, root: Path) -> None:
        self._block_size = BLOCK
        self.root = root

    def _generate_foldername_debug(self, token_ids: Any, mm_hashes: list[str], create_folder: bool = False) -> str:
        folder = self.root / hashlib.md5(token_ids.numpy().tobytes()).hexdigest()
        if create_folder:
            folder.mkdir(parents=True, exist_ok=True)
        return str(folder)

    def store_kv(self, prompt: list[int]) -> Path:
        """What the connector does when it stores a prompt: a folder for its first whole blocks."""
        import torch

        return Path(self._generate_foldername_debug(torch.tensor(prompt)[: align(len(prompt), BLOCK)], [], True))


def request(prompt: list[int]) -> Any:
    return SimpleNamespace(request_id="r", prompt_token_ids=prompt, mm_features=[])


def rows(count: int, seed: int = 0) -> np.ndarray:
    """``count`` tokens' rows: two distinct experts per (token, layer), varying by token."""
    base = (np.arange(count)[:, None, None] + seed + np.arange(3)[None, :, None]) % 7
    return np.concatenate([base, base + 1], axis=2).astype(np.uint8)


@pytest.fixture
def carrier(tmp_path: Path) -> tuple[SharedStorageCarrier, StandInConnector]:
    connector = StandInConnector(tmp_path)
    return SharedStorageCarrier(connector, LAYOUT, align), connector


def test_rows_travel_beside_the_kv_the_connector_stored(carrier: Any) -> None:
    store, connector = carrier
    prompt = list(range(10, 21))  # 11 tokens: the connector stores 8
    folder = connector.store_kv(prompt)
    prompt_rows = rows(len(prompt))
    assert store.put(request(prompt), prompt_rows) == 8
    assert (folder / ROWS_FILE).exists()
    # The decode request (prompt + the producer's token) is offered tokens [4, 8) after a local hit of 4.
    loaded = store.get(request([*prompt, 99]), 4, 4)
    assert isinstance(loaded, np.ndarray) and np.array_equal(loaded, prompt_rows[4:8])
    assert not [name for name in os.listdir(folder) if name.startswith(".vllm_ascend_routing_")]  # no temp left


def test_nothing_is_stored_where_the_connector_stored_no_kv(carrier: Any) -> None:
    store, connector = carrier
    assert store.put(request(list(range(10, 21))), rows(11)) == 0  # no folder: the connector stored nothing
    assert store.put(request([1, 2, 3]), rows(3)) == 0  # under one block: nothing stored
    prompt = list(range(30, 41))
    connector.store_kv(prompt)
    assert store.put(request(prompt), rows(5)) == 0  # fewer rows than stored tokens: not written
    assert store.put(request(prompt), rows(11)) == 8
    assert store.put(request(prompt), rows(11, seed=1)) == 0  # already there: never overwritten


def test_kv_without_rows_is_missing_with_the_reason(carrier: Any) -> None:
    store, connector = carrier
    prompt = list(range(50, 61))
    connector.store_kv(prompt)  # a producer without the plugin: KV, no rows
    missing = store.get(request(prompt), 0, 8)
    assert isinstance(missing, Missing) and "no routing rows are stored beside that KV" in missing.reason


def test_rows_of_other_tokens_or_another_layout_are_missing(carrier: Any, tmp_path: Path) -> None:
    store, connector = carrier
    prompt = list(range(70, 81))
    folder = connector.store_kv(prompt)
    assert store.put(request(prompt), rows(11)) == 8
    # The same folder name with other token ids inside (a hash collision, a stale file): refused.
    stored = dict(np.load(folder / ROWS_FILE))
    stored["token_ids"] = stored["token_ids"] + 1
    np.savez(folder / ROWS_FILE, **stored)
    other = store.get(request(prompt), 0, 8)
    assert isinstance(other, Missing) and "other tokens" in other.reason
    wide = SharedStorageCarrier(connector, RowLayout(3, 2, "uint16"), align)
    prompt2 = list(range(90, 101))
    connector.store_kv(prompt2)
    assert store.put(request(prompt2), rows(11)) == 8
    mismatch = wide.get(request(prompt2), 0, 8)
    assert isinstance(mismatch, Missing) and "another model or configuration" in mismatch.reason


def test_patches_are_optional_relied_on_rows() -> None:
    from vllm_ascend_routing.patching import RELY

    rows_ = carriers.patches()
    assert rows_ and all(row.action == RELY and not row.required for row in rows_)
    assert {row.target.rpartition(":")[2] for row in rows_} == {
        "ExampleConnector._generate_foldername_debug",
        "align_to_block_size",
    }


# ---- rows held in the scheduler (every served connector without a carrier of its own) ----


def held_request(prompt: list[int], **identity: Any) -> Any:
    return SimpleNamespace(request_id="h", prompt_token_ids=prompt, mm_features=[], **identity)


def held(capacity: int = 1 << 20) -> carriers.HeldRowsCarrier:
    return carriers.HeldRowsCarrier("OffloadingConnector", LAYOUT, BLOCK, capacity)


def test_held_rows_serve_a_reload_of_kv_this_instance_computed() -> None:
    carrier, prompt = held(), list(range(10, 21))  # 11 tokens: two whole blocks and a partial one
    assert carrier.put(held_request(prompt), rows(11)) == 11
    for start, count in ((0, 8), (4, 4), (0, 11), (2, 7), (8, 3)):  # aligned, from a local hit, partial ends
        got = carrier.get(held_request(prompt), start, count)
        assert isinstance(got, np.ndarray) and np.array_equal(got, rows(11)[start : start + count]), (start, count)
    salted = carrier.get(held_request(prompt, cache_salt="tenant"), 0, 8)  # a salt partitions KV, changes no row
    assert isinstance(salted, np.ndarray) and np.array_equal(salted, rows(11)[:8])
    longer = prompt + [99, 98, 97, 96, 95]  # the next turn: the same prefix, then more
    got = carrier.get(held_request(longer), 0, 8)
    assert isinstance(got, np.ndarray) and np.array_equal(got, rows(11)[:8])
    # A load ending inside a block held whole: that block's first rows.
    assert carrier.put(held_request(longer), rows(16, seed=3)) == 8  # blocks 0 and 1 held already
    got = carrier.get(held_request(longer), 8, 6)
    assert isinstance(got, np.ndarray) and np.array_equal(got, rows(16, seed=3)[8:14])


@pytest.mark.parametrize(
    ("prompt", "identity", "start", "count"),
    [
        ([10, 11, 12, 13, 14, 15, 16, 17, 0, 19, 20], {}, 8, 3),  # other tokens in the last block
        ([0, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], {}, 4, 4),  # other tokens before the load: other KV
        (list(range(10, 21)), {"lora_request": SimpleNamespace(lora_name="adapter")}, 0, 8),  # another model
        (list(range(10, 25)), {}, 8, 7),  # tokens past what was held
        (list(range(10, 21)), {}, 8, 4),  # past the prompt
    ],
)
def test_held_rows_are_never_guessed(prompt: list[int], identity: dict[str, Any], start: int, count: int) -> None:
    carrier = held()
    carrier.put(held_request(list(range(10, 21))), rows(11))
    got = carrier.get(held_request(prompt, **identity), start, count)
    assert isinstance(got, Missing), got


def test_multimodal_inputs_key_the_held_rows() -> None:
    carrier, prompt = held(), [5] * 8  # image placeholder tokens: the same ids for every image
    image = SimpleNamespace(identifier="image-a", mm_position=(0, 8))
    with_a = SimpleNamespace(request_id="h", prompt_token_ids=prompt, mm_features=[image])
    carrier.put(with_a, rows(8))
    assert isinstance(carrier.get(with_a, 0, 8), np.ndarray)
    other = SimpleNamespace(identifier="image-b", mm_position=(0, 8))
    assert isinstance(
        carrier.get(SimpleNamespace(request_id="h", prompt_token_ids=prompt, mm_features=[other]), 0, 8), Missing
    )


def test_held_rows_stay_within_their_capacity_least_recently_used_first() -> None:
    piece = BLOCK * (3 * 2 + 8)  # a whole block: its rows (uint8) and token ids (int64)
    carrier = held(capacity=3 * piece)
    first, second = list(range(100, 108)), list(range(200, 208))
    carrier.put(held_request(first), rows(8))
    assert isinstance(carrier.get(held_request(first), 0, 4), np.ndarray)  # first's first block: used last
    carrier.put(held_request(second), rows(8, seed=1))
    assert carrier.held_bytes <= 3 * piece
    assert isinstance(carrier.get(held_request(first), 4, 4), Missing)  # the least recently used block went
    assert isinstance(carrier.get(held_request(first), 0, 4), np.ndarray)
    assert isinstance(carrier.get(held_request(second), 0, 8), np.ndarray)
    nothing = held(capacity=0)
    nothing.put(held_request(first), rows(8))
    assert nothing.held_bytes == 0 and isinstance(nothing.get(held_request(first), 0, 4), Missing)


def test_a_prefix_cache_reset_drops_every_held_row() -> None:
    carrier = held()
    carrier.put(held_request(list(range(10, 21))), rows(11))
    carrier.clear()
    assert carrier.held_bytes == 0
    missing = carrier.get(held_request(list(range(10, 21))), 0, 8)
    assert isinstance(missing, Missing) and "not held on this instance" in missing.reason


def test_held_rows_of_other_tokens_are_never_returned_even_under_one_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """The token ids kept with each piece are compared again on reading: with keys that name only the pieces'
    lengths (every prompt's blocks collide with every other's), another prompt's rows are still refused."""
    carrier = held()
    monkeypatch.setattr(carrier, "_key", lambda parent, tokens: parent + len(tokens).to_bytes(4, "little"))
    carrier.put(held_request(list(range(10, 18))), rows(8))
    assert isinstance(carrier.get(held_request(list(range(10, 18))), 0, 8), np.ndarray)
    assert isinstance(carrier.get(held_request(list(range(20, 28))), 0, 8), Missing)


def test_held_rows_of_generated_tokens_serve_the_next_turn() -> None:
    """A finished request's rows past its prompt (where the generation's store gives them) are keyed by its whole
    sequence: the next turn's prompt repeats prompt and answer, and a load of their KV gets those rows."""
    carrier = held()
    prompt, answer = list(range(10, 17)), [40, 41, 42, 43, 44]  # 7 prompt tokens, 5 generated
    finished = SimpleNamespace(request_id="t1", prompt_token_ids=prompt, all_token_ids=prompt + answer, mm_features=[])
    assert carrier.put(finished, rows(11)) == 11  # every token but the last generated one
    next_turn = held_request(prompt + answer + [7, 8, 9])
    got = carrier.get(next_turn, 0, 11)
    assert isinstance(got, np.ndarray) and np.array_equal(got, rows(11))
    assert isinstance(carrier.get(next_turn, 0, 12), Missing)  # the last generated token: no row was computed
    other_answer = held_request(prompt + [40, 41, 0, 43, 44, 7])
    assert isinstance(carrier.get(other_answer, 0, 11), Missing)


def transfer_request(prompt: list[int], params: Any = None, outputs: list[int] | None = None) -> Any:
    sequence = prompt + (outputs or [])
    return SimpleNamespace(
        request_id="t", prompt_token_ids=prompt, all_token_ids=sequence, kv_transfer_params=params, mm_features=[]
    )


def lent(block_ids: Any = ([1, 2],)) -> tuple[bool, dict[str, Any]]:
    """What NIXL's ``request_finished`` returns for a request whose blocks it lends to the next instance."""
    return True, {"do_remote_prefill": True, "remote_block_ids": block_ids}


def test_nixl_rows_ride_in_the_transfer_params_to_the_request_that_loads_the_kv() -> None:
    """The prefill instance's finished request puts its rows into the parameters NIXL returns; the decode request
    that carries those parameters gets exactly the rows of the tokens it loads."""
    carrier = carriers.TransferParamsCarrier(object(), LAYOUT)
    prompt = list(range(100, 111))
    finished = lent()
    assert carrier.put(transfer_request(prompt, outputs=[7]), rows(11), finished) == 11
    params = finished[1]
    assert isinstance(params[carrier.FIELD], str)  # JSON-safe: passes through the client and any proxy as it is
    decode = transfer_request(prompt, params=dict(params))
    assert np.array_equal(carrier.get(decode, 0, 11), rows(11))
    assert np.array_equal(carrier.get(decode, 4, 6), rows(11)[4:10])  # after a local hit of 4
    # A later turn on the prefill instance whose prompt repeats the answer: the rows of those tokens too.
    longer = transfer_request(prompt + [7, 8], params=dict(params))
    assert isinstance(carrier.get(longer, 0, 12), Missing)  # token 11 (the answer's) has no row: never guessed


def test_nixl_parameters_without_exact_rows_are_missing_with_the_reason() -> None:
    carrier = carriers.TransferParamsCarrier(object(), LAYOUT)
    prompt = list(range(100, 111))
    assert carrier.put(transfer_request(prompt), rows(11), (False, None)) == 0  # no KV lent: nothing to carry
    assert carrier.put(transfer_request(prompt), rows(11), None) == 0
    finished = lent()
    carrier.put(transfer_request(prompt), rows(11), finished)
    params = finished[1]
    absent = carrier.get(transfer_request(prompt, params={"do_remote_prefill": True}), 0, 8)
    assert isinstance(absent, Missing) and "carry no routing rows" in absent.reason
    assert isinstance(carrier.get(transfer_request(prompt, params=None), 0, 8), Missing)
    other = carrier.get(transfer_request(list(range(200, 211)), params=dict(params)), 0, 8)
    assert isinstance(other, Missing) and "other tokens than this prompt's first 8" in other.reason
    past = carrier.get(transfer_request(prompt, params=dict(params)), 8, 5)
    assert isinstance(past, Missing)  # tokens [8, 13): past the 11 carried
    broken = carrier.get(transfer_request(prompt, params={carrier.FIELD: "not base64 !"}), 0, 8)
    assert isinstance(broken, Missing) and "cannot be read" in broken.reason
    wider = carriers.TransferParamsCarrier(object(), RowLayout(3, 4, "uint8"))
    layout = wider.get(transfer_request(prompt, params=dict(params)), 0, 8)
    assert isinstance(layout, Missing) and "another model or configuration" in layout.reason


def test_forged_or_foreign_rows_in_nixl_parameters_are_never_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    """The parameters pass through the client and the proxy: rows altered on the way (the right token ids, other
    ids), unsigned, or lent by an instance with another secret are Missing; the same secret on both sides loads."""
    import base64
    import io

    prompt = list(range(100, 111))
    monkeypatch.setenv("VLLM_ASCEND_ROUTING_KV_SECRET", "deployment-a")
    producer = carriers.TransferParamsCarrier(object(), LAYOUT)
    finished = lent()
    producer.put(transfer_request(prompt), rows(11), finished)
    params = dict(finished[1])
    consumer = carriers.TransferParamsCarrier(object(), LAYOUT)  # another instance, the same secret
    assert np.array_equal(consumer.get(transfer_request(prompt, params=params), 0, 11), rows(11))
    forged_rows = (rows(11) + 1) % 16  # the prompt's own token ids, other experts
    buffer = io.BytesIO()
    carriers._save(buffer, np.asarray(prompt, dtype=np.int64), forged_rows.astype(rows(11).dtype), LAYOUT)
    forged = {**params, consumer.FIELD: base64.b64encode(buffer.getvalue()).decode("ascii")}
    for planted in (forged, {k: v for k, v in forged.items() if k != consumer.MAC_FIELD}):
        got = consumer.get(transfer_request(prompt, params=planted), 0, 11)
        assert isinstance(got, Missing) and "not signed by this deployment" in got.reason
    monkeypatch.setenv("VLLM_ASCEND_ROUTING_KV_SECRET", "deployment-b")
    foreign = carriers.TransferParamsCarrier(object(), LAYOUT).get(transfer_request(prompt, params=params), 0, 11)
    assert isinstance(foreign, Missing) and "VLLM_ASCEND_ROUTING_KV_SECRET" in foreign.reason
    monkeypatch.delenv("VLLM_ASCEND_ROUTING_KV_SECRET")
    own = carriers.TransferParamsCarrier(object(), LAYOUT)  # unset: this process's secret, not deployment-a's
    assert isinstance(own.get(transfer_request(prompt, params=params), 0, 11), Missing)


def test_with_a_row_store_nixl_parameters_carry_a_key_and_the_rows_arrive_exact(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The key, not the rows, rides through the proxy; the rows come from the store, bound to their token ids by the
    engine: a key of another prompt, a made-up key and a released one are Missing, never loaded."""
    from tests.store.local import shm_ledger
    from vllm_ascend_routing import replay
    from vllm_ascend_routing.store import keys as store_keys
    from vllm_ascend_routing.store import publisher as store_publisher

    shm_ledger(tmp_path, monkeypatch)  # VLLM_ASCEND_ROUTING_STORE=shm in tmp_path
    monkeypatch.setattr(store_publisher, "_publishers", {})
    carrier = carriers.TransferParamsCarrier(object(), LAYOUT)
    prompt, other = list(range(100, 111)), list(range(200, 211))
    finished, finished_other = lent(), lent()
    assert carrier.put(transfer_request(prompt, outputs=[7]), rows(11), finished) == 11
    carrier.put(transfer_request(other), (rows(11) + 3) % 16, finished_other)
    params = finished[1]
    assert carrier.FIELD not in params and len(params[carrier.KEY_FIELD]) < 100  # a key, not 11 tokens' rows
    assert np.array_equal(carrier.get(transfer_request(prompt, params=dict(params)), 0, 11), rows(11))
    assert np.array_equal(carrier.get(transfer_request(prompt, params=dict(params)), 4, 6), rows(11)[4:10])
    swapped = carrier.get(transfer_request(prompt, params=dict(finished_other[1])), 0, 11)
    assert isinstance(swapped, Missing) and "other tokens than this prompt's first 11" in swapped.reason
    made_up = {carrier.KEY_FIELD: store_keys.Namespace.mint().key()}
    unknown = carrier.get(transfer_request(prompt, params=made_up), 0, 11)
    assert isinstance(unknown, Missing) and "resolves to no rows" in unknown.reason
    replay.release(params[carrier.KEY_FIELD])
    assert isinstance(carrier.get(transfer_request(prompt, params=dict(params)), 0, 11), Missing)
