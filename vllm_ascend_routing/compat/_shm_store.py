# SPDX-License-Identifier: Apache-2.0
"""KV-slot-indexed routing rows in POSIX shared memory, for the 0.20.x generation.

Compared with vLLM 0.20.x's own store (int32 rows, ``vllm_routed_experts_buffer_<instance>_<dp>``):
  * rows are stored narrow (uint8 for <= 255 experts, else int16) and widened to int32 only when read:
    at most a quarter of upstream's ``/dev/shm`` footprint for <= 255 experts. An invalid id (the capture
    op's -1) is stored as the dtype's marker (uint8: 255, which is then no expert's id; int16: -1) and
    read back as -1, so it never turns into a plausible expert id;
  * free ``/dev/shm`` space is checked before creating, with an error that says what to change;
  * names carry this plugin's prefix plus the engine's instance id and DP rank, and an owner file records
    the creating pid: a live owner makes a second engine with the same name refuse instead of sharing
    the segment; a dead owner's segment (crashed engine) is removed at the next start;
  * a clean close unlinks the segment and its owner file, leaving nothing behind.
No lock is taken: the worker writes only the slots of the step it just ran, the scheduler reads only the
slots of requests that have stopped, and a stopped request's slots are not reused before it is freed.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path

import numpy as np

PREFIX = "vllm_ascend_routing"
SHM_DIR = Path("/dev/shm")


class ShmSpaceError(RuntimeError):
    """Not enough free ``/dev/shm`` for the routing store."""


class ShmCollisionError(RuntimeError):
    """A live engine already owns a segment with this name."""


def state_dir() -> Path:
    """Owner files live here (one per segment, holding the creating pid)."""
    path = Path(tempfile.gettempdir()) / PREFIX
    path.mkdir(parents=True, exist_ok=True)
    return path


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
    """Name, shape ``[kv_slots, num_hidden_layers, top_k]`` and storage dtype of one engine's store."""

    name: str
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


def _owner_file(name: str) -> Path:
    return state_dir() / f"{name}.owner"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _owner(name: str) -> int | None:
    try:
        return int(_owner_file(name).read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def _unlink_segment(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(SHM_DIR / name)


def remove_stale() -> list[str]:
    """Remove segments whose owner process is dead, or that have no owner file; returns their names.

    The owner file is written before a segment is created and removed after it is unlinked, so a
    segment without one was left by a process that died between the two.
    """
    removed = []
    owned = {f.name.removesuffix(".owner") for f in state_dir().glob(f"{PREFIX}_*.owner")}
    present = {p.name for p in SHM_DIR.glob(f"{PREFIX}_*")} if SHM_DIR.is_dir() else set()
    for name in sorted(owned | present):
        pid = _owner(name)
        if pid is not None and _alive(pid):
            continue
        _unlink_segment(name)
        with contextlib.suppress(FileNotFoundError):
            _owner_file(name).unlink()
        removed.append(name)
    return removed


def check_free_space(spec: SegmentSpec, directory: Path = SHM_DIR) -> None:
    stat = os.statvfs(directory)
    free = stat.f_bavail * stat.f_frsize
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
        owner = _owner(spec.name)
        if owner is not None and _alive(owner):
            raise ShmCollisionError(
                f"vllm-ascend-routing: shared memory {spec.name} belongs to live process {owner}; two engines "
                "share one instance id. Give each engine its own instance id."
            )
        check_free_space(spec)
        _owner_file(spec.name).write_text(str(os.getpid()))
        self._shm = shared_memory.SharedMemory(name=spec.name, create=True, size=max(spec.nbytes, 1))
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
            _owner_file(self.spec.name).unlink()
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
        self._shm = _attach_untracked(spec.name)
        if self._shm.size < spec.nbytes:
            raise RuntimeError(f"shared memory {spec.name} is {self._shm.size} bytes, expected {spec.nbytes}")
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
