# SPDX-License-Identifier: Apache-2.0
"""The 0.20.x shared-memory routing store, without vLLM: sizes, round trip, crash leftovers, refusals."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from multiprocessing import resource_tracker, shared_memory
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from vllm_ascend_routing.compat.shm import store


def spec(num_experts: int = 64, slots: int = 4096, layers: int = 48, top_k: int = 8) -> store.SegmentSpec:
    return store.SegmentSpec.for_engine(f"test{uuid.uuid4().hex[:8]}", 0, (slots, layers, top_k), num_experts)


def ours() -> set[str]:
    return {p.name for p in store.SHM_DIR.glob(f"{store.PREFIX}_*")}


@pytest.mark.parametrize("num_experts", [8, 128, 255])
def test_footprint_is_a_quarter_of_upstream_int32(num_experts: int) -> None:
    s = spec(num_experts)
    ratio = s.nbytes / s.upstream_nbytes
    print(f"shm footprint for {num_experts} experts: {s.nbytes} B vs vLLM int32 {s.upstream_nbytes} B = {ratio:.2f}")
    assert s.dtype == np.uint8 and ratio <= 0.25


def test_wide_expert_counts_use_int16_and_refuse_beyond() -> None:
    assert spec(257).dtype == np.int16 and spec(257).nbytes / spec(257).upstream_nbytes == 0.5
    with pytest.raises(ValueError, match="40000 experts"):
        spec(40000)


def test_round_trip_widens_to_int32_and_skips_padding_slots() -> None:
    s = spec(num_experts=200, slots=16, layers=3, top_k=2)
    writer = store.SegmentWriter(s)
    try:
        reader = store.SegmentReader(s)
        rows = np.array([[[1, 2], [0, 0], [199, 3]], [[4, 5], [0, 0], [6, 7]], [[9, 9], [9, 9], [9, 9]]], np.int16)
        writer.write(np.array([5, 2, -1]), rows)  # slot -1: padding, must not land in the last slot
        got = reader.read(np.array([5, 2, 15]))
        assert got.dtype == np.int32
        assert got[0].tolist() == rows[0].tolist() and got[1].tolist() == rows[1].tolist()
        assert (got[2] == 0).all()
        reader.close()
    finally:
        writer.close()
    assert writer.name not in ours()
    assert not store.owner_file(s.key).exists()


def test_second_live_owner_is_refused() -> None:
    s = spec(slots=4, layers=1, top_k=1)
    writer = store.SegmentWriter(s)
    try:
        with pytest.raises(store.ShmCollisionError, match="live process"):
            store.SegmentWriter(s)
    finally:
        writer.close()


def test_segment_of_dead_owner_is_removed_at_next_start() -> None:
    """A crashed engine's segment (owner dead, nothing unlinked it) disappears when the next one starts."""
    s = spec(slots=4, layers=1, top_k=1)
    code = (
        "import os\n"
        "from multiprocessing import resource_tracker\n"
        "from vllm_ascend_routing.compat.shm import store\n"
        f"writer = store.SegmentWriter(store.SegmentSpec({s.key!r}, (4, 1, 1), store.storage_dtype(8)))\n"
        "resource_tracker.unregister(writer._shm._name, 'shared_memory')  # as if the tracker died with it\n"
        "print(writer.name, flush=True)\n"
        "os._exit(0)  # no cleanup: a crash\n"
    )
    name = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.strip()
    assert name in ours(), "the crashed process should have left its segment"
    other = spec(slots=4, layers=1, top_k=1)
    writer = store.SegmentWriter(other)  # any next start cleans up
    try:
        assert name not in ours()
        assert not store.owner_file(s.key).exists()
    finally:
        writer.close()


def test_orphan_segment_without_owner_file_is_removed() -> None:
    name = f"{spec().key}_{uuid.uuid4().hex[:16]}"
    shm = shared_memory.SharedMemory(name=name, create=True, size=4)
    resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]
    shm.close()
    assert name in store.remove_stale()
    assert name not in ours()


