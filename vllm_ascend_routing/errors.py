# SPDX-License-Identifier: Apache-2.0
"""The error types several layers raise (a leaf: no package imports), so that neither axis, the generations
(``compat/``) nor the backends (``backends/``), imports the other for one. Each is re-exported where it is public:
``vllm_ascend_routing.compat.UnsupportedVllmError``."""

from __future__ import annotations

__all__ = ["UnsupportedVllmError"]


class UnsupportedVllmError(RuntimeError):
    """Raised at start-up for a vLLM release or configuration the plugin refuses."""
