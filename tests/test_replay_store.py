# SPDX-License-Identifier: Apache-2.0
"""The trainer's side of a row store: fetch returns exactly the inline array; a key aligns and packs as its array
does, each rank reading only its slice; unknown, released and forged keys are refused by name."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.store.local import shm_ledger
from vllm_ascend_routing import replay
from vllm_ascend_routing.store.keys import Namespace

LAYERS, TOP_K, EXPERTS = 8, 4, 64
MOE = list(range(1, LAYERS))  # layer 0 dense (all zero), as vLLM returns it


def request_rows(seed: int, rows: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    out = np.zeros((rows, LAYERS, TOP_K), np.uint8)
    for layer in MOE:  # distinct ids per row, as a router picks them
        out[:, layer] = np.argsort(rng.random((rows, EXPERTS)), axis=1)[:, :TOP_K]
    return out


def test_fetch_returns_the_inline_array_and_release_frees_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = shm_ledger(tmp_path, monkeypatch)
    arrays = [request_rows(seed, 20 + seed) for seed in range(4)]
    keys = [engine.publish(array, first_token=seed) for seed, array in enumerate(arrays)]
    for array, fetched in zip(arrays, replay.fetch(keys), strict=True):
        assert fetched.dtype == array.dtype and fetched.shape == array.shape and np.array_equal(fetched, array)
    assert replay.open_rows(keys[3]).first_token == 3
    assert replay.release(keys[:2]) == 2 and replay.release(keys[:2]) == 0
    with pytest.raises(replay.UnknownKeyError, match=keys[0]):
        replay.fetch(keys[0])
    assert np.array_equal(replay.fetch(keys[2]), arrays[2])  # the others untouched


def test_made_up_and_forged_keys_resolve_to_no_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = shm_ledger(tmp_path, monkeypatch)
    real = engine.publish(request_rows(1, 10), 0)
    made_up = Namespace.mint().key()
    with pytest.raises(replay.UnknownKeyError, match=made_up):
        replay.fetch(made_up)
    with pytest.raises(replay.MalformedKeyError):
        replay.fetch("rows-of-request-7")
    # an object found under a key's name whose header names another key (planted): refused, never served
    planted = real.rsplit(".", 1)[0] + "." + "f" * 32
    real_file, planted_file = engine.backend._file(real), engine.backend._file(planted)  # type: ignore[attr-defined]
    Path(planted_file).write_bytes(Path(real_file).read_bytes())
    with pytest.raises(replay.UnknownKeyError, match="the object found holds"):
        replay.fetch(planted)
    with pytest.raises(replay.UnknownKeyError, match="asks for 11 rows"):
        replay.fetch(real + "@11")
    assert np.array_equal(replay.fetch(real + "@4"), replay.fetch(real)[:4])


def test_a_key_aligns_and_packs_as_its_array(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = shm_ledger(tmp_path, monkeypatch)
    prompts, outputs, starts = [30, 41, 17, 26], [9, 14, 20, 6], [0, 5, 0, 3]
    arrays = [request_rows(s, p + o - 1 - f) for s, (p, o, f) in enumerate(zip(prompts, outputs, starts, strict=True))]
    keys = [engine.publish(a, f) for a, f in zip(arrays, starts, strict=True)]
    inline = [replay.align(a, p, o, f) for a, p, o, f in zip(arrays, prompts, outputs, starts, strict=True)]
    by_key = [replay.align(k, p, o) for k, p, o in zip(keys, prompts, outputs, strict=True)]
    for shard in (None, replay.Shard(dp_rank=1, dp_size=2, layers=[3, 4], cp_rank=1, cp_size=2)):
        a = replay.to_megatron(inline, MOE, EXPERTS, pad_to=4, shard=shard)
        b = replay.to_megatron(by_key, MOE, EXPERTS, pad_to=4, shard=shard)
        assert torch_equal(a.ids, b.ids) and torch_equal(a.valid, b.valid) and a.layers == b.layers
    with pytest.raises(ValueError, match="start at token 5"):
        replay.align(keys[1], prompts[1], outputs[1], prompt_start=0)


def torch_equal(a: object, b: object) -> bool:
    import torch

    assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
    return bool(torch.equal(a, b))


def test_each_rank_of_pp4_cp2_reads_only_its_slice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = shm_ledger(tmp_path, monkeypatch)
    length = 512
    keys = [engine.publish(request_rows(s, length - 1), 0) for s in range(2)]
    stages = [MOE[i::4] for i in range(4)]  # 7 MoE layers over 4 stages
    whole = sum(len(replay.open_rows(k)) for k in keys) * LAYERS * TOP_K
    for layers in stages:
        for cp_rank in range(2):
            samples = [replay.align(replay.open_rows(k), length - 1, 1) for k in keys]
            shard = replay.Shard(layers=layers, cp_rank=cp_rank, cp_size=2)
            packed = replay.to_megatron(samples, MOE, EXPERTS, pad_to=4, shard=shard)
            read = sum(sample.parts[0].reads.bytes for sample in samples)
            its_slice = int(packed.valid.sum()) * len(layers) * TOP_K  # its recorded rows, uint8: one byte an id
            assert its_slice <= read <= 1.1 * its_slice, (layers, cp_rank, read, its_slice)
            assert read < whole / 5


def test_a_conversation_of_keys_is_the_conversation_of_arrays(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = shm_ledger(tmp_path, monkeypatch)
    by_array, by_key = replay.Conversation(), replay.Conversation()
    context = 0
    for turn, (new_prompt, output) in enumerate([(20, 7), (9, 5), (13, 8)]):
        prompt = context + new_prompt
        start = by_array.prompt_start
        rows = request_rows(10 + turn, prompt + output - 1 - start)
        by_array.add_turn(rows, prompt, output, start)
        by_key.add_turn(engine.publish(rows, start), prompt, output, start)
        context = prompt + output
    a, b = by_array.aligned(), by_key.aligned()
    assert np.array_equal(a.routes, b.routes) and a.num_tokens == b.num_tokens


def test_two_engines_keys_in_one_trainer_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DP = 2: each engine core publishes under its own namespace; one trainer batch mixes their keys, and each DP
    rank packs exactly its samples' rows."""
    from vllm_ascend_routing.store.ledger import Ledger

    first = shm_ledger(tmp_path, monkeypatch)
    second = Ledger(first.backend, Namespace.mint(dp_rank=1), 1 << 30, 0)
    arrays = [request_rows(20 + i, 30 + 2 * i) for i in range(4)]
    keys = [(first if i % 2 == 0 else second).publish(a, 0) for i, a in enumerate(arrays)]
    assert [".dp0." in k for k in keys] == [True, False, True, False]
    lengths = [(len(a) + 1, 0) for a in arrays]  # prompt only: T - 1 rows each, as a 1-token request's prompt
    for dp_rank in range(2):
        shard = replay.Shard(dp_rank=dp_rank, dp_size=2)
        by_key = replay.to_megatron([replay.align(k, p, o) for k, (p, o) in zip(keys, lengths, strict=True)],
                                    MOE, EXPERTS, shard=shard)  # fmt: skip
        inline = replay.to_megatron([replay.align(a, p, o) for a, (p, o) in zip(arrays, lengths, strict=True)],
                                    MOE, EXPERTS, shard=shard)  # fmt: skip
        assert torch_equal(by_key.ids, inline.ids) and torch_equal(by_key.valid, inline.valid)
