# SPDX-License-Identifier: Apache-2.0
"""The re-prefill consistency oracle's analysis (NumPy only): no reference model, any scale.

A finished sequence ``prompt + output`` is submitted again as a prompt (``prompt + output[:-1]``, one token out,
nothing served from the prefix cache): that re-prefill routes the very tokens the generation routed, in one
forward, in another batch. Row ``i`` of both arrays is then the routing of the same token, so per MoE layer the
two must agree, but for numeric near-ties (a router-logit gap below the dtype's rounding, which another batch
shape can flip).

Per layer: exact-row agreement (top-k compared as sets), mean top-k overlap, and an alignment test: agreement of
the generation's rows with the re-prefill's at offsets -1 / 0 / +1 and with another request's rows at the same
position. Each row the two passes disagree on is traced to where it came from, and a layer's verdict names the
structural fault its wrong rows share (``FAULTS``); rows no fault explains are numeric differences, counted and
tolerated up to ``TIE_BUDGET`` of the layer's rows. Across layers (``token_faults``): a token whose rows disagree
in more MoE layers than independent near-ties explain is a fault of its own (``TOKEN_FAULT``), named by request and
token, whatever the layers' verdicts: one misfiled row is a per-token event, near-ties are per-layer ones.

What it cannot see: a fault identical in both passes (docs/preflight.md names them and the tests that cover them).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from vllm_ascend_routing.preflight import token_faults
from vllm_ascend_routing.preflight.token_faults import EARLY, LATE, OTHER, STALE, UNTRACED, ZERO, TokenFault

PASS = "PASS"
# The structural faults, most specific first (a layer's verdict is the first whose rule holds).
LAYER_ZERO = "LAYER_ZERO"  # a MoE layer all zero in the generation where the re-prefill routed it
PARTIAL = "PARTIAL"  # a share of the rows zero (>= PARTIAL_SHARE): one rank's share of the tokens missing
ZEROS = "ZEROS"  # some all-zero rows: a bypassed capture
SHIFTED_LATE = "SHIFTED_LATE"  # row i holds token i-1's routing (one token late)
SHIFTED_EARLY = "SHIFTED_EARLY"  # row i holds token i+1's routing
STALE_STEP = "STALE_STEP"  # rows of the previous step: the previous token's, and other tokens' at batch changes
OTHER_REQUEST = "OTHER_REQUEST"  # a request's rows are another request's (filed under the wrong request)
DP_INTERLEAVE = "DP_INTERLEAVE"  # part of a request's rows are another request's, interleaved (DP ranks mixed)
MISMATCH = "MISMATCH"  # more rows differ than near-ties explain, with no structure found
SHAPE = "SHAPE"  # the two passes returned a different number of rows (or none) for a request
FAULTS: tuple[str, ...] = (SHAPE, LAYER_ZERO, PARTIAL, ZEROS, SHIFTED_LATE, SHIFTED_EARLY, STALE_STEP, OTHER_REQUEST)
FAULTS += (DP_INTERLEAVE, MISMATCH)
# Tokens whose rows disagree in more MoE layers than independent near-ties explain (token_faults), where no layer
# fails: a misfiled row. Where layers fail too, their verdict is the run's and the tokens are listed beside it.
TOKEN_FAULT = "TOKEN_FAULT"

# The share of a layer's rows that may differ between the passes with no structural explanation: numeric
# near-ties. Both passes run the same kernels in the same dtype; only the batch shape (hence reduction order) and,
# for decode rows, the kernel differ, so a row can differ only where two router logits are closer than that
# dtype's rounding. Set from benchmarks/oracle_calibration.py (docs/preflight.md, "Calibrating the oracle"):
# bfloat16 on vLLM's CPU build, 24 MoE layers, top-8 of 64: no prompt row ever differed, decode rows up to 4.1% of
# a layer's in one run; 1.25 x that: 5% (float16, 3 more mantissa bits: the same). float32: none in 4 runs; 1%
# kept for accelerators (TF32 matmuls) until a GPU run measures them. Structural faults fail whatever the budget.
TIE_BUDGET = {"float32": 0.01, "bfloat16": 0.05, "float16": 0.05}
DEFAULT_TIE_BUDGET = 0.05
# A fault is named when it explains at least this share of a layer's wrong rows (chance agreement of
# neighbouring tokens explains far less) and at least MIN_FAULT_ROWS rows.
FAULT_SHARE = 0.5
MIN_FAULT_ROWS = 2
PARTIAL_SHARE = 0.25  # zero rows from this share of a layer's rows on: one rank's share, not a stray row
WHOLE_REQUEST = 0.75  # another request's rows where the two differ, in this share: the rows are that request's


@dataclass
class Pair:
    """One request's rows from the generation and from its re-prefill (``[rows, layers, top_k]`` each)."""

    request: str
    generation: np.ndarray | None
    reprefill: np.ndarray | None
    prompt_tokens: int | None = None  # where known: a token fault then says prompt or decode row
    # where known, the tokens the rows route (the re-prefill's prompt): a row equal to another request's at the
    # same position means nothing where the two requests' tokens are the same up to it (a shared prompt prefix)
    tokens: Sequence[int] | None = None


