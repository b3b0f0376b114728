# SPDX-License-Identifier: Apache-2.0
"""The plugin's features, in install order: the one list the manifest (which rows are verified), the start-up check
(``manifest.verify``) and the installation (``integration.install``) all read.

Each feature is a module (or package) of this project with the same small surface:

  * ``PATCHES``: every symbol of vLLM or vllm-ascend it replaces or relies on (``patching.Patch`` rows; a row may
    need an adapter capability of its own, ``Patch.needs``);
  * ``NEEDS``: the adapter capabilities it needs (``context.satisfied``): on a generation whose adapter lacks one, its
    rows are not verified and it is not installed;
  * ``install(ctx)``: patch this process (idempotent), with the adapter in ``ctx`` (``context.InstallContext``).

The generation's own rows (its runner hooks, its patches) are the adapter's (``compat.Adapter.rows``); the capture
feature installs them. Every way into vLLM goes through ``patching.wrap``, from one of these.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

from vllm_ascend_routing import _cpu_compat, backends, kv, output, peers, runner_mixin, store, validate
from vllm_ascend_routing.context import InstallContext, satisfied
from vllm_ascend_routing.output import serving, weights
from vllm_ascend_routing.patching import Patch


@dataclass(frozen=True)
class Feature:
    """One feature: its name (doctor, the start-up log) and its module."""

    name: str
    module: ModuleType

    @property
    def patches(self) -> tuple[Patch, ...]:
        rows: tuple[Patch, ...] = self.module.PATCHES
        return rows

    @property
    def needs(self) -> tuple[str, ...]:
        needs: tuple[str, ...] = self.module.NEEDS
        return needs

    def serves(self, adapter: Any) -> bool:
        """Whether ``adapter`` (an adapter or its class) has every capability this feature needs."""
        return satisfied(adapter, self.needs)

    def install(self, ctx: InstallContext) -> None:
        self.module.install(ctx)


FEATURES: tuple[Feature, ...] = (
    # the runner hooks (bind at load, drive the generation's transport, the always-on check, sleep mode's buffers)
    # and the generation's own patches
    Feature("capture", runner_mixin),
    Feature("backends", backends),  # where each MoE layer's routing is intercepted (bound at model load)
    Feature("row store", store),  # VLLM_ASCEND_ROUTING_STORE: refused at start-up where unserved or unreachable
    Feature("KV rows", kv),  # rows travel with the KV a connector moves
    Feature("validation", validate),  # VLLM_ASCEND_ROUTING_VALIDATE: every returned array checked
    Feature("request options and provenance", output),  # return_routed_experts, routed_experts_omit, the record
    Feature("weight versions", weights),  # each step's weight version, for the record
    Feature("HTTP serving", serving),  # the record (and streamed rows) over HTTP
    Feature("start-up check", peers),  # every worker runs the plugin, alike
    Feature("CPU compat fix", _cpu_compat),  # vLLM's CPU MoE where it would crash (0.20-0.27)
)


def rows_of(feature: Feature, adapter: Any, platform: str) -> list[Patch]:
    """``feature``'s rows that apply on ``adapter``'s generation (an adapter or its class) and ``platform``."""
    if not feature.serves(adapter):
        return []
    return [
        patch
        for patch in feature.patches
        if adapter.generation in patch.generations
        and patch.platform in ("any", platform)
        and (not patch.needs or satisfied(adapter, (patch.needs,)))
    ]
