# SPDX-License-Identifier: Apache-2.0
"""The re-prefill oracle's per-token analysis across MoE layers (NumPy only): one misfiled row, seen.

A numeric near-tie is a per-layer event: two router logits of one token in one layer closer than the dtype's
rounding, flipped by another batch shape. A row filed under the wrong token or request (one request's first
decode row carrying the previous token's routing, a slot read one step late) is a per-token event: that token's
rows differ in every MoE layer at once, each the same other token's. The per-layer verdicts
(``consistency``) need at least ``MIN_FAULT_ROWS`` rows of one fault in a layer, so one such token passed as
"near-ties"; this analysis names it.

The rule. Every row the two passes disagree on is traced per layer (``consistency``: ``late`` = the same
request's previous token's row, ``early`` = its next token's, ``other`` = another request's row at the same
position, ``stale`` = the whole token's routing is another token's, ``untraced``). For each token, count the MoE
layers where it disagrees (``any``), and the layers where it disagrees traced to one origin (``late``,
``early``, ``stale``; ``other``: to one source request). If disagreements were independent per-layer events,
that count would follow a Poisson-binomial law with the layers' rates as measured in this very run (for
``any``: each layer's share of rows that disagree; for a kind: each layer's share of rows traced to it; the
rates include the token under test, which only makes the rule more lenient). A token is a fault when the
probability of a count at least as high, times the number of tests made (tokens x kinds), is below
``FALSE_ALARM`` (Bonferroni): the run then has at most that chance of one false alarm from independent near-ties.
``threshold`` gives the smallest such count per kind, reported with the verdict.

Rates measured on one run make the rule scale with the dtype and the hardware: float32 on a CPU (near-ties
almost never) names a token disagreeing in 2 of 2 MoE layers; bfloat16 at 5% per layer needs more layers, or the
disagreements traced to one origin (chance traces are rare). Near-ties are not quite independent across the
layers of one token (a flip changes that token's hidden state for the layers after it): the ``any`` count
allows ``CASCADE_LAYERS`` extra layers for that, measured by ``benchmarks/oracle_calibration.py``
(docs/preflight.md, "Calibrating the oracle"). Traced counts need no allowance: a cascade's flips land on
another token's row only by chance, and that chance is in the traced rates.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

# Row codes, per (token, MoE layer): how the generation's row relates to the re-prefill's.
AGREE, LATE, EARLY, OTHER, STALE, UNTRACED, ZERO = range(7)
CODE_NAMES = {LATE: "late", EARLY: "early", OTHER: "other", STALE: "stale", UNTRACED: "untraced", ZERO: "zero"}
KINDS = ("late", "early", "other", "stale")  # traced kinds, tested each; "any" (every disagreement) besides
DESCRIBE = {
    "late": "the same request's previous token's rows",
    "early": "the same request's next token's rows",
    "other": "request {source}'s rows at the same position",
    "stale": "another token's whole routing (a step's buffer read at the wrong time)",
    "any": "rows no single origin explains",
}
# The chance, per run, of one false alarm from independent near-ties (Bonferroni over tokens and kinds).
FALSE_ALARM = 0.01
MIN_TOKEN_LAYERS = 2  # one layer disagreeing is a per-layer event, never a token fault
# Extra layers the "any" count allows beyond the independent tail: a near-tie flip changes that token's hidden
# state, so the layers after it flip more often than their rates say (benchmarks/oracle_calibration.py measures
# it: docs/preflight.md).
CASCADE_LAYERS = 0


@dataclass
class TokenFault:
    """One token whose rows disagree in more MoE layers than independent near-ties explain."""

    request: str
    row: int  # the token's position (row ``row`` of both arrays)
    kind: str  # late, early, other, stale, or any (no single origin)
    layers: list[int]  # the MoE layers where it disagrees (traced to ``kind`` where it is one)
    disagreeing: int  # MoE layers where it disagrees at all
    moe_layers: int
    probability: float  # of a count this high from independent near-ties, before the Bonferroni factor
    prompt_tokens: int | None = None  # the request's prompt length, where known (to say prefill or decode)
    source: str | None = None  # kind "other": the request whose rows these are

    def where(self) -> str:
        if self.prompt_tokens is None:
            return f"request {self.request} token {self.row}"
        if self.row < self.prompt_tokens:
            return f"request {self.request} token {self.row} (prompt token {self.row} of {self.prompt_tokens})"
        step = self.row - self.prompt_tokens + 1
        first = ", the first decode row" if step == 1 else ""
        return f"request {self.request} token {self.row} (decode step {step}{first})"

    def describe(self) -> str:
        origin = DESCRIBE[self.kind].format(source=self.source)
        return (
            f"{self.where()}: {self.kind}, {origin} in {len(self.layers)}/{self.moe_layers} MoE layers "
            f"(disagrees in {self.disagreeing}; p = {self.probability:.1e} from independent near-ties)"
        )

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "text": self.describe()}


def tail(rates: np.ndarray, count: int) -> float:
    """P(X >= count) for X the number of independent events of probabilities ``rates`` (Poisson-binomial)."""
    if count <= 0:
        return 1.0
    if count > len(rates):
        return 0.0
    law = np.zeros(len(rates) + 1)
    law[0] = 1.0
    for p in np.clip(np.asarray(rates, dtype=np.float64), 0.0, 1.0):
        law[1:] = law[1:] * (1.0 - p) + law[:-1] * p
        law[0] *= 1.0 - p
    return float(min(1.0, law[count:].sum()))


def threshold(rates: np.ndarray, tests: int, allowance: int = 0, alpha: float = FALSE_ALARM) -> int | None:
    """The smallest count of layers that is a fault: ``tail(rates, count - allowance) * tests < alpha``, and at
    least ``MIN_TOKEN_LAYERS``; ``None`` where even every layer is not enough (rates too high)."""
    for count in range(MIN_TOKEN_LAYERS, len(rates) + 1):
        if tail(rates, count - allowance) * max(tests, 1) < alpha:
            return count
    return None


def find(
    requests: list[str],
    codes: list[np.ndarray],
    sources: list[np.ndarray],
    moe_layers: list[int],
    prompt_tokens: list[int | None] | None = None,
    cascade_layers: int = CASCADE_LAYERS,
) -> tuple[list[TokenFault], dict[str, int | None]]:
    """Tokens whose rows disagree in more MoE layers than independent near-ties explain, and each kind's
    threshold (layers). ``codes[r]``: ``[rows, len(moe_layers)]`` row codes of request ``r``; ``sources[r]``: for
    ``OTHER`` rows, the index of the request they came from (-1 elsewhere)."""
    if not codes or len(moe_layers) < MIN_TOKEN_LAYERS:
        return [], {}
    every = np.concatenate(codes)  # [tokens, layers]
    tokens = len(every)
    tests = tokens * (1 + len(KINDS))
    disagree = (every != AGREE) & (every != ZERO)
    rates = {"any": disagree.mean(axis=0)}
    for code, kind in ((LATE, "late"), (EARLY, "early"), (OTHER, "other"), (STALE, "stale")):
        rates[kind] = (every == code).mean(axis=0)
    thresholds = {"any": threshold(rates["any"], tests, cascade_layers)}
    thresholds.update({kind: threshold(rates[kind], tests) for kind in KINDS})
    faults: list[TokenFault] = []
    prompts = prompt_tokens or [None] * len(codes)
    for r, (request_codes, request_sources) in enumerate(zip(codes, sources, strict=True)):
        wrong = (request_codes != AGREE) & (request_codes != ZERO)
        for row in map(int, np.flatnonzero(wrong.sum(axis=1) >= MIN_TOKEN_LAYERS)):
            fault = _judge(request_codes[row], request_sources[row], rates, tests, moe_layers, cascade_layers)
            if fault is not None:
                kind, layers, probability, source = fault
                faults.append(
                    TokenFault(
                        requests[r],
                        row,
                        kind,
                        layers,
                        int(wrong[row].sum()),
                        len(moe_layers),
                        probability,
                        prompts[r],
                        None if source is None else requests[source],
                    )
                )
    return faults, thresholds


def _judge(
    codes: np.ndarray,
    sources: np.ndarray,
    rates: dict[str, np.ndarray],
    tests: int,
    moe_layers: list[int],
    cascade_layers: int,
) -> tuple[str, list[int], float, int | None] | None:
    """The most telling explanation of one token's disagreements, if it is a fault: ``(kind, layers, p, source)``."""
    candidates: list[tuple[float, str, np.ndarray, int | None]] = []
    for code, kind in ((LATE, "late"), (EARLY, "early"), (STALE, "stale")):
        hit = codes == code
        if hit.sum() >= MIN_TOKEN_LAYERS:
            candidates.append((tail(rates[kind], int(hit.sum())), kind, hit, None))
    other = codes == OTHER
    if other.sum() >= MIN_TOKEN_LAYERS:
        values, counts = np.unique(sources[other], return_counts=True)
        source = int(values[np.argmax(counts)])
        hit = other & (sources == source)
        candidates.append((tail(rates["other"], int(hit.sum())), "other", hit, source))
    disagree = (codes != AGREE) & (codes != ZERO)
    candidates.append((tail(rates["any"], int(disagree.sum()) - cascade_layers), "any", disagree, None))
    probability, kind, hit, found = min(candidates, key=lambda item: item[0])
    if int(hit.sum()) < MIN_TOKEN_LAYERS or probability * tests >= FALSE_ALARM or math.isnan(probability):
        return None
    return kind, [moe_layers[j] for j in map(int, np.flatnonzero(hit))], probability, found
