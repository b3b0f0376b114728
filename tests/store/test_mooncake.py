# SPDX-License-Identifier: Apache-2.0
"""The Mooncake backend against a real ``mooncake_master`` on localhost (``tests/harness/mooncake_master.py``).

Mooncake comes from ``scripts/mooncake_kit.py`` (cached outside the clone); these tests skip only where it cannot be
installed. Each Mooncake client runs in a process of its own (``tests/harness/mooncake_client.py``) started with the
kit's ``PYTHONPATH``/``LD_LIBRARY_PATH``: this process never loads Mooncake's libraries, a writer owns its segment as an
engine core does, and a client stuck on a dead master is killed, not waited for.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.harness.mooncake_master import MooncakeMaster, die_with_parent, free_port
from tests.scripts import ROOT, load
from vllm_ascend_routing.store import keys, mooncake
from vllm_ascend_routing.store.interface import StoreUnavailableError

URL_FORM = "mooncake://MASTER_HOST:PORT?metadata=http://HOST:PORT/metadata"


@pytest.fixture(scope="session")
def kit() -> Any:
    kit_script = load("scripts/mooncake_kit.py", "mooncake_kit")
    try:
        return kit_script.kit(sys.executable)
    except (subprocess.CalledProcessError, SystemExit, OSError) as error:
        pytest.skip(f"the Mooncake kit cannot be installed here (scripts/mooncake_kit.py; no network?): {error}")


@pytest.fixture(scope="module")
def master(kit: Any) -> Iterator[MooncakeMaster]:
    with MooncakeMaster(kit.master_binary, kit.env()) as started:
        yield started


class Client:
    """One Mooncake client process; ``call`` answers within ``timeout`` s or fails the test (never hangs it)."""

    def __init__(self, kit: Any, log: Path) -> None:
        base = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        self.log = log  # Mooncake's own (glog) lines: shown when a call fails
        with open(log, "wb") as stderr:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tests.harness.mooncake_client"],
                cwd=ROOT,
                env=kit.env(base),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                preexec_fn=die_with_parent,  # a client stuck on a dead master never outlives the test run
            )

    def call(self, op: str, timeout: float = 30.0, **request: Any) -> dict[str, Any]:
        self.send(op, **request)
        return self.answer(op, timeout)

    def send(self, op: str, **request: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"op": op, **request}) + "\n")
        self.process.stdin.flush()

    def answer(self, op: str, timeout: float = 30.0) -> dict[str, Any]:
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        line = self.process.stdout.readline() if ready else ""
        if not line:
            self.kill()
            tail = self.log.read_text(errors="replace")[-3000:]
            pytest.fail(f"the Mooncake client gave no answer to {op} within {timeout:g} s; its log:\n{tail}")
        if op == "close":  # the client exits after answering
            self.process.wait(10)
        return dict(json.loads(line))

    def ok(self, op: str, **request: Any) -> dict[str, Any]:
        answer = self.call(op, **request)
        assert answer["ok"], answer
        return answer

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


def close_all(*clients: Client) -> None:
    """Close clients at once (Mooncake's teardown takes 1-2 s each): a closed client's segment leaves the master at
    once, a killed one's after its 10 s TTL (and a put may be placed in it meanwhile)."""
    live = [client for client in clients if client.process.poll() is None]
    for client in live:
        client.send("close")
    for client in live:
        assert client.answer("close", timeout=10)["ok"]


@pytest.fixture
def clients(kit: Any, tmp_path: Path) -> Iterator[Any]:
    started: list[Client] = []

    def start(url: str | None = None, segment_bytes: int = 0) -> Client:
        client = Client(kit, tmp_path / f"client{len(started)}.log")
        started.append(client)
        if url is not None:
            client.ok("open", url=url, segment_bytes=segment_bytes)
        return client

    yield start
    try:
        close_all(*started)
    finally:
        for client in started:
            client.kill()


def rows(seed: int, t: int = 4096, layers: int = 48, k: int = 8) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 512, (t, layers, k)).astype(np.int32)