@dataclass
class LayerResult:
    layer: int
    rows: int = 0
    exact: int = 0
    mean_overlap: float = 0.0
    zero_rows: int = 0
    offsets: dict[str, float] = field(default_factory=dict)  # "-1", "0", "+1", "other": agreement over all rows
    wrong: int = 0  # rows that differ at offset 0
    traced: dict[str, int] = field(default_factory=dict)  # wrong rows by origin: late, early, other, stale, none
    near_ties: int = 0  # wrong rows no fault explains, tolerated within TIE_BUDGET
    verdict: str = PASS

    @property
    def agreement(self) -> float:
        return self.exact / self.rows if self.rows else 1.0


@dataclass
class Result:
    dtype: str
    requests: int
    layers: list[LayerResult]
    dense_layers: list[int]  # layers all zero in both passes (not MoE): not compared
    shape_problems: list[str]
    verdict: str  # PASS, the fault most layers show, or TOKEN_FAULT
    failing_layers: list[int]
    token_faults: list[TokenFault] = field(default_factory=list)
    token_thresholds: dict[str, int | None] = field(default_factory=dict)  # layers that make a token fault, by kind
    # per compared request: [rows, MoE layers] row codes (token_faults.AGREE, LATE, ...) and its prompt length
    codes: list[np.ndarray] = field(default_factory=list, repr=False)
    prompt_tokens: list[int | None] = field(default_factory=list, repr=False)
    refs: list[np.ndarray] = field(default_factory=list, repr=False)  # re-prefill rows of the MoE layers, sorted

    @property
    def ok(self) -> bool:
        return self.verdict == PASS

    @property
    def rows(self) -> int:
        return sum(layer.rows for layer in self.layers)

    @property
    def exact(self) -> int:
        return sum(layer.exact for layer in self.layers)

    @property
    def wrong(self) -> int:
        return sum(layer.wrong for layer in self.layers)

    @property
    def near_ties(self) -> int:
        return sum(layer.near_ties for layer in self.layers)

    def summary(self) -> str:
        share = 100.0 * self.exact / self.rows if self.rows else 100.0
        text = (
            f"re-prefill consistency: {self.requests} requests, {len(self.layers)} MoE layers, "
            f"{self.exact}/{self.rows} rows agree ({share:.2f}%), {self.near_ties} near-ties within {self.dtype} "
            "rounding"
        )
        if self.ok:
            return text + ": PASS"
        where = f" in layers {', '.join(map(str, self.failing_layers))}" if self.failing_layers else ""
        problems = f" ({'; '.join(self.shape_problems[:3])})" if self.shape_problems else ""
        tokens = ""
        if self.token_faults:
            more = f"; and {len(self.token_faults) - 3} more" if len(self.token_faults) > 3 else ""
            named = "; ".join(fault.describe() for fault in self.token_faults[:3])
            tokens = f"; {len(self.token_faults)} token(s) wrong in more layers than near-ties explain: {named}{more}"
        return f"{text}: FAIL {self.verdict}{where}, {self.wrong} rows wrong{problems}{tokens}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "requests": self.requests,
            "rows": self.rows,
            "exact": self.exact,
            "wrong": self.wrong,
            "near_ties": self.near_ties,
            "verdict": self.verdict,
            "ok": self.ok,
            "failing_layers": self.failing_layers,
            "dense_layers": self.dense_layers,
            "shape_problems": self.shape_problems,
            "token_faults": [fault.as_dict() for fault in self.token_faults],
            "token_thresholds": self.token_thresholds,
            "layers": [{**asdict(layer), "agreement": layer.agreement} for layer in self.layers],
            "summary": self.summary(),
        }

    def table(self) -> list[str]:
        lines = ["  layer    rows   agree  overlap  zero  off-1   off0  off+1  other  near-ties  verdict"]
        for layer in self.layers:
            off = layer.offsets
            lines.append(
                f"  {layer.layer:5d}  {layer.rows:6d}  {100 * layer.agreement:5.1f}%  {layer.mean_overlap:7.3f}  "
                f"{layer.zero_rows:4d}  {off['-1']:5.2f}  {off['0']:5.2f}  {off['+1']:5.2f}  {off['other']:5.2f}  "
                f"{layer.near_ties:9d}  {layer.verdict}"
            )
        lines += [f"  token fault: {fault.describe()}" for fault in self.token_faults]
        return lines


