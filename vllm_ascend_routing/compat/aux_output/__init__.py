# SPDX-License-Identifier: Apache-2.0
"""Generation ``aux-output`` (vLLM 0.31+): vLLM's AuxOutput connector, driven where the runner has no code for it
(``adapter``); the per-request options on its scheduler side (``requests``); rows of tokens a KV connector loaded,
in its block store (``kv_rows``)."""

from vllm_ascend_routing.compat.aux_output.adapter import AuxOutputAdapter

__all__ = ["AuxOutputAdapter"]