def put_rows(client: Client, tmp_path: Path, array: np.ndarray, first_token: int = 0) -> str:
    key = keys.Namespace.mint().key()
    np.save(tmp_path / f"{key}.npy", array)
    client.ok("put_rows", key=key, path=str(tmp_path / f"{key}.npy"), first_token=first_token)
    return key


def test_rows_round_trip_exactly_and_another_process_reads_one_layer_only(
    master: MooncakeMaster, clients: Any, tmp_path: Path
) -> None:
    writer = clients(master.url, segment_bytes=64 << 20)
    reader = clients(master.url)  # a trainer: another process, no segment
    array = rows(1)
    key = put_rows(writer, tmp_path, array, first_token=3)
    for who in (writer, reader):
        who.ok("read_rows", key=key, path=str(tmp_path / "all.npy"))
        assert np.array_equal(np.load(tmp_path / "all.npy"), array)
    layer_bytes = array.shape[0] * array.shape[2] * array.itemsize  # one layer's run of rows: 128 KiB
    wire = []
    for attempt in range(3):  # the loopback counter is the whole host's: the least of three is this read's
        answer = reader.ok("read_rows", key=key, path=str(tmp_path / "layer.npy"), layers=[7 + attempt])
        assert np.array_equal(np.load(tmp_path / "layer.npy"), array[:, [7 + attempt]])
        assert answer["rows_calls"] == 1 and answer["rows_bytes"] == layer_bytes == answer["backend_bytes"]
        wire.append(answer["wire_bytes"])
    assert min(wire) <= 1.1 * layer_bytes, f"one layer ({layer_bytes} bytes) moved {wire} bytes: not a ranged read"
    window = reader.ok("read_rows", key=key, path=str(tmp_path / "window.npy"), layers=[0, 47], start=100, stop=612)
    assert np.array_equal(np.load(tmp_path / "window.npy"), array[100:612, [0, 47]])
    assert window["rows_calls"] == 2 and window["rows_bytes"] == 2 * 512 * 8 * 4
    assert reader.ok("size", key=key)["size"] == writer.ok("size", key=key)["size"] > array.nbytes


def test_unknown_key_and_removed_key_raise_unknown_key(master: MooncakeMaster, clients: Any, tmp_path: Path) -> None:
    writer = clients(master.url, segment_bytes=16 << 20)
    reader = clients(master.url)
    never = keys.Namespace.mint().key()
    answer = reader.call("read", key=never, offset=0, nbytes=16)
    assert answer["error"] == "UnknownKeyError" and answer["key"] == never and never in answer["message"]
    assert reader.ok("size", key=never)["size"] is None
    key = put_rows(writer, tmp_path, rows(2, t=64))
    assert reader.ok("read", key=key, offset=0, nbytes=64)["length"] == 64
    past = reader.call("read", key=key, offset=0, nbytes=1 << 20)
    assert past["error"] == "UnknownKeyError" and "ends before byte" in past["message"]
    assert reader.ok("remove", key=key)["removed"] is True  # a reader's lease on it does not hold the removal up
    answer = reader.call("read", key=key, offset=0, nbytes=64)
    assert answer["error"] == "UnknownKeyError" and answer["key"] == key
    assert writer.ok("remove", key=key)["removed"] is False


def test_a_writer_s_objects_go_with_it_and_a_key_is_written_once(
    master: MooncakeMaster, clients: Any, tmp_path: Path
) -> None:
    writer = clients(master.url, segment_bytes=16 << 20)
    reader = clients(master.url)
    key = put_rows(writer, tmp_path, rows(3, t=64))
    again = writer.call("put_rows", key=key, path=str(tmp_path / f"{key}.npy"), first_token=0)
    assert again["error"] == "StoreError" and "written once" in again["message"]
    writer.ok("close")
    assert reader.call("read", key=key, offset=0, nbytes=64)["error"] == "UnknownKeyError"