def test_insufficient_shm_gives_clear_startup_error(monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.statvfs

    def small(path: Any) -> Any:
        st = real(path)
        return SimpleNamespace(f_bavail=1, f_frsize=st.f_frsize) if str(path) == str(store.SHM_DIR) else st

    monkeypatch.setattr(os, "statvfs", small)
    s = spec(num_experts=64, slots=1 << 20, layers=48, top_k=8)
    with pytest.raises(store.ShmSpaceError, match=r"needs 384\.0 MiB of /dev/shm .*Lower the KV cache size"):
        store.SegmentWriter(s)
    assert not any(name.startswith(s.key) for name in ours())
    assert not store.owner_file(s.key).exists()


def test_speculative_steps_leave_only_accepted_rows_where_the_request_reads() -> None:
    """0.20.x under speculative decoding: each step writes the rows of every scheduled token by KV slot,
    rejected drafts included; a rejected draft's position is scheduled again with the corrected token, so
    its slot is rewritten; at the end the scheduler reads the slots of prompt + output[:-1], none of which
    still holds a rejected draft's row (the corrected token at a rejected position is sampled, never
    forwarded in that step, and is the request's last token if it ends there)."""
    rng = np.random.default_rng(0)
    s = spec(num_experts=8, slots=64, layers=2, top_k=2)
    writer, reader = store.SegmentWriter(s), None
    try:
        reader = store.SegmentReader(s)
        truth: dict[int, np.ndarray] = {}  # position -> row of the token the request finally holds there

        def forward(positions: list[int], accepted: set[int]) -> None:
            rows = rng.integers(0, 8, size=(len(positions), 2, 2), dtype=np.int64)
            for position, row in zip(positions, rows, strict=True):
                if position in accepted:
                    truth[position] = row
            writer.write(np.array(positions), rows)  # slot = position (one block table, in order)

        forward(list(range(10)), set(range(10)))  # prefill: 10 prompt tokens; token 10 sampled
        # decode steps: [token fed] + k=3 drafts; accepted drafts keep their rows, rejected ones are stale
        forward([10, 11, 12, 13], {10, 11})  # drafts 11, 12, 13: 11 accepted, 12 rejected -> 12 corrected
        forward([12, 13, 14, 15], {12, 13, 14, 15})  # all accepted, bonus token 16 sampled
        forward([16, 17, 18, 19], {16})  # every draft rejected -> 17 corrected, the request stops there
        num_tokens = 18  # prompt 10 + output 8 (10..17); rows cover positions 0..16
        read = reader.read(np.arange(num_tokens - 1))
        assert np.array_equal(read, np.stack([truth[p] for p in range(num_tokens - 1)]).astype(np.int32))
    finally:
        if reader is not None:
            reader.close()
        writer.close()


@pytest.mark.parametrize("num_experts", [255, 256, 300])
def test_an_invalid_id_never_reads_back_as_an_expert(num_experts: int) -> None:
    """The capture op writes -1 for an id it could not store; with 256 experts uint8 would turn that into
    255, a valid id. The store keeps uint8 only up to 255 experts and reads every invalid id as -1."""
    s = spec(num_experts=num_experts, slots=8, layers=2, top_k=2)
    assert s.dtype == (np.uint8 if num_experts <= 255 else np.int16)
    writer, reader = store.SegmentWriter(s), None
    try:
        reader = store.SegmentReader(s)
        rows = np.array([[[num_experts - 1, -1], [0, 7]], [[-1, -1], [3, num_experts - 2]]], dtype=np.int16)
        writer.write(np.array([5, 2]), rows)
        assert np.array_equal(reader.read(np.array([5, 2])), rows.astype(np.int32))
    finally:
        if reader is not None:
            reader.close()
        writer.close()
