# SPDX-License-Identifier: Apache-2.0
"""Route this package's log records through vLLM's handlers.

vLLM configures only the ``vllm`` logger namespace; a logger named ``vllm_ascend_routing`` would have
no handler and every line would be dropped. Child loggers of ``vllm.plugins`` inherit vLLM's setup.
"""

from __future__ import annotations

import logging

_NAMESPACE = "vllm.plugins.vllm_ascend_routing"


def get_logger(name: str) -> logging.Logger:
    """A logger under vLLM's namespace, e.g. ``get_logger(__name__)``."""
    suffix = name.removeprefix("vllm_ascend_routing").lstrip(".")
    return logging.getLogger(f"{_NAMESPACE}.{suffix}" if suffix else _NAMESPACE)