def test_a_name_points_another_process_to_its_rows_once_and_goes_with_its_writer(
    master: MooncakeMaster, clients: Any, tmp_path: Path
) -> None:
    """MooncakeConnector P/D across hosts: the prefill engine names a transfer's rows (``keys.derive``), the decode
    engine (another process, no segment) finds them by that name only; a name is written once and goes with its
    writer's segment."""
    writer = clients(master.url, segment_bytes=16 << 20)
    reader = clients(master.url)
    array = rows(4, t=97)
    key = put_rows(writer, tmp_path, array)
    name, other = keys.derive(b"s", "mooncake-transfer", "t-1"), keys.derive(b"s", "mooncake-transfer", "t-2")
    assert reader.call("resolve", name=name)["error"] == "UnknownKeyError"  # before it is named: nothing
    writer.ok("name", name=name, key=key)
    assert reader.ok("resolve", name=name)["key"] == key
    reader.ok("read_rows", key=key, path=str(tmp_path / "named.npy"))
    assert np.array_equal(np.load(tmp_path / "named.npy"), array)
    assert reader.call("resolve", name=other)["error"] == "UnknownKeyError"
    taken = writer.call("name", name=name, key=put_rows(writer, tmp_path, rows(5, t=97)))
    assert taken["error"] == "StoreError" and "written once" in taken["message"]
    assert reader.ok("resolve", name=name)["key"] == key  # the first stays
    writer.ok("close")
    assert reader.call("resolve", name=name)["error"] == "UnknownKeyError"


def test_names_written_in_one_batch_keep_the_first_of_each(
    master: MooncakeMaster, clients: Any, tmp_path: Path
) -> None:
    """Shared-cache rows (``kv.shared``): a request's block names in one batch (``put_new``); a name another engine
    wrote first is left to it, the free ones are written, and each resolves to its writer's key."""
    first, second = clients(master.url, segment_bytes=16 << 20), clients(master.url, segment_bytes=16 << 20)
    reader = clients(master.url)
    mine, theirs = put_rows(first, tmp_path, rows(6, t=80)), put_rows(second, tmp_path, rows(7, t=64))
    names = [keys.derive(b"s", "shared-kv-cache", f"block-{i}") for i in range(5)]
    assert second.ok("name_many", pairs=[[names[1], f"{theirs}@32"]])["written"] == [names[1]]
    written = first.ok("name_many", pairs=[[name, f"{mine}@{16 * (i + 1)}"] for i, name in enumerate(names)])
    assert written["written"] == [names[0], *names[2:]]
    expected = [f"{mine}@16", f"{theirs}@32", f"{mine}@48", f"{mine}@64", f"{mine}@80"]
    assert [reader.ok("resolve", name=name)["key"] for name in names] == expected
    assert first.ok("name_many", pairs=[[names[0], f"{mine}@16"]])["written"] == []  # written once


def test_a_full_segment_raises_store_full_and_never_spills_into_another_engine_s(
    kit: Any, clients: Any, tmp_path: Path
) -> None:
    with MooncakeMaster(kit.master_binary, kit.env()) as own:  # no segment of an earlier test's client on it
        writer = clients(own.url + "&segment_mib=16", segment_bytes=1)  # segment_mib: a writer's segment, exactly
        # Another engine, with room: Mooncake places there what does not fit in the writer's segment.
        other = clients(own.url, segment_bytes=64 << 20)
        np.save(tmp_path / "a.npy", rows(4, t=2048))  # 3 MiB and a header
        minted = [keys.Namespace.mint().key() for _ in range(6)]
        answers = [writer.call("put_rows", key=key, path=str(tmp_path / "a.npy"), first_token=0) for key in minted]
        assert [a["ok"] for a in answers[:4]] == [True] * 4, answers  # a 16 MiB segment takes 90%: four
        for answer in answers[4:]:  # Mooncake placed it in the other engine's segment: taken back, refused
            assert answer["error"] == "StoreFullError" and "placed it in" in answer["message"], answer
        assert [writer.ok("size", key=key)["size"] for key in minted[4:]] == [None, None]
        close_all(writer, other)


