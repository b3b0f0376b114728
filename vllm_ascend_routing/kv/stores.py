# SPDX-License-Identifier: Apache-2.0
"""What a vLLM API generation provides so that rows follow KV connectors: its scheduler-side store of routing rows,
as the follower (``kv.follower``) writes carried rows into it and reads a finished request's rows from it.

The generations implement these under ``compat/`` (0.22-0.30: the scheduler's slot buffer; 0.31+: the AuxOutput
connector's block store); an adapter states ``kv_rows`` (``None``: KV connectors are refused on it).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from vllm_ascend_routing.kv.carriers import RowLayout
from vllm_ascend_routing.patching import Patch


class SchedulerRows(Protocol):
    """One scheduler's routed-experts store, as this generation keeps it."""

    layout: RowLayout

    def finished_rows(self, request: Any, block_ids: Any) -> np.ndarray | None:
        """The rows of a finished request's tokens from token 0 on, ``[n, L, K]``: its prompt, then (where the
        store keeps them) its generated tokens but the last (``None``: unknown)."""

    def inject(self, request: Any, blocks: Any, start: int, rows: np.ndarray) -> None:
        """Make ``rows`` the rows of the request's tokens ``[start, start + len(rows))``, which vLLM loads."""

    def forget(self, request_id: str) -> None:
        """The request finished: drop what is kept for it."""


class KvRows(Protocol):
    """What a generation module provides so that rows follow KV connectors (``ADAPTER.kv_rows``)."""

    @property
    def patches(self) -> tuple[Patch, ...]:
        """Everything it relies on in vLLM (checked when a connector is configured)."""

    def install(self) -> None:
        """Process-wide patches (the lift of vLLM's refusal, worker-side stores); the follower hooks the scheduler."""

    def attach(self, scheduler: Any) -> SchedulerRows | None:
        """This scheduler's store, or ``None`` where it returns no routed experts."""
