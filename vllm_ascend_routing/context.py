# SPDX-License-Identifier: Apache-2.0
"""What every feature of the registry (``features.FEATURES``) is installed with. A leaf."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class InstallContext:
    """One process's installation: the generation's adapter (``compat.Adapter``: its capabilities, its stores), the
    platform's device type and the vLLM release, as detected once by ``integration.install``, and how to verify a
    package's targets that are imported later (vllm-ascend's worker modules)."""

    adapter: Any  # compat.Adapter; typed loosely so that features need not import compat (which imports them)
    platform: str
    vllm: str
    # Verify the targets of a package (``"vllm_ascend"``) when it is imported later (``manifest.verify``).
    verify: Callable[[str], object] = lambda package: None


def satisfied(adapter: Any, needs: tuple[str, ...]) -> bool:
    """Whether ``adapter`` (an adapter or its class) has every capability in ``needs`` (its attributes of those
    names, true: ``per_request_output``, ``kv_rows`` ...)."""
    return all(bool(getattr(adapter, name, None)) for name in needs)