def analyse(
    pairs: list[Pair],
    dtype: str = "float32",
    moe_layers: list[int] | None = None,
    whole_token: float | None = None,
) -> Result:
    """Compare each request's generation rows with its re-prefill rows, per layer and per token; the verdict.

    ``moe_layers``: where known (the model's config), the layers to compare; else every layer either pass
    routed (dense layers are all zero in both). ``whole_token``: the per-token rule's share (default
    ``token_faults.WHOLE_TOKEN``; 0: the Poisson-binomial tail alone, as the calibration measures it)."""
    usable: list[tuple[str, np.ndarray, np.ndarray]] = []
    prompts: list[int | None] = []
    tokens: list[Sequence[int] | None] = []
    problems: list[str] = []
    for pair in pairs:
        if pair.generation is None or pair.reprefill is None:
            which = "generation" if pair.generation is None else "re-prefill"
            problems.append(f"request {pair.request}: no rows from the {which}")
            continue
        gen, ref = np.asarray(pair.generation).astype(np.int64), np.asarray(pair.reprefill).astype(np.int64)
        if gen.ndim != 3 or gen.shape != ref.shape:
            problems.append(f"request {pair.request}: generation {gen.shape}, re-prefill {ref.shape}")
            continue
        usable.append((pair.request, np.sort(gen, axis=-1), np.sort(ref, axis=-1)))
        prompts.append(pair.prompt_tokens)
        tokens.append(pair.tokens)
    if not usable:
        verdict = SHAPE if problems else PASS
        return Result(dtype, len(pairs), [], [], problems, verdict, [])
    num_layers = usable[0][1].shape[1]
    if moe_layers is None:
        moe_layers = [layer for layer in range(num_layers) if _routed(usable, layer)]
    dense = [layer for layer in range(num_layers) if layer not in moe_layers]
    signatures = _signatures([ref for _, _, ref in usable], moe_layers)
    shared = _shared_prefixes(tokens)
    budget = TIE_BUDGET.get(dtype, DEFAULT_TIE_BUDGET)
    # Per request, per (token, MoE layer): the row's code (token_faults.AGREE, LATE, ...), for OTHER whence, and
    # whether it differs from the re-prefill's by one expert only (what a near-tie flip does).
    codes = [np.zeros((len(gen), len(moe_layers)), dtype=np.int8) for _, gen, _ in usable]
    sources = [np.full((len(gen), len(moe_layers)), -1, dtype=np.int32) for _, gen, _ in usable]
    single = [np.zeros((len(gen), len(moe_layers)), dtype=bool) for _, gen, _ in usable]
    traced = [
        _layer(usable, layer, moe_layers, signatures, shared, *([c[:, j] for c in a] for a in (codes, sources, single)))
        for j, layer in enumerate(moe_layers)
    ]
    names = [name for name, _, _ in usable]
    refs = [ref[:, moe_layers] for _, _, ref in usable]
    whole_token = token_faults.WHOLE_TOKEN if whole_token is None else whole_token
    named, thresholds = token_faults.find(names, codes, sources, moe_layers, prompts, refs, whole_token, single)
    whole = token_faults.whole_kinds(codes, sources, refs, whole_token)
    layers = [
        _judged(result, [c[:, j] for c in codes], whole, [m[:, j] for m in single], facts, budget)
        for j, (result, facts) in enumerate(traced)
    ]
    in_faults: dict[int, int] = {}  # MoE layer -> rows of token faults in it (not near-ties)
    for fault in named:
        for layer in fault.layers:
            in_faults[layer] = in_faults.get(layer, 0) + 1
    for result in layers:
        if result.verdict == PASS:
            result.near_ties = max(0, result.near_ties - in_faults.get(result.layer, 0))
    failing = [layer.layer for layer in layers if layer.verdict != PASS]
    if problems:
        verdict = SHAPE
    elif failing:
        counts = {fault: sum(1 for layer in layers if layer.verdict == fault) for fault in FAULTS}
        verdict = max(FAULTS, key=lambda fault: (counts[fault], -FAULTS.index(fault)))
    else:
        verdict = TOKEN_FAULT if named else PASS
    return Result(dtype, len(pairs), layers, dense, problems, verdict, failing, named, thresholds, codes, prompts, refs)


