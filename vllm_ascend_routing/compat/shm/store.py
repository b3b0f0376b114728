# SPDX-License-Identifier: Apache-2.0
"""KV-slot-indexed routing rows in POSIX shared memory, for the 0.20.x generation.

Compared with vLLM 0.20.x's own store (int32 rows, ``vllm_routed_experts_buffer_<instance>_<dp>``):
  * rows are stored narrow (uint8 for <= 255 experts, else int16) and widened to int32 only when read:
    at most a quarter of upstream's ``/dev/shm`` footprint for <= 255 experts. An invalid id (the capture
    op's -1) is stored as the dtype's marker (uint8: 255, which is then no expert's id; int16: -1) and
    read back as -1, so it never turns into a plausible expert id;
  * free ``/dev/shm`` space is checked before creating, with an error that says what to change;
  * no name or path another local user can predict, pre-create or redirect: the segment's name ends in a
    random token (``<prefix>_<instance>_<dp>_<token>``, created exclusively, mode 0600), and the token is
    found only in the engine's owner file, kept in a private state directory (owner only, ownership and
    mode checked, refused otherwise; files created exclusively, never through a symlink);
  * the owner file also records the creating pid: a live owner makes a second engine with the same
    instance id refuse instead of sharing; a dead owner's segment (crashed engine) is removed at the next
    start. Only this user's segments are ever removed;
  * a clean close unlinks the segment and its owner file, leaving nothing behind.
No lock is taken: the worker writes only the slots of the step it just ran, the scheduler reads only the
slots of requests that have stopped, and a stopped request's slots are not reused before it is freed.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
import tempfile
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

import numpy as np

PREFIX = "vllm_ascend_routing"
SHM_DIR = Path("/dev/shm")
_PRIVATE = 0o700
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW


class ShmSpaceError(RuntimeError):
    """Not enough free ``/dev/shm`` for the routing store."""


class ShmCollisionError(RuntimeError):
    """A live engine already owns a segment with this name."""


class StateDirError(RuntimeError):
    """The state directory is not private to this user (another user could redirect or read it)."""


def state_dir() -> Path:
    """The private directory of owner files: ``$TMPDIR/vllm_ascend_routing-<uid>``, created mode 0700.

    An existing one is used only if it is a real directory (not a symlink) owned by this user with no
    group or other permission; otherwise ``StateDirError`` says what to do."""
    uid = os.getuid()
    path = Path(tempfile.gettempdir()) / f"{PREFIX}-{uid}"
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, _PRIVATE)
        os.chmod(path, _PRIVATE)  # whatever the umask left
    info = os.lstat(path)
    problem = None
    if not stat.S_ISDIR(info.st_mode):
        problem = "is not a directory (a symlink or a file)"
    elif info.st_uid != uid:
        problem = f"is owned by uid {info.st_uid}, not by this user (uid {uid})"
    elif info.st_mode & 0o077:
        problem = f"has mode {stat.S_IMODE(info.st_mode):04o}: other users can reach it"
    if problem is not None:
        raise StateDirError(
            f"vllm-ascend-routing: the routed-experts state directory {path} {problem}. Someone else may have "
            f"created it: remove it, or point TMPDIR at a directory only you can write, then restart."
        )
    return path


def _write_private(path: Path, text: str) -> None:
    """Create ``path`` (mode 0600) and write ``text``; never through a symlink, never into another's file."""
    try:
        fd = os.open(path, _CREATE, 0o600)
    except FileExistsError:  # a stale file of ours (its owner is dead): replace it, never follow it
        os.unlink(path)
        fd = os.open(path, _CREATE, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(text)


def _read_private(path: Path) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except (FileNotFoundError, OSError):
        return None
    with os.fdopen(fd) as file:
        return file.read()


# The stored value of an invalid id, per storage dtype; read back as -1.
INVALID = {np.dtype(np.uint8): 255, np.dtype(np.int16): -1}


def storage_dtype(num_experts: int) -> np.dtype:
    """uint8 only while 255 is no expert's id (it marks invalid ids); int16 beyond."""
    if num_experts <= 255:
        return np.dtype(np.uint8)
    if num_experts <= 32767:
        return np.dtype(np.int16)
    raise ValueError(f"{num_experts} experts do not fit the routing store (at most 32767)")


@dataclass(frozen=True)
class SegmentSpec:
    """The engine's key (``<prefix>_<instance>_<dp>``), shape ``[kv_slots, num_hidden_layers, top_k]`` and
    storage dtype of one engine's store. The segment's own name adds a random token (``SegmentWriter``)."""

    key: str
    shape: tuple[int, int, int]
    dtype: np.dtype

    @classmethod
    def for_engine(cls, instance_id: str, dp_rank: int, shape: tuple[int, int, int], num_experts: int) -> SegmentSpec:
        return cls(f"{PREFIX}_{instance_id}_{dp_rank}", shape, storage_dtype(num_experts))

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * self.dtype.itemsize

    @property
    def upstream_nbytes(self) -> int:
        """What vLLM 0.20.x's own int32 store needs for the same shape."""
        return int(np.prod(self.shape)) * 4


def owner_file(key: str) -> Path:
    """The engine's owner file: ``<pid> <segment name>``."""
    return state_dir() / f"{key}.owner"


def key_of(segment: str) -> str:
    """The engine key a segment name starts with (its random token removed)."""
    return segment.rsplit("_", 1)[0]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _owner(key: str) -> tuple[int, str] | None:
    """``(pid, segment name)`` from the engine's owner file, or ``None`` if absent or unreadable."""
    fields = (_read_private(owner_file(key)) or "").split()
    if len(fields) != 2 or not fields[0].isdigit() or key_of(fields[1]) != key:
        return None
    return int(fields[0]), fields[1]


def _ours(path: Path) -> bool:
    """A segment this user created (root included: another user's segment is never touched)."""
    try:
        return os.lstat(path).st_uid == os.getuid()
    except FileNotFoundError:
        return False


def _unlink_segment(name: str) -> None:
    path = SHM_DIR / name
    if _ours(path):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def remove_stale() -> list[str]:
    """Remove this user's segments whose owner process is dead, or that no live owner file names; returns
    their names. Another user's segments are left alone, whatever their name.

    The owner file is written before a segment is created and removed after it is unlinked, so a
    segment no owner file names was left by a process that died between the two.
    """
    removed = []
    live: set[str] = set()
    for file in state_dir().glob(f"{PREFIX}_*.owner"):
        key = file.name.removesuffix(".owner")
        owner = _owner(key)
        if owner is not None and _alive(owner[0]):
            live.add(owner[1])
            continue
        if owner is not None and _ours(SHM_DIR / owner[1]):
            _unlink_segment(owner[1])
            removed.append(owner[1])
        with contextlib.suppress(FileNotFoundError):
            file.unlink()
    present = {p.name for p in SHM_DIR.glob(f"{PREFIX}_*") if _ours(p)} if SHM_DIR.is_dir() else set()
    for name in sorted(present - live - set(removed)):
        _unlink_segment(name)
        removed.append(name)
    return removed


def check_free_space(spec: SegmentSpec, directory: Path = SHM_DIR) -> None:
    stat_ = os.statvfs(directory)
    free = stat_.f_bavail * stat_.f_frsize
    if free < spec.nbytes:
        mib = 1024 * 1024
        raise ShmSpaceError(
            f"vllm-ascend-routing: the routed-experts store needs {spec.nbytes / mib:.1f} MiB of {directory} "
            f"({spec.shape[0]} KV slots x {spec.shape[1]} layers x top-{spec.shape[2]}, {spec.dtype}) but only "
            f"{free / mib:.1f} MiB are free. Lower the KV cache size (--kv-cache-memory-bytes, "
            "--gpu-memory-utilization) or enlarge /dev/shm (e.g. docker --shm-size), or unset "
            "--enable-return-routed-experts."
        )


class SegmentWriter:
    """The worker side: creates the segment and writes rows by KV slot."""

    def __init__(self, spec: SegmentSpec) -> None:
        self.spec = spec
        remove_stale()
        owner = _owner(spec.key)
        if owner is not None and _alive(owner[0]):
            raise ShmCollisionError(
                f"vllm-ascend-routing: shared memory {owner[1]} belongs to live process {owner[0]}; two engines "
                "share one instance id. Give each engine its own instance id."
            )
        check_free_space(spec)
        self.name = f"{spec.key}_{secrets.token_hex(8)}"
        _write_private(owner_file(spec.key), f"{os.getpid()} {self.name}")
        # Created exclusively (O_EXCL, mode 0600): an existing name is never shared.
        self._shm = shared_memory.SharedMemory(name=self.name, create=True, size=max(spec.nbytes, 1))
        self.view: np.ndarray = np.ndarray(spec.shape, dtype=spec.dtype, buffer=self._shm.buf)
        self.view.fill(0)

    def write(self, slots: np.ndarray, rows: np.ndarray) -> None:
        """``view[slots] = rows`` for non-negative slots (negative slots are padding)."""
        keep = slots >= 0
        if not keep.all():
            slots, rows = slots[keep], rows[keep]
        # Invalid ids (negative: the capture op's -1) become the dtype's marker explicitly, not by wrapping.
        self.view[slots] = np.where(rows < 0, INVALID[self.view.dtype], rows)

    def close(self) -> None:
        """Close and unlink: a clean shutdown leaves nothing in /dev/shm or the state directory."""
        if self._shm is None:
            return
        del self.view
        self._shm.close()
        with contextlib.suppress(FileNotFoundError):
            self._shm.unlink()
        with contextlib.suppress(FileNotFoundError):
            owner_file(self.spec.key).unlink()
        self._shm = None  # type: ignore[assignment]


def _attach_untracked(name: str) -> shared_memory.SharedMemory:
    """Attach without registering with the resource tracker (Python < 3.13 has no ``track=False``).

    A registration would make the tracker, which a process tree shares, unlink the worker's segment when
    this process exits, and turn the worker's own unlink into a double unregister.
    """
    register = resource_tracker.register
    resource_tracker.register = lambda *args, **kwargs: None  # type: ignore[assignment]
    try:
        return shared_memory.SharedMemory(name=name)
    finally:
        resource_tracker.register = register  # type: ignore[assignment]


class SegmentReader:
    """The scheduler side: attaches to the worker's segment and reads rows widened to int32."""

    def __init__(self, spec: SegmentSpec) -> None:
        self.spec = spec
        owner = _owner(spec.key)
        if owner is None:
            raise RuntimeError(f"vllm-ascend-routing: no routed-experts store for {spec.key} (its worker has none)")
        self.name = owner[1]
        self._shm = _attach_untracked(self.name)
        if os.fstat(self._shm._fd).st_uid != os.getuid():  # type: ignore[attr-defined]
            self._shm.close()
            raise RuntimeError(f"vllm-ascend-routing: shared memory {self.name} belongs to another user")
        if self._shm.size < spec.nbytes:
            raise RuntimeError(f"shared memory {self.name} is {self._shm.size} bytes, expected {spec.nbytes}")
        self.view: np.ndarray = np.ndarray(spec.shape, dtype=spec.dtype, buffer=self._shm.buf)

    def read(self, slots: np.ndarray) -> np.ndarray:
        """int32 rows; an invalid id reads as -1."""
        rows = self.view[slots].astype(np.int32)
        rows[rows == INVALID[self.view.dtype]] = -1
        return rows

    def close(self) -> None:
        if self._shm is None:
            return
        del self.view
        self._shm.close()
        self._shm = None  # type: ignore[assignment]
