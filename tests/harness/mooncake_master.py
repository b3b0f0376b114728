# SPDX-License-Identifier: Apache-2.0
"""A real ``mooncake_master`` on localhost for a test: free ports, its own HTTP metadata server (no etcd), its own
process group, killed with the test process (``PR_SET_PDEATHSIG``) so none lingers after a crashed run.

    with MooncakeMaster(kit.master_binary, kit.env()) as master:
        backend = MooncakeBackend(master.url, segment_bytes=...)   # in a process with the kit's environment
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

_PR_SET_PDEATHSIG = 1


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def die_with_parent() -> None:
    """A ``preexec_fn``: the child gets SIGKILL when the process that started it dies (no orphan after a crash)."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class MooncakeMaster:
    def __init__(self, binary: str | Path, env: dict[str, str] | None = None, *, start_timeout_s: float = 20.0) -> None:
        self.binary = str(binary)
        self.env = env  # the kit's (Kit.env()): the binary links against libibverbs and libnl like the client
        self.start_timeout_s = start_timeout_s
        self.host = "127.0.0.1"
        self.port = self.metadata_port = 0
        self.process: subprocess.Popen[bytes] | None = None
        handle, name = tempfile.mkstemp(prefix="mooncake_master.", suffix=".log")
        os.close(handle)
        self.log = Path(name)

    @property
    def url(self) -> str:
        return f"mooncake://{self.host}:{self.port}?metadata={self.metadata_url}"

    @property
    def metadata_url(self) -> str:
        return f"http://{self.host}:{self.metadata_port}/metadata"

    def start(self) -> MooncakeMaster:
        for _ in range(3):  # a free port may be taken between finding it and the master binding it
            self.port, self.metadata_port, metrics = free_port(), free_port(), free_port()
            command = [
                self.binary,
                f"-rpc_port={self.port}",
                f"-rpc_address={self.host}",
                "-enable_http_metadata_server=true",
                f"-http_metadata_server_host={self.host}",
                f"-http_metadata_server_port={self.metadata_port}",
                f"-metrics_port={metrics}",  # it binds one even with reporting off: not the fixed default 9003
                f"-metrics_host={self.host}",
                "-enable_metric_reporting=false",
            ]
            with open(self.log, "ab") as log:
                self.process = subprocess.Popen(
                    command,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=self.env,
                    start_new_session=True,
                    preexec_fn=die_with_parent,
                )
            if self._wait_ready():
                return self
            self.stop()
        raise RuntimeError(f"mooncake_master did not start; its log ({self.log}):\n{self.log.read_text()[-4000:]}")

    def _wait_ready(self) -> bool:
        assert self.process is not None
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False
            if self._answers():
                return True
            time.sleep(0.05)
        return False

    def _answers(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=1):
                pass
            opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
            opener.open(f"{self.metadata_url}?key=probe", timeout=1).close()
        except urllib.error.HTTPError:
            return True  # 404: the metadata server answers
        except OSError:
            return False
        return True

    def kill(self) -> None:
        """SIGKILL the master (a fault test: the master gone mid-run)."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.kill()

    def __enter__(self) -> MooncakeMaster:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.stop()
        self.log.unlink(missing_ok=True)