def _routed(usable: list[tuple[str, np.ndarray, np.ndarray]], layer: int) -> bool:
    return any(gen[:, layer].any() or ref[:, layer].any() for _, gen, ref in usable)


def _signatures(refs: list[np.ndarray], moe_layers: list[int]) -> dict[bytes, list[tuple[int, int]]]:
    """Each re-prefill token's routing over every MoE layer (a key no two tokens share but by chance) -> where."""
    found: dict[bytes, list[tuple[int, int]]] = {}
    for r, ref in enumerate(refs):
        for i, row in enumerate(ref[:, moe_layers]):
            found.setdefault(row.tobytes(), []).append((r, i))
    return found


def _shared_prefixes(tokens: list[Sequence[int] | None]) -> np.ndarray:
    """``[r, s]``: how many leading tokens requests ``r`` and ``s`` share (0 where either's tokens are unknown): up to
    there both route the same tokens in the same context, so their rows are the same routing."""
    shared = np.zeros((len(tokens), len(tokens)), dtype=np.int64)
    by_first: dict[int, list[int]] = {}
    for r, seq in enumerate(tokens):
        if seq is not None and len(seq):
            by_first.setdefault(int(seq[0]), []).append(r)
    for group in by_first.values():
        for a, r in enumerate(group):
            for s in group[a + 1 :]:
                x, y = np.asarray(tokens[r]), np.asarray(tokens[s])
                common = min(len(x), len(y))
                differ = np.flatnonzero(x[:common] != y[:common])
                shared[r, s] = shared[s, r] = int(differ[0]) if len(differ) else common
    return shared


