# SPDX-License-Identifier: Apache-2.0
"""What an engine's configuration means for capture on vllm-ascend (both of its MoE designs).

* Token-split layouts: each TP rank routes only its shard of the step (MC2 / all-to-all with expert
  parallel, flash-comm / sequence parallelism); the capture assembles the shards over TP (``parallel``).
* xlite (``additional_config.xlite_graph_config.enabled``): vllm-ascend's ``XliteModelRunner`` runs decode
  (and, in full mode, prefill) in xlite's native runtime; no MoE Python runs there, so no hook of any plugin
  (nor vllm-ascend's own capture) sees those tokens: refused at start-up instead of returning zero rows.
"""

from __future__ import annotations

import sys
from typing import Any

from vllm_ascend_routing.errors import UnsupportedVllmError

_PACKAGE = "vllm_ascend"


def splits_tokens(vllm_config: Any) -> bool:
    """Whether each TP rank's router sees only its shard of the step's tokens.

    vllm-ascend splits tokens across tensor-parallel ranks before routing with expert parallel (MC2 /
    all-to-all) and with sequence parallelism (flash-comm); the capture then all-gathers the ids over TP.
    """
    tp = int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)
    if tp == 1:
        return False
    return bool(getattr(vllm_config.parallel_config, "enable_expert_parallel", False)) or _sequence_parallel(
        vllm_config
    )


def _sequence_parallel(vllm_config: Any) -> bool:
    utils = sys.modules.get(f"{_PACKAGE}.utils")
    enable_sp = getattr(utils, "enable_sp", None)
    if callable(enable_sp):
        return bool(enable_sp(vllm_config))
    pass_config = getattr(getattr(vllm_config, "compilation_config", None), "pass_config", None)
    return bool(getattr(pass_config, "enable_sequence_parallelism", False))


def xlite_enabled(vllm_config: Any) -> bool:
    additional = getattr(vllm_config, "additional_config", None)
    if not isinstance(additional, dict):
        return False
    xlite = additional.get("xlite_graph_config") or {}
    return bool(xlite.get("enabled", False)) if isinstance(xlite, dict) else bool(getattr(xlite, "enabled", False))


def refuse_unsupported(vllm_config: Any) -> None:
    """Raise for vllm-ascend configurations whose routing no Python hook can see."""
    if xlite_enabled(vllm_config):
        raise UnsupportedVllmError(
            "vllm-ascend-routing: xlite graph mode (additional_config.xlite_graph_config.enabled) runs the model "
            "in xlite's native runtime, where no MoE routing reaches Python: routed experts would be zeros. "
            "Remove xlite_graph_config (vllm-ascend's ACL graph modes are supported) or unset VLLM_ASCEND_ROUTING."
        )
