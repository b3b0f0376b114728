# SPDX-License-Identifier: Apache-2.0
"""TEST-ONLY: the ``VLLM_CACHE_ROOT`` the tests' engines run with: nothing compiled in it, model info shared.

Each test session (and each doctor / replay-check / stress test) starts its engines with a fresh cache root, so
that vLLM really compiles: a compiled graph cached by an earlier checkout would hide a change in where the plugin's
capture sits in the graph. vLLM keeps something else there too: ``modelinfos/``, what it learnt about each model
class by importing the model's module in a subprocess of its own (about 17 s on this machine, once per class and
cache root). That file is keyed by a hash of the model's source, so it is never stale; it is shared, one folder per
vLLM release, through a link in each fresh root.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from vllm_ascend_routing import envs

MODEL_INFO = "modelinfos"  # vLLM's folder under VLLM_CACHE_ROOT (model_executor/models/registry.py, 0.20-0.32)


def shared_model_info() -> Path:
    """This environment's vLLM release's model-info folder, kept across runs."""
    try:
        release = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        release = "none"
    folder = Path(envs.VLLM_ASCEND_ROUTING_CACHE) / "vllm-model-info" / release
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def fresh_cache_root(path: Path) -> Path:
    """``path`` as a ``VLLM_CACHE_ROOT`` with no compiled graph, whose model info is the shared folder's."""
    path.mkdir(parents=True, exist_ok=True)
    link = path / MODEL_INFO
    if not link.is_symlink():
        link.symlink_to(shared_model_info(), target_is_directory=True)
    return path
