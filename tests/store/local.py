# SPDX-License-Identifier: Apache-2.0
"""A node-local store in a test's own folder, as an engine (a ledger) and a trainer (``replay``) both see it."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_ascend_routing.store import publisher, shm
from vllm_ascend_routing.store import reader as stored
from vllm_ascend_routing.store.keys import Namespace
from vllm_ascend_routing.store.ledger import Ledger


def shm_ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cap_bytes: int = 1 << 30) -> Ledger:
    """An engine's ledger over ``shm`` rooted in ``tmp_path``; ``VLLM_ASCEND_ROUTING_STORE=shm`` for the readers."""
    monkeypatch.setattr(shm.ShmBackend.__init__, "__defaults__", (str(tmp_path),))
    monkeypatch.setenv("VLLM_ASCEND_ROUTING_STORE", "shm")
    monkeypatch.setattr(stored, "_clients", {})
    return Ledger(shm.ShmBackend(), Namespace.mint(), cap_bytes, 0)


def deployment_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A node-local store in ``tmp_path`` as a deployment's engines share it: the deployment's secret set
    (``VLLM_ASCEND_ROUTING_KV_SECRET``), a fresh publisher for this process; the store's folder."""
    shm_ledger(tmp_path, monkeypatch)
    monkeypatch.setattr(publisher, "_publishers", {})
    monkeypatch.setenv("VLLM_ASCEND_ROUTING_KV_SECRET", "deployment-a")
    return Path(shm.folder(str(tmp_path)))
