# SPDX-License-Identifier: Apache-2.0
"""The KV feature: routing rows of tokens whose KV a connector loaded (P/D disaggregation, prefix reuse across
instances, offload tiers) are carried with that KV, or those tokens are computed here. Never zeros, never another
request's rows.

vLLM keeps one routing row per KV slot (0.22-0.30) or per computed block (0.31+). A token whose KV came through a
connector was never computed on this instance: its slot holds zeros, or the rows of whichever request used the slot
before. Its parts:

  * ``policy``: which connectors are served, and the refusal (naming the connector) of the others;
  * ``carriers``: where rows travel with the KV a connector moves (beside ``ExampleConnector``'s files, in NIXL's
    ``kv_transfer_params``, or held in the scheduler for KV this instance computed);
  * ``named``: vLLM's ``MooncakeConnector`` (P/D by transfer id): rows through the row store by a derived name;
  * ``shared``: a cache service several instances share (``MooncakeStoreConnector``, vllm-ascend's KV pool): each
    block's rows in the row store by model, layout, cache salt (the weight version) and token chain;
  * ``stores``: what a generation provides (its scheduler-side row store; ``Adapter.kv_rows``, under ``compat/``);
  * ``follower``: the scheduler's connector calls followed, per request; this process's counts and first reports.

The feature surface the registry reads (``features.FEATURES``): ``PATCHES``, ``NEEDS`` and ``install(ctx)``.
"""

from __future__ import annotations

from vllm_ascend_routing.context import InstallContext
from vllm_ascend_routing.kv import carriers, follower
from vllm_ascend_routing.kv.carriers import Missing, RowLayout
from vllm_ascend_routing.kv.follower import KvRowsStats, first_reports, held_rows, loaded_rows, loaded_span, stats
from vllm_ascend_routing.kv.policy import (
    DOCS,
    REFUSED,
    connector_name,
    holds_rows,
    lifts,
    refusal,
    refuse_uncovered,
    serves,
)
from vllm_ascend_routing.kv.stores import KvRows, SchedulerRows

__all__ = [
    "DOCS",
    "NEEDS",
    "PATCHES",
    "REFUSED",
    "RELIED",
    "KvRows",
    "KvRowsStats",
    "Missing",
    "RowLayout",
    "SchedulerRows",
    "connector_name",
    "first_reports",
    "held_rows",
    "holds_rows",
    "install",
    "lifts",
    "loaded_rows",
    "loaded_span",
    "refusal",
    "refuse_uncovered",
    "serves",
    "stats",
]

# What the follower and the carriers rely on once a connector is configured (optional in the manifest, required then:
# ``refuse_uncovered``).
RELIED = (*follower.connector_patches(), *carriers.patches())
PATCHES = (follower.SCHEDULER_INIT, *RELIED)
NEEDS = ("kv_rows",)  # generations with a store for loaded rows; on the others every connector is refused at load


def install(ctx: InstallContext) -> None:
    follower.install(ctx.adapter.kv_rows)
