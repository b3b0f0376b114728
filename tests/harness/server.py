# SPDX-License-Identifier: Apache-2.0
"""A vLLM OpenAI server on loopback for tests: start, wait healthy, metrics, memory, stop."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def post(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
    """POST ``body`` as JSON (with ``headers`` too); the decoded JSON reply."""
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json", **(headers or {})}
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


class Server:
    """``with Server(model_dir, extra_args) as server: server.url ...`` (float32, seed 0, routed experts on unless
    ``routed_experts=False``)."""

    def __init__(
        self,
        model: Path,
        extra_args: list[str],
        startup_timeout: float = 300.0,
        env: dict[str, str] | None = None,
        routed_experts: bool = True,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            *(["--enable-return-routed-experts"] if routed_experts else []),
            "--seed",
            "0",
            *extra_args,
        ]
        self.startup_timeout = startup_timeout
        self.env = env
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = ""

    def __enter__(self) -> Server:
        log_fd, self.log_path = tempfile.mkstemp(prefix="vllm_serve_", suffix=".log")
        self.process = subprocess.Popen(self.cmd, stdout=log_fd, stderr=subprocess.STDOUT, env=self.env)
        os.close(log_fd)
        deadline = time.monotonic() + self.startup_timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}; log: {self.log_path}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2):
                    return self
            except OSError:
                if time.monotonic() > deadline:
                    self.__exit__(None, None, None)
                    raise RuntimeError(
                        f"server not healthy after {self.startup_timeout}s; log: {self.log_path}"
                    ) from None
                time.sleep(1)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def metrics(self) -> dict[str, float]:
        """Prometheus counters and gauges, summed over labels."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as response:
            text = response.read().decode()
        totals: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            name, _, value = line.rpartition(" ")
            name = name.split("{", 1)[0]
            try:
                totals[name] = totals.get(name, 0.0) + float(value)
            except ValueError:
                continue
        return totals

    def rss_bytes(self) -> int:
        """Resident memory of the server and every process it started (front-end, engine core, workers)."""
        assert self.process is not None
        children: dict[int, list[int]] = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                children.setdefault(ppid, []).append(int(entry.name))
        total, todo = 0, [self.process.pid]
        while todo:
            pid = todo.pop()
            todo += children.get(pid, [])
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            for line in status.splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        return total