def _same(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise equality of sorted top-k rows: ``[rows]`` booleans."""
    return np.all(a == b, axis=-1)


def _layer(
    usable: list[tuple[str, np.ndarray, np.ndarray]],
    layer: int,
    moe_layers: list[int],
    signatures: dict[bytes, list[tuple[int, int]]],
    shared: np.ndarray,
    codes: list[np.ndarray],
    sources: list[np.ndarray],
    single: list[np.ndarray],
) -> tuple[LayerResult, tuple[list[float], int]]:
    """One MoE layer's numbers, before its verdict (``_judged``); fills ``codes[r]`` / ``sources[r]`` /
    ``single[r]`` (this layer's column of each request's row codes, sources, single-expert differences)."""
    result = LayerResult(layer)
    top_k = usable[0][1].shape[-1]
    late = early = other = stale = untraced = 0
    offsets = {"-1": 0, "0": 0, "+1": 0, "other": 0}
    zero_in_reprefill = 0
    other_share: list[float] = []  # per request with rows from another request: that share of its rows
    for r, (_, gen_all, ref_all) in enumerate(usable):
        gen, ref = gen_all[:, layer], ref_all[:, layer]
        rows = len(gen)
        result.rows += rows
        equal = _same(gen, ref)
        result.exact += int(equal.sum())
        overlap = (gen[:, :, None] == ref[:, None, :]).any(-1).sum(-1) / top_k
        result.mean_overlap += float(overlap.sum())
        single[r][:] = ~equal & (overlap * top_k == top_k - 1)
        zero = ~gen.any(-1) if top_k >= 2 else np.zeros(rows, dtype=bool)  # k >= 2: no real row is all zero
        zero_in_reprefill += int((~ref.any(-1)).sum()) if top_k >= 2 else 0
        result.zero_rows += int(zero.sum())
        codes[r][zero & ~equal] = ZERO
        offsets["0"] += int(equal.sum())
        offsets["-1"] += int(_same(gen[1:], ref[:-1]).sum())
        offsets["+1"] += int(_same(gen[:-1], ref[1:]).sum())
        partner = usable[(r + 1) % len(usable)][2][:, layer]
        common = min(rows, len(partner))
        offsets["other"] += int(_same(gen[:common], partner[:common]).sum()) if len(usable) > 1 else 0
        partners: list[int] = []  # for each wrong row traced to another request: which
        for i in map(int, np.flatnonzero(~equal & ~zero)):
            row = gen[i]
            if i >= 1 and np.array_equal(row, ref[i - 1]):
                late += 1
                codes[r][i] = LATE
                continue
            if i + 1 < rows and np.array_equal(row, ref[i + 1]):
                early += 1
                codes[r][i] = EARLY
                continue
            source = next(
                (
                    s
                    for s, (_, _, other_ref) in enumerate(usable)
                    if s != r
                    and i < len(other_ref)
                    and shared[r, s] <= i  # the same tokens up to here: the same routing, nothing misfiled
                    and np.array_equal(row, other_ref[i, layer])
                ),
                None,
            )
            if source is not None:
                other += 1
                partners.append(source)
                codes[r][i], sources[r][i] = OTHER, source
                continue
            if _token_found_elsewhere(gen_all[i], moe_layers, signatures, shared, r, i):
                stale += 1  # the whole token's routing is another token's: a step's buffer read at the wrong time
                codes[r][i] = STALE
                continue
            untraced += 1
            codes[r][i] = UNTRACED
        if partners:
            other_share.append(_share_from(gen, ref, usable[max(set(partners), key=partners.count)][2][:, layer]))
    rows = max(result.rows, 1)
    result.mean_overlap /= rows
    result.offsets = {name: count / rows for name, count in offsets.items()}
    result.wrong = result.rows - result.exact
    result.traced = {"late": late, "early": early, "other": other, "stale": stale, "none": untraced}
    return result, (other_share, zero_in_reprefill)


def _judged(
    result: LayerResult,
    codes: list[np.ndarray],
    whole: list[np.ndarray],
    single: list[np.ndarray],
    facts: tuple[list[float], int],
    budget: float,
) -> LayerResult:
    """The layer's verdict. A traced row counts toward a structural fault where it cannot be a near-tie that
    landed on a neighbour's routing by chance: it differs from the re-prefill's in more than one expert, or its
    token's rows are that origin's as a whole (``token_faults.whole_kinds``). Other traced rows are near-ties."""

    def structural(code: int) -> int:
        return sum(int(((c == code) & (~m | (w == code))).sum()) for c, w, m in zip(codes, whole, single, strict=True))

    late, early, other, stale = (structural(code) for code in (LATE, EARLY, OTHER, STALE))
    untraced = result.wrong - result.zero_rows - late - early - other - stale
    other_share, zero_in_reprefill = facts
    result.verdict = _verdict(result, late, early, other, stale, untraced, other_share, zero_in_reprefill, budget)
    result.near_ties = result.wrong if result.verdict == PASS else 0  # chance-traced ones too: no fault named
    return result


def _share_from(gen: np.ndarray, ref: np.ndarray, partner: np.ndarray) -> float:
    """Where this request's and ``partner``'s re-prefill rows differ, the share of its generation rows that are the
    partner's: all of them when the two requests' rows were swapped, about half when two ranks' rows were
    interleaved (shared prompt prefixes, where both are the same, tell nothing)."""
    common = min(len(gen), len(partner))
    differ = ~_same(ref[:common], partner[:common])
    if not differ.any():
        return 0.0
    return float(_same(gen[:common], partner[:common])[differ].mean())


def _token_found_elsewhere(
    token: np.ndarray,
    moe_layers: list[int],
    signatures: dict[bytes, list[tuple[int, int]]],
    shared: np.ndarray,
    r: int,
    i: int,
) -> bool:
    """Whether this generation token's routing over every MoE layer is some other re-prefill token's (not
    position ``i`` of request ``r``, nor of a request with the same tokens up to it): rows copied whole from
    another token, as a stale step buffer gives."""
    if not token[moe_layers].any():
        return False
    return any(s != r and not (j == i and shared[r, s] > i) for s, j in signatures.get(token[moe_layers].tobytes(), []))


def _verdict(
    result: LayerResult,
    late: int,
    early: int,
    other: int,
    stale: int,
    untraced: int,
    other_share: list[float],
    zero_in_reprefill: int,
    budget: float,
) -> str:
    wrong = result.wrong
    if wrong == 0:
        return PASS
    if result.zero_rows == result.rows and zero_in_reprefill < result.rows:
        return LAYER_ZERO
    if result.zero_rows >= PARTIAL_SHARE * result.rows:
        return PARTIAL
    if result.zero_rows:
        return ZEROS
    traced = wrong - result.zero_rows

    def names(count: int) -> bool:
        return count >= MIN_FAULT_ROWS and count >= FAULT_SHARE * traced

    if names(late + stale) and stale:
        return STALE_STEP
    if names(late):
        return SHIFTED_LATE
    if names(early):
        return SHIFTED_EARLY
    if names(other):
        return OTHER_REQUEST if max(other_share, default=0.0) >= WHOLE_REQUEST else DP_INTERLEAVE
    if names(stale):
        return STALE_STEP
    if untraced + late + early + other + stale > budget * result.rows:
        return MISMATCH
    return PASS
