# SPDX-License-Identifier: Apache-2.0
"""What the plugin adds to vLLM's routed-experts output for RL frameworks (vLLM 0.22+; see docs/output.md):

  * per-request options (``options``): opt out (``return_routed_experts``: false), omit rows the caller holds
    (``routed_experts_omit``: "cached" or a token), checked in the front end (``frontend``) and acted on in the
    engine core (``engine``, plus the generation's own hooks under ``compat/``);
  * a provenance record beside every array (``provenance``): where its rows start, how many this engine computed,
    served from the prefix cache or loaded, the contract, and the weight versions (``weights``, counted in the
    worker) its rows were written under;
  * over HTTP (``serving``): the record in each choice, and the rows in the final chunk of streamed choices.

Three features of the registry (``features.FEATURES``): this package (per-request options and the provenance record:
``frontend`` and ``engine``), ``weights`` and ``serving``. Each installs what the adapter's capabilities allow
(``per_request_output``); nothing here asks which vLLM release is installed.
"""

from __future__ import annotations

from vllm_ascend_routing.context import InstallContext
from vllm_ascend_routing.output import engine, frontend

PATCHES = (*frontend.PATCHES, *engine.PATCHES)  # the record rows need per_request_output (Patch.needs)
NEEDS: tuple[str, ...] = ()  # the options check runs on every generation (refusing options where unserved)


def install(ctx: InstallContext) -> None:
    """Patch this process (idempotent; each process patches what it may run): the options check in the front end on
    every generation; where the transport sends rows per request, the engine core's side and the records."""
    adapter = ctx.adapter
    frontend.install(adapter, ctx.vllm)
    if adapter.per_request_output:
        engine.install(adapter.routed_experts_requested)
        adapter.install_request_options(engine.SELECTION)
