# SPDX-License-Identifier: Apache-2.0
"""The 0.20.x store against another local user: a planted symlink, a state directory someone else owns or can
write, pre-created segments. The engine refuses or stays safe, and no foreign file changes."""

from __future__ import annotations

import os
import stat
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from vllm_ascend_routing.compat.shm import store

OTHER_UID = 65534  # nobody
needs_root = pytest.mark.skipif(os.getuid() != 0, reason="creating a file owned by another uid needs root")


@pytest.fixture(autouse=True)
def private_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def _spec() -> store.SegmentSpec:
    return store.SegmentSpec.for_engine(f"sec{uuid.uuid4().hex[:8]}", 0, (4, 2, 2), 8)


def _state_path(tmp: Path) -> Path:
    return tmp / f"{store.PREFIX}-{os.getuid()}"


@pytest.fixture
def foreign_segments() -> Iterator[list[Path]]:
    """Segments another user planted in /dev/shm (removed at the end)."""
    planted: list[Path] = []
    yield planted
    for path in planted:
        path.unlink(missing_ok=True)


def _plant(path: Path, content: bytes, uid: int | None = None) -> None:
    path.write_bytes(content)
    if uid is not None:
        os.chown(path, uid, uid)


def test_the_state_directory_is_created_private(private_tmp: Path) -> None:
    previous = os.umask(0o022)
    try:
        path = store.state_dir()
    finally:
        os.umask(previous)
    info = os.lstat(path)
    assert path == _state_path(private_tmp) and stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid()


def test_a_symlinked_state_directory_is_refused(private_tmp: Path) -> None:
    victim = private_tmp / "victim"
    victim.mkdir()
    _state_path(private_tmp).symlink_to(victim)
    spec = _spec()
    with pytest.raises(store.StateDirError, match="is not a directory .*symlink.* remove it"):
        store.SegmentWriter(spec)
    assert list(victim.iterdir()) == []
    assert not any(p.name.startswith(spec.key) for p in store.SHM_DIR.iterdir())


@needs_root
def test_a_state_directory_owned_by_another_uid_is_refused(private_tmp: Path) -> None:
    planted = _state_path(private_tmp)
    planted.mkdir(mode=0o700)
    os.chown(planted, OTHER_UID, OTHER_UID)
    with pytest.raises(store.StateDirError, match=f"owned by uid {OTHER_UID}"):
        store.SegmentWriter(_spec())
    assert list(planted.iterdir()) == [] and os.lstat(planted).st_uid == OTHER_UID


def test_a_state_directory_others_can_write_is_refused(private_tmp: Path) -> None:
    planted = _state_path(private_tmp)
    planted.mkdir()
    planted.chmod(0o777)
    with pytest.raises(store.StateDirError, match="mode 0777: other users can reach it"):
        store.SegmentWriter(_spec())
    assert list(planted.iterdir()) == []


def test_a_symlink_planted_as_the_owner_file_is_never_followed(private_tmp: Path) -> None:
    spec = _spec()
    victim = private_tmp / "victim.txt"
    victim.write_text("precious")
    store.owner_file(spec.key).symlink_to(victim)  # removed by the start-up sweep (the write itself: below)
    writer = store.SegmentWriter(spec)
    try:
        owner = store.owner_file(spec.key)
        assert not owner.is_symlink() and owner.read_text() == f"{os.getpid()} {writer.name}"
        assert stat.S_IMODE(os.lstat(owner).st_mode) == 0o600
    finally:
        writer.close()
    assert victim.read_text() == "precious"


@needs_root
def test_pre_created_segments_are_neither_used_nor_removed(foreign_segments: list[Path]) -> None:
    """Another user pre-creates the old predictable name and a name with the engine's key and a token: the
    engine's segment gets a name nobody could predict, and the planted ones stay as they were."""
    spec = _spec()
    for name in (spec.key, f"{spec.key}_0123456789abcdef", f"{store.PREFIX}_orphan_{uuid.uuid4().hex[:6]}"):
        foreign_segments.append(store.SHM_DIR / name)
        _plant(foreign_segments[-1], b"foreign", OTHER_UID)
    writer = store.SegmentWriter(spec)
    try:
        assert writer.name not in {p.name for p in foreign_segments}
        assert stat.S_IMODE(os.lstat(store.SHM_DIR / writer.name).st_mode) == 0o600
        assert all(n not in store.remove_stale() for n in (p.name for p in foreign_segments))
    finally:
        writer.close()
    for path in foreign_segments:
        assert path.read_bytes() == b"foreign" and os.lstat(path).st_uid == OTHER_UID


def test_segment_names_are_unpredictable() -> None:
    spec = _spec()
    names = []
    for _ in range(2):
        writer = store.SegmentWriter(spec)
        names.append(writer.name)
        writer.close()
    assert names[0] != names[1] and all(len(n) == len(spec.key) + 17 for n in names)


@needs_root
def test_the_reader_refuses_a_segment_another_user_owns(foreign_segments: list[Path]) -> None:
    """An owner file naming a foreign segment (what a redirect would need) is refused, not read."""
    spec = _spec()
    name = f"{spec.key}_{uuid.uuid4().hex[:16]}"
    foreign_segments.append(store.SHM_DIR / name)
    _plant(foreign_segments[-1], bytes(spec.nbytes), OTHER_UID)
    store.owner_file(spec.key).write_text(f"{os.getpid()} {name}")
    with pytest.raises(RuntimeError, match="belongs to another user"):
        store.SegmentReader(spec)
    store.owner_file(spec.key).unlink()


def test_the_owner_file_write_itself_never_follows_a_symlink(private_tmp: Path) -> None:
    """The write, apart from the start-up sweep that already removes a planted link: a symlink appearing at the
    owner file's path between the two (a race) is replaced, its target untouched."""
    victim = private_tmp / "victim.txt"
    victim.write_text("precious")
    path = store.state_dir() / f"{store.PREFIX}_race_0.owner"
    path.symlink_to(victim)
    store._write_private(path, "123 segment")
    assert not path.is_symlink() and path.read_text() == "123 segment"
    assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600 and victim.read_text() == "precious"
