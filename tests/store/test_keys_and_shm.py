# SPDX-License-Identifier: Apache-2.0
"""Keys (namespaced, unguessable) and the node-local backend (owner-only, exclusive, ranged reads)."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import numpy as np
import pytest

from vllm_ascend_routing.store import keys, layout
from vllm_ascend_routing.store.interface import StoreFullError, StoreUnavailableError, UnknownKeyError
from vllm_ascend_routing.store.shm import ShmBackend


def test_keys_are_namespaced_and_each_has_its_own_secret() -> None:
    a, b = keys.Namespace.mint(dp_rank=0), keys.Namespace.mint(dp_rank=1)
    minted = [a.key() for _ in range(50)] + [b.key() for _ in range(50)]
    assert len(set(minted)) == 100
    parsed = [keys.parse(key) for key in minted]
    assert {p.instance for p in parsed} == {a.instance, b.instance} and a.instance != b.instance
    assert [p.dp_rank for p in parsed] == [0] * 50 + [1] * 50
    assert len({p.secret for p in parsed}) == 100 and all(len(p.secret) == 32 for p in parsed)
    assert parsed[0].rows is None and keys.parse(parsed[0].with_rows(7)).rows == 7


@pytest.mark.parametrize("made_up", ["", "rx1.", "../../etc/passwd", "rx1.0000zzzz.dp0.1.00", 17, None])
def test_a_string_that_is_not_a_key_is_refused_by_name(made_up: object) -> None:
    with pytest.raises(keys.MalformedKeyError, match="not a routed-experts store key"):
        keys.parse(made_up)


@pytest.fixture
def backend(tmp_path: Path) -> ShmBackend:
    return ShmBackend(str(tmp_path))


def rows(seed: int, t: int = 37, layers: int = 5, k: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 200, (t, layers, k)).astype(np.uint8)


def test_objects_are_owner_only_and_named_by_the_secret(backend: ShmBackend) -> None:
    key = keys.Namespace.mint().key()
    parts, _ = layout.encode(key, rows(1), first_token=4)
    backend.put(key, parts)
    assert stat.S_IMODE(os.stat(backend.path).st_mode) == 0o700
    parsed = keys.parse(key)
    assert sorted(os.listdir(backend.path)) == [f"{parsed.instance}-{parsed.secret}", f"{parsed.instance}.lease"]
    for name in os.listdir(backend.path):  # the object's name holds the key's secret: as unguessable as the key
        assert stat.S_IMODE(os.stat(os.path.join(backend.path, name)).st_mode) == 0o600
    with pytest.raises(StoreUnavailableError):  # a key is written once: never overwritten
        backend.put(key, parts)


def test_a_folder_open_to_others_is_refused(tmp_path: Path) -> None:
    ShmBackend(str(tmp_path))
    folder = Path(tmp_path) / f"vllm_ascend_routing-{os.getuid()}"
    folder.chmod(0o755)
    with pytest.raises(StoreUnavailableError, match="mode 0700"):
        ShmBackend(str(tmp_path))


def test_round_trip_ranged_reads_and_remove(backend: ShmBackend) -> None:
    key, array = keys.Namespace.mint().key(), rows(2)
    parts, header = layout.encode(key, array, first_token=9)
    backend.put(key, parts)
    found, at = layout.read_header(backend, key)
    assert found == header and found.shape == (37, 5, 3) and found.first_token == 9
    lazy = layout.StoredRows(backend, found, at)
    assert np.array_equal(np.asarray(lazy), array) and np.asarray(lazy).dtype == np.uint8
    lazy.reads.bytes = 0
    window = lazy[10:20]
    assert np.array_equal(window[:, 3], array[10:20, 3]) and lazy.reads.bytes == 10 * 3  # that layer's run only
    assert np.array_equal(window.read([1, 4]), array[10:20][:, [1, 4]])
    assert backend.remove(key) and not backend.remove(key)
    with pytest.raises(UnknownKeyError, match=key):
        layout.read_header(backend, key)


def test_no_room_is_store_full_and_leaves_no_partial_object(
    backend: ShmBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(*args: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    key = keys.Namespace.mint().key()
    with pytest.raises(StoreFullError, match="full"):
        backend.put(key, layout.encode(key, rows(3), 0)[0])
    assert [name for name in os.listdir(backend.path) if not name.endswith(".lease")] == []


ENGINE = """
import os, signal, sys
import numpy as np
from vllm_ascend_routing.store import layout, keys
from vllm_ascend_routing.store.shm import ShmBackend
backend = ShmBackend(sys.argv[1])
key = keys.Namespace.mint().key()
backend.put(key, layout.encode(key, np.ones((4, 2, 2), np.uint8), 0)[0])
print(key, flush=True)
sys.stdin.readline()
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_an_exited_engines_keys_resolve_to_nothing_and_its_objects_go(tmp_path: Path) -> None:
    import subprocess
    import sys

    engine = subprocess.Popen(
        [sys.executable, "-c", ENGINE, str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert engine.stdout is not None and engine.stdin is not None
    key = engine.stdout.readline().strip()
    reader = ShmBackend(str(tmp_path))
    header, _ = layout.read_header(reader, key)  # alive: readable from another process
    assert header.shape == (4, 2, 2)
    engine.stdin.write("\n")
    engine.stdin.flush()
    assert engine.wait(timeout=30) == -9  # SIGKILL: no clean-up of its own ran
    with pytest.raises(UnknownKeyError, match="has exited"):
        layout.read_header(reader, key)
    assert os.listdir(reader.path) == []  # the reader removed the dead engine's objects and lease


READER = """
import hashlib, sys
import numpy as np
from vllm_ascend_routing.store import layout
from vllm_ascend_routing.store.shm import ShmBackend
backend = ShmBackend(sys.argv[1])
for key in sys.argv[2:]:
    header, at = layout.read_header(backend, key)
    print(hashlib.sha256(np.asarray(layout.StoredRows(backend, header, at)).tobytes()).hexdigest(), flush=True)
"""


def test_two_trainers_read_the_same_keys_at_once(backend: ShmBackend) -> None:
    import hashlib
    import subprocess
    import sys

    namespace = keys.Namespace.mint()
    published = {}
    for seed in range(4):
        key, array = namespace.key(), rows(seed, t=200 + seed)
        backend.put(key, layout.encode(key, array, 0)[0])
        published[key] = hashlib.sha256(array.tobytes()).hexdigest()
    command = [sys.executable, "-c", READER, os.path.dirname(backend.path), *published]
    trainers = [subprocess.Popen(command, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    for trainer in trainers:
        out, _ = trainer.communicate(timeout=60)
        assert trainer.returncode == 0 and out.split() == list(published.values())  # each its own rows, exact
    assert all(backend.size(key) is not None for key in published)  # reading consumes nothing
