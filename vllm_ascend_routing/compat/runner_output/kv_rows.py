# SPDX-License-Identifier: Apache-2.0
"""Generation ``runner-output`` (vLLM 0.22-0.30): rows of tokens a KV connector loaded, in the scheduler's
slot buffer.

vLLM's ``RoutedExpertsManager`` keeps one row per KV slot (``routed_experts_by_slot``) and reads a request's
prompt rows from its blocks' slots when its prefill completes. A loaded token's slot was never written for it.
``SlotRows`` writes the carried rows there when vLLM allocates the blocks it loads into, and again after each
step's ``store_batch`` until the request's prompt rows were read (a step still in flight for a request that held
those slots before cannot overwrite them), unless it was preempted meanwhile (its blocks may be another's then).
A finished request's prompt rows are read from the same slots.

vLLM 0.22-0.30 refuse routed experts with any KV connector in ``VllmConfig.__post_init__``. That check alone is
lifted (``compat/_lift.py``), for connectors the plugin carries rows for: the one read of
``KVTransferConfig.is_kv_transfer_instance`` at that check (found in the method's bytecode, next to vLLM's refusal
message) answers False; for any other connector the plugin's own refusal, naming the connector, is raised there
instead. Every other reader of the property sees vLLM's answer.

SCAFFOLDING: remove with ``runner_output`` (the lowest supported vLLM is 0.31 or newer).
"""

from __future__ import annotations

import functools
from types import CodeType
from typing import Any

import numpy as np

from vllm_ascend_routing import kv, patching
from vllm_ascend_routing._logging import get_logger
from vllm_ascend_routing.compat import _lift
from vllm_ascend_routing.compat._lift import Site
from vllm_ascend_routing.compat.interface import Generation, UnsupportedVllmError
from vllm_ascend_routing.kv import RowLayout
from vllm_ascend_routing.patching import RELY, Patch

logger = get_logger(__name__)

_RUNNER = (Generation.RUNNER_OUTPUT,)
_REMOVE = "the lowest supported vLLM is 0.31.0 or newer"
_MANAGER = "vllm.model_executor.layers.fused_moe.routed_experts_capturer:RoutedExpertsManager"
IS_KV_TRANSFER_INSTANCE = Patch(
    "vllm.config.kv_transfer:KVTransferConfig.is_kv_transfer_instance",
    "read at vLLM's refusal of routed experts with KV connectors: False there for covered connectors",
    _REMOVE,
    _RUNNER,
)
# Relied on only once a KV connector is configured: optional in the manifest (an engine without one never needs
# them), required then (``kv.refuse_uncovered`` checks ``SlotRows.patches``).
_RELIED = (
    Patch(
        "vllm.config.vllm:VllmConfig.__post_init__",
        "holds vLLM's refusal of routed experts with KV connectors (its bytecode locates the one read lifted)",
        _REMOVE,
        _RUNNER,
        ("self",),
        required=False,
        action=RELY,
    ),
    Patch(f"{_MANAGER}.store_batch", "carried rows are written again after each step's rows (per instance)",
          _REMOVE, _RUNNER, ("self", "data", "slot_mapping"), required=False, action=RELY),
    Patch(f"{_MANAGER}.get", "a finished request's prompt rows, read from its slots", _REMOVE, _RUNNER,
          ("self", "block_ids", "num_tokens"), required=False, action=RELY),
    Patch("vllm.v1.core.kv_cache_manager:KVCacheBlocks.get_block_ids", "the blocks vLLM loads into, per KV group",
          _REMOVE, _RUNNER, ("self",), required=False, action=RELY),
)  # fmt: skip
PATCHES = (IS_KV_TRANSFER_INSTANCE, *_RELIED)

# vLLM's refusal message, as its config check raises it (located in the bytecode, never matched at run time).
_REFUSAL_TEXT = ("--enable-return-routed-experts", "KV connectors")
_PROPERTY = "is_kv_transfer_instance"


@functools.cache
def refusal_site() -> Site | None:
    """The read of ``is_kv_transfer_instance`` that guards vLLM's refusal of routed experts with KV connectors in
    ``VllmConfig.__post_init__``; ``None`` where the method has no such refusal."""
    from vllm.config.vllm import VllmConfig

    code = VllmConfig.__post_init__.__code__
    line = guarding_line(code)
    return None if line is None else Site(code, line)


