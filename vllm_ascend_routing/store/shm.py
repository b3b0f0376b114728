# SPDX-License-Identifier: Apache-2.0
"""The node-local backend (``VLLM_ASCEND_ROUTING_STORE=shm``): one file per object in shared memory (``/dev/shm``), no
service to run; for a trainer on the same node as its rollout engines (verl's colocated layout).

Objects live in one folder per user, ``/dev/shm/vllm_ascend_routing-<uid>``, which must be the user's own and closed to
everyone else (mode 0700: refused otherwise, so another user cannot plant or read objects). Each object is named by its
engine's instance and its key's 128-bit secret, created exclusively (``O_EXCL``, never following a link) with mode
0600. Writes and reads are plain ``pwrite``/``pread``: a ranged read reads those bytes only.

An engine's objects live while it does, however it ends (a SIGKILL included): the writing engine holds an exclusive
``flock`` on its instance's lease file (``<instance>.lease``) from its first object on, and the kernel drops it with the
process. A read checks the lease: an exited engine's keys resolve to nothing, and the reader removes that engine's
objects (so does the next engine that starts).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import os
import stat

from vllm_ascend_routing.store import keys, layout
from vllm_ascend_routing.store.interface import (
    StoreError,
    StoreFullError,
    StoreUnavailableError,
    UnknownKeyError,
)

SHM_ROOT = "/dev/shm"
_FOLDER = "vllm_ascend_routing-{uid}"


def folder(root: str = SHM_ROOT) -> str:
    return os.path.join(root, _FOLDER.format(uid=os.getuid()))


def _writer(key: str, parts: list[memoryview]) -> str:
    """The engine instance an object belongs to: a key's own, or the one a name's pointer names."""
    if not keys.is_name(key):
        return keys.parse(key).instance
    return layout.decode_pointer(key, b"".join(bytes(part) for part in parts)).instance


class ShmBackend:
    name = "shm"

    def __init__(self, root: str = SHM_ROOT) -> None:
        if not os.path.isdir(root):
            raise StoreUnavailableError(
                f"VLLM_ASCEND_ROUTING_STORE=shm: {root} is not a folder (no POSIX shared memory here); use a "
                "mooncake:// store or unset VLLM_ASCEND_ROUTING_STORE to return rows inline"
            )
        self.path = folder(root)
        try:
            os.mkdir(self.path, 0o700)
        except FileExistsError:
            pass
        except OSError as error:
            raise StoreUnavailableError(f"VLLM_ASCEND_ROUTING_STORE=shm: cannot create {self.path}: {error}") from error
        info = os.lstat(self.path)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or stat.S_IMODE(info.st_mode) & 0o077:
            raise StoreUnavailableError(
                f"VLLM_ASCEND_ROUTING_STORE=shm: {self.path} must be a folder owned by this user (uid {os.getuid()}) "
                f"with mode 0700 (found uid {info.st_uid}, mode {stat.S_IMODE(info.st_mode):o}): remove it and start "
                "again"
            )

        self._leases: dict[str, int] = {}  # instance -> the open, exclusively locked lease file (a writer's)

    def _file(self, key: str) -> str:
        if keys.is_name(key):
            return os.path.join(self.path, f"n-{key.removeprefix(keys.NAME_VERSION + '.')}")
        parsed = keys.parse(key)
        return os.path.join(self.path, f"{parsed.instance}-{parsed.secret}")

    def _lease(self, instance: str) -> str:
        return os.path.join(self.path, f"{instance}.lease")

    def _hold_lease(self, instance: str) -> None:
        """A writer's first object of ``instance``: lock its lease for this process's life (and sweep the objects of
        engines that have exited)."""
        if instance in self._leases:
            return
        self.sweep()
        fd = os.open(self._lease(instance), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._leases[instance] = fd

    def _alive(self, instance: str) -> bool:
        """Whether the engine of ``instance`` still runs (holds its lease); where not, its objects are removed."""
        if instance in self._leases:
            return True
        try:
            fd = os.open(self._lease(instance), os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True  # its engine holds it
        finally:
            os.close(fd)
        self._remove_instance(instance)
        return False

    def _remove_instance(self, instance: str) -> None:
        for path in glob.glob(os.path.join(glob.escape(self.path), f"{instance}-*")):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._lease(instance))

    def sweep(self) -> None:
        """Remove the objects of every engine that has exited (its lease no longer held)."""
        for lease in glob.glob(os.path.join(glob.escape(self.path), "*.lease")):
            self._alive(os.path.basename(lease).removesuffix(".lease"))
        for pointer in glob.glob(os.path.join(glob.escape(self.path), "n-*")):
            name = f"{keys.NAME_VERSION}.{os.path.basename(pointer).removeprefix('n-')}"
            try:
                alive = self._alive(layout.read_pointer(self, name).instance)
            except (StoreError, ValueError):
                alive = False  # not a pointer of ours: gone
            if not alive:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(pointer)

    def put(self, key: str, parts: list[memoryview]) -> None:
        # a name's object lives as long as its writer (the pointer names it; ``sweep``), a key's as its engine
        self._hold_lease(_writer(key, parts))
        path = self._file(key)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError as error:
            raise StoreUnavailableError(f"shm store: cannot create an object in {self.path}: {error}") from error
        try:
            try:
                at = 0
                for part in parts:
                    done = 0
                    while done < len(part):
                        done += os.pwrite(fd, part[done:], at + done)
                    at += len(part)
            finally:
                os.close(fd)
        except OSError as error:
            os.unlink(path)
            if error.errno in (errno.ENOSPC, errno.EDQUOT, errno.ENOMEM):
                raise StoreFullError(f"shm store: {self.path} is full ({error.strerror})") from error
            raise StoreUnavailableError(f"shm store: writing {path} failed: {error}") from error

    def put_new(self, items: list[tuple[str, bytes]]) -> list[str]:
        written = []
        for key, data in items:
            if os.path.lexists(self._file(key)):
                continue  # taken: O_EXCL in put refuses it too, should another writer come in between
            try:
                self.put(key, [memoryview(data)])
            except StoreUnavailableError:
                if not os.path.lexists(self._file(key)):
                    raise
                continue
            written.append(key)
        return written

    def read(self, key: str, offset: int, nbytes: int) -> bytes:
        if not keys.is_name(key) and not self._alive(keys.parse(key).instance):
            raise UnknownKeyError(key, "the engine that published it has exited")
        try:
            fd = os.open(self._file(key), os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise UnknownKeyError(key) from None
        try:
            chunks, done = [], 0
            while done < nbytes:
                chunk = os.pread(fd, nbytes - done, offset + done)
                if not chunk:
                    raise UnknownKeyError(key, f"its object ends before byte {offset + nbytes}")
                chunks.append(chunk)
                done += len(chunk)
            return b"".join(chunks) if len(chunks) != 1 else chunks[0]
        finally:
            os.close(fd)

    def size(self, key: str) -> int | None:
        try:
            return os.stat(self._file(key), follow_symlinks=False).st_size
        except FileNotFoundError:
            return None

    def remove(self, key: str) -> bool:
        try:
            os.unlink(self._file(key))
            return True
        except FileNotFoundError:
            return False

    def close(self) -> None:
        """A writer's shutdown: its engines' leases are let go (their objects, already removed by the ledger, or
        removed by the next reader or engine)."""
        for instance, fd in list(self._leases.items()):
            os.close(fd)
            self._remove_instance(instance)
        self._leases.clear()
