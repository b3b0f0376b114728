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
layers of one token, though (a flip changes that token's hidden state for the layers after it; neighbouring tokens
route alike, so a flip may land on the previous token's routing): a token is also named only where its rows are
the origin's in at least ``WHOLE_TOKEN`` of the layers where that origin's routing differs from its own (for
``any``: of all MoE layers), as a misfiled row's are in all of them. ``benchmarks/oracle_calibration.py``
measures both on clean engines (docs/preflight.md, "Calibrating the oracle").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

# Row codes, per (token, MoE layer): how the generation's row relates to the re-prefill's.
AGREE, LATE, EARLY, OTHER, STALE, UNTRACED, ZERO = range(7)
CODE_NAMES = {LATE: "late", EARLY: "early", OTHER: "other", STALE: "stale", UNTRACED: "untraced", ZERO: "zero"}
KINDS = ("late", "early", "other", "stale")  # traced kinds, tested each; "any" (every disagreement) besides
TRACED = (LATE, EARLY, OTHER, STALE)
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
# A misfiled row is its origin's in every layer where the origin's routing differs from the token's own; near-ties
# are not: a flip lands on a neighbour's routing in a layer or two by chance (neighbouring tokens route alike), and
# carries on into a few of the layers after it (it changed that token's hidden state). A token is named only where
# its rows are the origin's in at least this share of the layers where that origin differs (for "any": of all MoE
# layers), measured by benchmarks/oracle_calibration.py (docs/preflight.md).
WHOLE_TOKEN = 0.5


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
    differing: int | None = None  # MoE layers where the origin's rows differ from the token's own (where it shows)
    flip: bool = True  # False: named as no near-tie flip (a row more than one expert from its own), not by the tail

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
        shows = (
            f" of the {self.differing} where they differ"
            if self.differing is not None and self.differing != self.moe_layers
            else ""
        )
        why = (
            f"p = {self.probability:.1e} from independent near-ties"
            if self.flip
            else "more than one expert from its own routing: no near-tie flip"
        )
        return (
            f"{self.where()}: {self.kind}, {origin} in {len(self.layers)}/{self.moe_layers} MoE layers{shows} "
            f"(disagrees in {self.disagreeing}; {why})"
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


def threshold(rates: np.ndarray, tests: int, alpha: float = FALSE_ALARM) -> int | None:
    """The smallest count of layers independent near-ties do not explain: ``tail(rates, count) * tests < alpha``,
    and at least ``MIN_TOKEN_LAYERS``; ``None`` where even every layer is not enough (rates too high)."""
    for count in range(MIN_TOKEN_LAYERS, len(rates) + 1):
        if tail(rates, count) * max(tests, 1) < alpha:
            return count
    return None


def find(
    requests: list[str],
    codes: list[np.ndarray],
    sources: list[np.ndarray],
    moe_layers: list[int],
    prompt_tokens: list[int | None] | None = None,
    refs: list[np.ndarray] | None = None,
    whole_token: float = WHOLE_TOKEN,
    single: list[np.ndarray] | None = None,
) -> tuple[list[TokenFault], dict[str, int | None]]:
    """Tokens whose rows disagree in more MoE layers than independent near-ties explain, and each kind's
    threshold (layers). ``codes[r]``: ``[rows, len(moe_layers)]`` row codes of request ``r``; ``sources[r]``: for
    ``OTHER`` rows, the index of the request they came from (-1 elsewhere); ``refs[r]``: its re-prefill rows of the
    MoE layers, top-k sorted (``[rows, len(moe_layers), top_k]``), to tell in how many layers an origin's rows
    differ from the token's own (``whole_token``; without them every layer counts); ``single[r]``: which wrong rows
    differ from the re-prefill's by one expert only (what a near-tie flip does). A token whose rows are one origin's
    in every layer where that origin differs, one of them more than one expert from its own, is named too, in one
    layer (no flip does that)."""
    if not codes or len(moe_layers) < MIN_TOKEN_LAYERS:
        return [], {}
    every = np.concatenate(codes)  # [tokens, layers]
    tokens = len(every)
    tests = tokens * (1 + len(KINDS))
    disagree = (every != AGREE) & (every != ZERO)
    rates = {"any": disagree.mean(axis=0)}
    for code, kind in ((LATE, "late"), (EARLY, "early"), (OTHER, "other"), (STALE, "stale")):
        rates[kind] = (every == code).mean(axis=0)
    thresholds = {kind: threshold(rates[kind], tests) for kind in ("any", *KINDS)}
    faults: list[TokenFault] = []
    prompts = prompt_tokens or [None] * len(codes)
    for r, (request_codes, request_sources) in enumerate(zip(codes, sources, strict=True)):
        wrong = (request_codes != AGREE) & (request_codes != ZERO)
        candidates = wrong.sum(axis=1) >= MIN_TOKEN_LAYERS
        if single is not None:  # a traced row no flip explains: a candidate in one layer too
            candidates |= (np.isin(request_codes, TRACED) & ~single[r]).any(axis=1)
        for row in map(int, np.flatnonzero(candidates)):

            def differing(kind: str, source: int | None, r: int = r, row: int = row) -> int:
                return _differing(refs, kind, r, row, source, len(moe_layers))

            flips = None if single is None else single[r][row]
            fault = _judge(request_codes[row], request_sources[row], rates, tests, whole_token, differing, flips)
            if fault is not None:
                kind, hit, probability, source, differ = fault
                faults.append(
                    TokenFault(
                        requests[r],
                        row,
                        kind,
                        [moe_layers[j] for j in map(int, np.flatnonzero(hit))],
                        int(wrong[row].sum()),
                        len(moe_layers),
                        probability,
                        prompts[r],
                        None if source is None else requests[source],
                        differ,
                        not math.isnan(probability),
                    )
                )
    return faults, thresholds


def whole_kinds(
    codes: list[np.ndarray], sources: list[np.ndarray], refs: list[np.ndarray], whole_token: float = WHOLE_TOKEN
) -> list[np.ndarray]:
    """Per request, per token: the code of the origin (LATE, EARLY, OTHER, STALE) whose rows the token holds in at
    least ``whole_token`` of the layers where that origin differs (in 2 layers at least, or in every one where it
    differs), else AGREE: rows filed whole, as a misfiling gives, not a near-tie landing on a neighbour's routing
    in a layer or two of those where it differs."""
    layers = codes[0].shape[1] if codes else 0
    found = [np.zeros(len(c), dtype=np.int8) for c in codes]
    for r, (request_codes, request_sources) in enumerate(zip(codes, sources, strict=True)):
        for row in map(int, np.flatnonzero(np.isin(request_codes, TRACED).any(axis=1))):
            for code, kind in ((LATE, "late"), (EARLY, "early"), (STALE, "stale"), (OTHER, "other")):
                hit = request_codes[row] == code
                source = None
                if code == OTHER and hit.any():
                    values, counts = np.unique(request_sources[row][hit], return_counts=True)
                    source = int(values[np.argmax(counts)])
                    hit &= request_sources[row] == source
                count, differ = int(hit.sum()), _differing(refs, kind, r, row, source, layers)
                if count >= whole_token * differ and (count >= MIN_TOKEN_LAYERS or count == differ >= 1):
                    found[r][row] = code
                    break
    return found


def _differing(refs: list[np.ndarray] | None, kind: str, r: int, row: int, source: int | None, layers: int) -> int:
    """In how many MoE layers the rows of ``kind``'s origin differ from the token's own (re-prefill) rows: where a
    row filed from there would show. ``any`` and ``stale`` (a whole token's routing): every layer."""
    if refs is None or kind in ("any", "stale"):
        return layers
    own = refs[r][row]
    if kind == "late":
        origin = refs[r][row - 1] if row >= 1 else None
    elif kind == "early":
        origin = refs[r][row + 1] if row + 1 < len(refs[r]) else None
    else:
        origin = refs[source][row] if source is not None and row < len(refs[source]) else None
    return layers if origin is None else int(np.any(origin != own, axis=-1).sum())


def _judge(
    codes: np.ndarray,
    sources: np.ndarray,
    rates: dict[str, np.ndarray],
    tests: int,
    whole_token: float,
    differing: Callable[[str, int | None], int],
    flips: np.ndarray | None = None,
) -> tuple[str, np.ndarray, float, int | None, int] | None:
    """The most telling explanation of one token's disagreements, if it is a fault:
    ``(kind, layers hit, p, source, layers where that origin differs)``; p is NaN where the token is named as no
    flip (``flips``: which of its rows differ from the re-prefill's by one expert only)."""
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
    candidates.append((tail(rates["any"], int(disagree.sum())), "any", disagree, None))
    for probability, kind, hit, found in sorted(candidates, key=lambda item: item[0]):
        count = int(hit.sum())
        if count < MIN_TOKEN_LAYERS or probability * tests >= FALSE_ALARM or math.isnan(probability):
            break  # the most telling one is not enough: none is
        differ = differing(kind, found)
        if count >= whole_token * differ:  # the token's rows are that origin's wherever they would show
            return kind, hit, probability, found, differ
    return _no_flip(codes, sources, differing, flips)


def _no_flip(
    codes: np.ndarray, sources: np.ndarray, differing: Callable[[str, int | None], int], flips: np.ndarray | None
) -> tuple[str, np.ndarray, float, int | None, int] | None:
    """A token whose rows are one origin's in every layer where that origin's routing differs from its own, one of
    them more than one expert from its own row: no near-tie flip does that, in one layer as in many."""
    if flips is None:
        return None
    for code, kind in ((LATE, "late"), (EARLY, "early"), (STALE, "stale"), (OTHER, "other")):
        hit = codes == code
        source = None
        if code == OTHER and hit.any():
            values, counts = np.unique(sources[hit], return_counts=True)
            source = int(values[np.argmax(counts)])
            hit &= sources == source
        if hit.any() and (~flips[hit]).any():
            differ = differing(kind, source)
            if int(hit.sum()) >= differ:
                return kind, hit, math.nan, source, differ
    return None