def guarding_line(code: CodeType) -> int | None:
    """The line of the last read of ``is_kv_transfer_instance`` before the refusal message's constant in ``code``."""
    return _lift.guarding_line(code, _PROPERTY, _REFUSAL_TEXT)


def _served(checked: Any, kv_config: Any, value: bool) -> Any:
    """At vLLM's refusal, for a KV connector (``value`` True): False for a connector the plugin serves, the
    plugin's own refusal (naming the connector) for any other."""
    if not value:
        return _lift.NOT_LIFTED
    if not kv.serves(kv_config):
        raise UnsupportedVllmError(kv.refusal(kv_config, Generation.RUNNER_OUTPUT.value))
    logger.info(
        "vLLM's refusal of routed experts with KV connectors lifted for %s: the rows of loaded tokens are carried "
        "with their KV or held here",
        kv.connector_name(kv_config),
    )
    return False


def _lifting(current: property) -> property:
    """``is_kv_transfer_instance`` as vLLM computes it, except at vLLM's refusal of routed experts with KV
    connectors (``_served``)."""
    lifted: property = _lift.lifted(current, refusal_site, _served)
    return lifted


class SlotRows:
    """``kv.KvRows`` of this generation."""

    patches = PATCHES

    def install(self) -> None:
        patching.replace(IS_KV_TRANSFER_INSTANCE, _lifting)

    def attach(self, scheduler: Any) -> _SlotStore | None:
        manager = getattr(scheduler, "routed_experts_mgr", None)
        if manager is None or not getattr(scheduler, "enable_return_routed_experts", False):
            return None
        return _SlotStore(manager)


class _SlotStore:
    """One scheduler's slot buffer (``kv.SchedulerRows``)."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        buffer: np.ndarray = manager.routed_experts_by_slot
        self.layout = RowLayout(int(buffer.shape[1]), int(buffer.shape[2]), buffer.dtype.name)
        # request id -> (request, end of its loaded tokens, their slots, their rows): written again after each step
        # until its prompt rows were read.
        self.pending: dict[str, tuple[Any, int, np.ndarray, np.ndarray]] = {}
        patching.wrap(manager, "store_batch", self._then_carried)

    def _then_carried(self, store_batch: Any) -> Any:
        def then_carried(data: np.ndarray, slot_mapping: np.ndarray, *args: Any, **kwargs: Any) -> Any:
            result = store_batch(data, slot_mapping, *args, **kwargs)
            for request_id, (request, end, slots, rows) in list(self.pending.items()):
                # Its prompt rows were read, or it was preempted (its blocks may be another request's now).
                if int(request.num_output_tokens) > 0 or int(request.num_computed_tokens) < end:
                    del self.pending[request_id]
                else:
                    self.manager.routed_experts_by_slot[slots] = rows
            return result

        return then_carried

    def slots(self, block_ids: list[int], start: int, count: int) -> np.ndarray:
        block_size = int(self.manager.block_size)
        positions = np.arange(start, start + count)
        return np.asarray(block_ids, dtype=np.int64)[positions // block_size] * block_size + positions % block_size

    def inject(self, request: Any, blocks: Any, start: int, rows: np.ndarray) -> None:
        block_ids = list(blocks.get_block_ids()[self.manager.attn_gid])
        slots = self.slots(block_ids, start, len(rows))
        self.manager.routed_experts_by_slot[slots] = rows
        self.pending[request.request_id] = (request, start + len(rows), slots, rows)

    def finished_rows(self, request: Any, block_ids: Any) -> np.ndarray | None:
        """Every token's but the last (whose KV no forward computed): the prompt's and the generated tokens', as
        vLLM reads them for the request's output. The step that computed the last of them has ended (it sampled
        the last token), also under async scheduling."""
        ids = block_ids[self.manager.attn_gid] if isinstance(block_ids, tuple) else block_ids
        count = max(int(request.num_prompt_tokens), int(request.num_tokens) - 1)
        if len(ids) * int(self.manager.block_size) < count:
            return None
        return np.asarray(self.manager.get(list(ids), count))

    def forget(self, request_id: str) -> None:
        self.pending.pop(request_id, None)
