# SPDX-License-Identifier: Apache-2.0
"""TEST-ONLY: a fault planted inside a running vLLM engine's front end, never used by the plugin.

``late_first_decode_row``: one request's first decode row carries the previous token's routing (the last prompt
token's), in every layer: the misfiled row a front end that files one row a token late at the prefill/decode
boundary would return (issue #51: the re-prefill oracle passed it as "2 near-ties"). It is planted where vLLM's
front end receives the rows (``OutputProcessor.process_outputs``, each ``EngineCoreOutput.routed_experts`` chunk,
before vLLM joins them): the engine's own rows, the engine's own request, in the middle of a real run, not a
finished array edited afterwards. Works wherever rows reach the front end in token order from token 0 (per-step
chunks from 0.22 on, 0.21.0's per-step chunks, or 0.20.x's whole array at the end).

Used in process by the e2e oracle (``tests/harness/oracle.py``), and by ``doctor --model`` through
``late_row_standin/`` on ``PYTHONPATH`` (the plant armed by ``PLANT_ENV``).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

OUTPUT_PROCESSOR = "vllm.v1.engine.output_processor"
# TEST-ONLY: set to N (>= 0) in a process with late_row_standin/ on PYTHONPATH: the N-th request (0-based, in the
# order their first decode rows reach the front end) gets the plant.
PLANT_ENV = "VLLM_ASCEND_ROUTING_TEST_PLANT_LATE_ROW"


@dataclass
class Planted:
    """Where the plant went: the request's id (as ``RequestOutput.request_id`` gives it) and row (= its prompt
    length)."""

    nth: int
    request_id: str | None = None
    row: int | None = None
    prompt_tokens: int | None = None
    seen: int = 0  # requests whose first decode row passed so far
    received: dict[str, int] = field(default_factory=dict)  # request id -> rows received so far
    last_row: dict[str, np.ndarray] = field(default_factory=dict)  # request id -> the last row received


def _plant(processor: Any, output: Any, planted: Planted) -> None:
    chunk = getattr(output, "routed_experts", None)
    state = processor.request_states.get(output.request_id)
    if chunk is None or state is None or planted.request_id is not None:
        return
    rid = str(output.request_id)
    start = planted.received.get(rid, 0)
    prompt = int(state.prompt_len)
    rows = np.asarray(chunk)
    planted.received[rid] = start + len(rows)
    if start <= prompt < start + len(rows) and prompt >= 1:  # this chunk holds the first decode row
        if planted.seen == planted.nth:
            previous = rows[prompt - 1 - start] if prompt - 1 >= start else planted.last_row[rid]
            changed = rows.copy()
            changed[prompt - start] = previous
            output.routed_experts = changed
            # the id RequestOutput carries (vLLM 0.20+ keep an internal id apart from the caller's)
            planted.request_id = str(getattr(state, "external_req_id", None) or rid)
            planted.row, planted.prompt_tokens = prompt, prompt
            print(f"TEST-ONLY PLANT: request {rid} row {prompt} <- row {prompt - 1}", file=sys.stderr, flush=True)
        planted.seen += 1
    if len(rows):
        planted.last_row[rid] = np.asarray(output.routed_experts)[-1].copy()


def install(nth: int) -> Planted:
    """Patch vLLM's ``OutputProcessor.process_outputs`` for good (a process of its own: doctor); the plant."""
    import importlib

    module = importlib.import_module(OUTPUT_PROCESSOR)
    planted = Planted(nth)
    original = module.OutputProcessor.process_outputs

    @functools.wraps(original)
    def process_outputs(self: Any, engine_core_outputs: Any, *args: Any, **kwargs: Any) -> Any:
        for output in engine_core_outputs:
            _plant(self, output, planted)
        return original(self, engine_core_outputs, *args, **kwargs)

    module.OutputProcessor.process_outputs = process_outputs
    return planted


@contextlib.contextmanager
def late_first_decode_row(nth: int = 0) -> Iterator[Planted]:
    """Within: the ``nth`` request to reach its first decode row gets the previous token's row there, once."""
    import importlib

    module = importlib.import_module(OUTPUT_PROCESSOR)
    original = module.OutputProcessor.process_outputs
    planted = install(nth)
    try:
        yield planted
    finally:
        module.OutputProcessor.process_outputs = original


def install_from_env() -> None:
    """The stand-in's entry: armed by ``PLANT_ENV`` when vLLM's output processor is imported."""
    value = os.environ.get(PLANT_ENV)
    if value is not None:
        install(int(value))
