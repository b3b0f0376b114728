# SPDX-License-Identifier: Apache-2.0
"""What the plugin adds to vLLM's routed-experts output for RL frameworks (vLLM 0.22+; see docs/output.md):

  * per-request options (``options``): opt out (``return_routed_experts``: false), omit rows the caller holds
    (``routed_experts_omit``: "cached" or a token), checked in the front end (``frontend``) and acted on in the
    engine core (``engine``, plus the generation's own hooks under ``compat/``);
  * a provenance record beside every array (``provenance``): where its rows start, how many this engine computed,
    served from the prefix cache or loaded, the contract, and the weight versions (``weights``, counted in the
    worker) its rows were written under;
  * over HTTP (``serving``): the record in each choice, and the rows in the final chunk of streamed choices.

``install`` applies what the detected generation supports; nothing here asks which vLLM release is installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from vllm_ascend_routing.output import engine, frontend, serving, weights

if TYPE_CHECKING:
    from vllm_ascend_routing.compat.base import CaptureAPI


def install(api: CaptureAPI, vllm: str) -> None:
    """Patch this process for ``api``'s generation (idempotent; each process patches what it may run)."""
    frontend.install(api.generation, vllm)
    if api.generation in engine.UPDATE_FROM_OUTPUT.generations:
        weights.install()
        engine.install()
        api.install_request_options(engine.SELECTION)
        serving.install()
