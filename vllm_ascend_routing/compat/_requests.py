# SPDX-License-Identifier: Apache-2.0
"""What an engine-core ``Request`` says about where its prompt's KV came from, across vLLM releases.

Read once, when the scheduler first schedules the request (``output.engine``): vLLM 0.26+ keeps the split on
``request.prefill_stats`` until the request's first output; earlier releases keep ``num_cached_tokens`` (local and
external together) and ``num_external_computed_tokens`` on the request itself.
"""

from __future__ import annotations

from typing import Any


def local_cached_tokens(request: Any) -> int:
    """Prompt tokens this engine served from its own prefix cache at the request's first scheduling."""
    stats = getattr(request, "prefill_stats", None)
    if stats is not None and hasattr(stats, "num_local_cached_tokens"):
        return int(stats.num_local_cached_tokens)
    cached = int(getattr(request, "num_cached_tokens", 0) or 0)
    external = int(getattr(request, "num_external_computed_tokens", 0) or 0)
    return max(0, cached - external)
