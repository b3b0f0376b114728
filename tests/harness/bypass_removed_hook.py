# SPDX-License-Identifier: Apache-2.0
"""TEST-ONLY: imported by vLLM in the worker (``worker_extension_cls``, ``bypass.py``), before it loads the
model; importing it installs the removed-hook bypass stand-in there. Never imported by the plugin."""

from __future__ import annotations

from tests.harness import bypass

bypass.install("removed-hook")


class RemovedHook:
    """The extension class vLLM mixes into its worker: no methods of its own."""
