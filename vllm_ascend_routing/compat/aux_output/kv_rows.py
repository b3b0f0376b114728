# SPDX-License-Identifier: Apache-2.0
"""Generation ``aux-output`` (vLLM 0.31+): rows of tokens a KV connector loaded, in the AuxOutput connector's
block store.

vLLM's AuxOutput worker connector keeps each computed block's rows in a store keyed by the KV block hash and
serves the rows of tokens a request did not compute (prefix-cache hits) from it; a block loaded through a KV
connector was never computed here, so its key is absent and vLLM fails the request's output. ``AuxRows`` hands
the carried rows to the worker with the step that schedules the load (an attribute of the step's AuxOutput
metadata) and, right after vLLM's ``begin_step`` registered the request's block hashes, stages them as vLLM
stages captured rows (``RoutedExpertsBuffer.capture``, then ``_publish_blocks``), so the store has them before the
request's first output is assembled. A finished request's prompt rows are the first chunk vLLM's scheduler took
for it (``take_output``), kept until the request finishes.

vLLM's own check refuses routed experts only with the Nixl, MoRIIO and Mooncake connectors; the plugin refuses
every connector it does not carry rows for at model load (``kv.refuse_uncovered``).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from vllm_ascend_routing import patching
from vllm_ascend_routing.compat.aux_output import requests
from vllm_ascend_routing.compat.interface import Generation
from vllm_ascend_routing.kv import RowLayout
from vllm_ascend_routing.patching import RELY, Patch

_AUX = (Generation.AUX_OUTPUT,)
_REMOVE = "vLLM carries aux outputs through KV connectors itself"
_SCHEDULER = "vllm.distributed.aux_output_connector.connector:AuxOutputSchedulerConnector"
_WORKER = "vllm.distributed.aux_output_connector.worker:AuxOutputWorkerConnector"
BEGIN_STEP = Patch(
    f"{_WORKER}.begin_step",
    "after vLLM registers a step's block hashes: carried rows of loaded blocks staged and published",
    _REMOVE,
    _AUX,
    ("self", "metadata"),
    required=False,
)
# Needed only once a KV connector is configured: optional in the manifest, required then
# (``kv.refuse_uncovered`` checks ``AuxRows.patches``).
_RELIED = (
    Patch(f"{_SCHEDULER}.take_output", "a request's first chunk holds its prompt rows (wrapped per instance)",
          _REMOVE, _AUX, ("self", "request", "output"), required=False, action=RELY),
    Patch(f"{_SCHEDULER}.build_connector_meta", "carried rows ride on the step's metadata (wrapped per instance)",
          _REMOVE, _AUX, ("self", "scheduler_output", "requests"), required=False, action=RELY),
    Patch(f"{_WORKER}._publish_blocks", "carried blocks published as vLLM publishes captured ones",
          _REMOVE, _AUX, ("self", "batches"), required=False, action=RELY),
    Patch("vllm.distributed.aux_output_connector.routed_experts:RoutedExpertsBuffer.capture",
          "carried rows staged as vLLM stages captured ones", _REMOVE, _AUX,
          ("self", "request_id", "token_start", "rows"), required=False, action=RELY),
)  # fmt: skip
CARRYING = (BEGIN_STEP, *_RELIED)
# The manifest's rows: one per target. The per-request options replace take_output and build_connector_meta on
# every engine (compat/requests.py, required): their rows are those targets' rows.
_OPTIONS = {patch.target for patch in requests.PATCHES}
PATCHES = tuple(patch for patch in CARRYING if patch.target not in _OPTIONS)
_CARRIED = "_vllm_ascend_routing_carried"  # metadata attribute: {request id: (first token, rows)}


def _staging_carried(begin_step: Any) -> Any:
    """vLLM's ``begin_step``, then the rows carried for this step's loads staged and published under the
    request's block keys, as if they had been captured here."""

    @functools.wraps(begin_step)
    def wrapper(self: Any, metadata: Any, *args: Any, **kwargs: Any) -> Any:
        result = begin_step(self, metadata, *args, **kwargs)
        carried: dict[str, tuple[int, np.ndarray]] | None = getattr(metadata, _CARRIED, None)
        if carried and self._buffer is not None:  # only the first TP rank owns the store
            with self._lock:
                for request_id, (start, rows) in carried.items():
                    state = self._requests[request_id]
                    completed = self._buffer.capture(request_id, start, rows)
                    state.capture_cursor = start + len(rows)  # the step's capture continues after them
                    self._publish_blocks([(state, completed)])
        return result

    return wrapper


