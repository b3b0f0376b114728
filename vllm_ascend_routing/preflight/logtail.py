# SPDX-License-Identifier: Apache-2.0
"""The last lines this process and its children wrote, kept while passing them through unchanged.

vLLM reports a failed worker or engine-core process as "see root cause above": the root cause is that process's
traceback, written to the output it inherited. ``Tail`` puts a pipe under file descriptors 1 and 2 (so child
processes started meanwhile write into it too), copies everything on to where it went before, and keeps the
last ``limit`` bytes for ``preflight.startup.classify``.
"""

from __future__ import annotations

import os
import sys
import threading
from types import TracebackType

LIMIT = 64 * 1024
DRAIN_S = 5.0  # how long leaving waits for what is still in the pipes (children still writing are not waited on)


class Tail:
    def __init__(self, limit: int = LIMIT, fds: tuple[int, ...] = (1, 2)) -> None:
        self.limit = limit
        self.fds = fds
        self._kept = bytearray()
        self._lock = threading.Lock()
        self._saved: dict[int, int] = {}
        self._threads: list[threading.Thread] = []

    def text(self) -> str:
        with self._lock:
            return self._kept.decode(errors="replace")

    def _keep(self, data: bytes) -> None:
        with self._lock:
            self._kept += data
            del self._kept[: max(0, len(self._kept) - self.limit)]

    def _copy(self, read_end: int, target: int) -> None:
        """Until every writer closed the pipe (children still running keep it open: they are passed through as
        long as they write); ``target`` is this thread's own copy of the original descriptor."""
        try:
            with os.fdopen(read_end, "rb", buffering=0) as pipe:
                while data := pipe.read(65536):
                    self._keep(data)
                    view = memoryview(data)
                    while view:
                        try:
                            view = view[os.write(target, view) :]
                        except OSError:  # the original output is gone: keep the tail only
                            break
        finally:
            os.close(target)

    def __enter__(self) -> Tail:
        _flush()
        for fd in self.fds:
            saved = os.dup(fd)
            read_end, write_end = os.pipe()
            os.dup2(write_end, fd)
            os.close(write_end)
            self._saved[fd] = saved
            thread = threading.Thread(target=self._copy, args=(read_end, os.dup(saved)), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        _flush()
        for fd, saved in self._saved.items():
            os.dup2(saved, fd)  # this process's copy of the pipe's write end is closed here
            os.close(saved)
        for thread in self._threads:
            thread.join(timeout=DRAIN_S)
        self._saved.clear()


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        if stream is not None:
            try:
                stream.flush()
            except (OSError, ValueError):
                continue
