# SPDX-License-Identifier: Apache-2.0
"""Generation ``runner-output`` (vLLM 0.22-0.30): the per-runner capturer handed the plugin's buffer (``adapter``);
rows of tokens a KV connector loaded, in the scheduler's slot buffer (``kv_rows``).

SCAFFOLDING: delete this folder (and its release-table row) when the lowest supported vLLM is 0.31 or newer."""

from vllm_ascend_routing.compat.runner_output.adapter import RunnerOutputAdapter

__all__ = ["RunnerOutputAdapter"]