class AuxRows:
    """``kv.KvRows`` of this generation."""

    patches = CARRYING  # all required once a KV connector is configured

    def install(self) -> None:
        patching.replace(BEGIN_STEP, _staging_carried)

    def attach(self, scheduler: Any) -> _BlockStore | None:
        aux = getattr(scheduler, "aux_output_connector", None)
        return None if aux is None else _BlockStore(aux, scheduler.vllm_config)


class _BlockStore:
    """One scheduler's side of the AuxOutput store (``kv.SchedulerRows``)."""

    def __init__(self, aux: Any, vllm_config: Any) -> None:
        model_config = vllm_config.model_config
        dtype = "uint8" if int(model_config.get_num_experts()) <= 256 else "uint16"  # the capturer's narrowing
        self.layout = RowLayout(
            int(model_config.get_total_num_hidden_layers()), int(model_config.get_num_experts_per_tok()), dtype
        )
        self.prompts: dict[str, np.ndarray] = {}  # request id -> its prompt rows, from its first chunk
        # request id -> (request, first token, rows) for the metadata of the step that schedules it
        self.carried: dict[str, tuple[Any, int, np.ndarray]] = {}
        # Every request's prompt rows (opted out, or asking for rows from a later token): they travel with its KV.
        requests.keep_prompt_rows(aux)
        patching.wrap(aux, "take_output", self._keeping_prompt, around=True)
        patching.wrap(aux, "build_connector_meta", self._with_carried, around=True)

    def _keeping_prompt(self, take_output: Any) -> Any:
        def keeping_prompt(request: Any, output: Any, *args: Any, **kwargs: Any) -> Any:
            rows = take_output(request, output, *args, **kwargs)
            entry = None if output is None else output.get(request.request_id)
            num_prompt = int(request.num_prompt_tokens)
            if rows is not None and entry is not None and int(entry.token_start) == 0 and len(rows) >= num_prompt:
                self.prompts.setdefault(request.request_id, np.array(rows[:num_prompt]))
            return rows if entry is None else requests.from_first_token(request, int(entry.token_start), rows)

        return keeping_prompt

    def _with_carried(self, build_connector_meta: Any) -> Any:
        def with_carried(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
            metadata = build_connector_meta(scheduler_output, *args, **kwargs)
            scheduled = scheduler_output.num_scheduled_tokens
            ready = {}
            for request_id in list(self.carried.keys() & scheduled.keys()):
                request, start, rows = self.carried.pop(request_id)
                # This step computes from the request's computed tokens on (vLLM advances them after this call): a
                # load whose KV came asynchronously (NIXL) has its last prompt token computed again here, and a
                # load that failed part-way its invalid tail; their rows are this step's own, not carried ones.
                upto = int(request.num_computed_tokens) - start
                if upto > 0:
                    ready[request_id] = (start, rows[:upto])
            if ready:
                setattr(metadata, _CARRIED, ready)
            return metadata

        return with_carried

    def inject(self, request: Any, blocks: Any, start: int, rows: np.ndarray) -> None:
        self.carried[request.request_id] = (request, start, rows)

    def finished_rows(self, request: Any, block_ids: Any) -> np.ndarray | None:
        """The prompt's only: the generated tokens' reach the scheduler a chunk per output, and keeping them per
        request would hold every running request's rows twice."""
        return self.prompts.get(request.request_id)

    def forget(self, request_id: str) -> None:
        self.prompts.pop(request_id, None)
        self.carried.pop(request_id, None)