def test_an_unreachable_master_is_refused_at_probe_and_construction(clients: Any) -> None:
    url = f"mooncake://127.0.0.1:{free_port()}?metadata=http://127.0.0.1:{free_port()}/metadata"
    with pytest.raises(StoreUnavailableError, match=r"master 127\.0\.0\.1:\d+ does not answer.*start it"):
        mooncake.probe(mooncake.parse_url(url), timeout=2.0)
    client = clients()
    for op, request in (("probe", {"url": url}), ("open", {"url": url, "segment_bytes": 1 << 20})):
        answer = client.call(op, timeout=20, **request)
        assert answer["error"] == "StoreUnavailableError" and "127.0.0.1" in answer["message"], answer


def test_a_master_killed_after_a_put_fails_the_next_calls_without_hanging(
    kit: Any, clients: Any, tmp_path: Path
) -> None:
    with MooncakeMaster(kit.master_binary, kit.env()) as own:
        writer = clients(own.url, segment_bytes=16 << 20)
        key = put_rows(writer, tmp_path, rows(5, t=64))
        own.kill()
        started = time.monotonic()
        answer = writer.call(
            "put_rows", key=keys.Namespace.mint().key(), path=str(tmp_path / f"{key}.npy"), first_token=0
        )
        assert answer["error"] == "StoreUnavailableError", answer
        assert f"master 127.0.0.1:{own.port}" in answer["message"], answer
        assert time.monotonic() - started < 15  # Mooncake's own RPC timeout (~4 s), not a hang
        started = time.monotonic()  # the master found gone: each later call probes it and fails at once
        for op, request in (("read", {"offset": 0, "nbytes": 64}), ("size", {}), ("remove", {})):
            answer = writer.call(op, key=key, **request)
            assert answer["error"] == "StoreUnavailableError" and "does not answer" in answer["message"], answer
        assert writer.call("close")["ok"]  # not Mooncake's teardown, which retries a dead master for ~20 s
        assert time.monotonic() - started < 3


def test_parse_url_fields_and_refusals() -> None:
    parsed = mooncake.parse_url(
        "mooncake://10.0.0.5:50051?metadata=http://10.0.0.5:8080/metadata&protocol=rdma&device=mlx5_0"
        "&segment_mib=4096&buffer_mib=32"
    )
    assert parsed == mooncake.MooncakeSettings(
        "10.0.0.5", 50051, "http://10.0.0.5:8080/metadata", "rdma", "mlx5_0", 4096, 32
    )
    assert parsed.master == "10.0.0.5:50051"
    plain = mooncake.parse_url("mooncake://h:1?metadata=http://h:2/metadata")
    assert (plain.protocol, plain.device, plain.segment_mib, plain.buffer_mib) == ("tcp", "", None, 16)
    for bad in (
        "mooncake:/nohost",
        "mooncake://h?metadata=http://h:2/metadata",
        "mooncake://h:1",
        "mooncake://h:1?metadata=etcd://h:2",
        "mooncake://h:1?metadata=http://h:2/metadata&protocol=udp",
        "mooncake://h:1?metadata=http://h:2/metadata&segment_mib=x",
        "mooncake://h:1?metadata=http://h:2/metadata&color=red",
        "mooncake://h:1/path?metadata=http://h:2/metadata",
        "redis://h:1?metadata=http://h:2/metadata",
    ):
        with pytest.raises(ValueError, match=URL_FORM.replace("?", r"\?")):
            mooncake.parse_url(bad)


def test_without_mooncake_the_message_says_what_to_install() -> None:
    try:
        importlib.import_module("mooncake.store")
    except ImportError:
        pass
    else:
        pytest.skip("Mooncake is importable in this process")
    with pytest.raises(
        StoreUnavailableError, match="pip install mooncake-transfer-engine-non-cuda.*npu.*cuda13.*libibverbs"
    ):
        mooncake.MooncakeBackend("mooncake://127.0.0.1:1?metadata=http://127.0.0.1:2/metadata")
