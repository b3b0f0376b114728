# SPDX-License-Identifier: Apache-2.0
"""vLLM's ``routed_experts`` arrays on the token axis: the row contracts of each generation, :func:`align`,
the contract check for a trainer, and the dedup of a GRPO group's shared prompt (:func:`share_prompt`) and of a
multi-turn conversation (:class:`Conversation`).

NumPy only, never vLLM (the runtime plugin never imports ``vllm_ascend_routing.replay``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from vllm_ascend_routing import releases
from vllm_ascend_routing.contract import Violation
from vllm_ascend_routing.contract import check as _check
from vllm_ascend_routing.store.layout import StoredRows
from vllm_ascend_routing.store.reader import open_rows

INVALID = -1  # the id Aligned.routes leaves in rows with no recorded routing: not an expert, any gather at it fails


class RowContract(NamedTuple):
    """Where a generation's rows start, as vLLM documents its array (README, "Reading the array")."""

    releases: str
    takes_prompt_start: bool  # rows from SamplingParams.routed_experts_prompt_start; else always from token 0


# The array's dtype is part of vLLM's documented contract, one per generation (the plugin returns each
# generation's own): 0.20.x's shm array is int32, 0.22+'s uint8 up to 256 experts and uint16 above (the release
# table's ``row_dtypes``). A converted array has lost it, so its row convention can no longer be told and is refused.
ROW_CONTRACTS: dict[np.dtype[Any], RowContract] = {
    np.dtype(dtype): RowContract(text, takes_prompt_start=takes)
    for dtype, (text, takes) in releases.row_contracts().items()
}


def _arrays(takes_prompt_start: bool) -> tuple[str, str]:
    """``("vLLM 0.22+", "uint8/uint16")``: the releases and dtypes whose rows start at ``prompt_start`` (or not)."""
    dtypes = [dtype for dtype, c in ROW_CONTRACTS.items() if c.takes_prompt_start is takes_prompt_start]
    return ", ".join(dict.fromkeys(ROW_CONTRACTS[d].releases for d in dtypes)), "/".join(d.name for d in dtypes)


_FROM_START, _FROM_TOKEN_0 = _arrays(True), _arrays(False)


class Aligned(NamedTuple):
    """One sample's routing on the token axis, held as vLLM returned it: its dtype, no copy.

    ``parts`` are consecutive blocks of rows (one for :func:`align`; a shared prompt and a response, or
    one per turn, for :func:`share_prompt` and :class:`Conversation`) holding tokens ``first`` to
    ``first + num_rows - 1``; the other tokens of the ``num_tokens`` have no recorded routing.
    """

    parts: tuple[Any, ...]  # each [rows_i, num_layers, top_k], vLLM's dtype: np.ndarray, or StoredRows (a key)
    first: int  # the token of the first row
    num_tokens: int  # T = prompt + output

    @property
    def num_rows(self) -> int:
        return sum(int(part.shape[0]) for part in self.parts)

    @property
    def valid(self) -> np.ndarray:
        """`[T]` bool: token t went through vLLM's model with a recorded row."""
        valid = np.zeros(self.num_tokens, dtype=bool)
        valid[self.first : self.first + self.num_rows] = True
        return valid

    @property
    def routes(self) -> np.ndarray:
        """`[T, num_layers, top_k]` int64, ``INVALID`` (-1) where ``valid`` is false: a widened copy (8x a uint8
        array) for inspection; :func:`to_megatron` never builds it."""
        shape = self.parts[0].shape[1:]
        routes = np.full((self.num_tokens, *shape), INVALID, dtype=np.int64)
        row = self.first
        for part in self.parts:
            routes[row : row + part.shape[0]] = part
            row += part.shape[0]
        return routes

    @property
    def nbytes(self) -> int:
        return sum(int(part.nbytes) for part in self.parts)


# Where the token axis comes from, for the messages that refuse a misaligned one.
CONVENTION = (
    f"row t must be token t of prompt + output: {_FROM_START[0]} returns T-1-prompt_start rows starting at token "
    "routed_experts_prompt_start (verl and NeMo RL assume 0 and place row 0 at the first prompt token), "
    f"{_FROM_TOKEN_0[0]} T-1 rows from token 0; the last token has no row"
)


class AlignmentError(ValueError):
    """The rows do not line up with the trainer's tokens (a shifted token axis, another sample's rows)."""


def align(
    routed: np.ndarray | str | StoredRows, prompt_len: int, output_len: int, prompt_start: int | None = None
) -> Aligned:
    """Put one request's ``routed_experts`` on the token axis of ``prompt + output`` (``T`` tokens), uncopied.

    The array's generation is part of its documented contract (:data:`ROW_CONTRACTS`): int32 (vLLM
    0.20.x) holds ``T - 1`` rows from token 0; uint8 / uint16 (0.22+) hold ``T - 1 - prompt_start`` rows
    from token ``prompt_start``. The last token never went through the model and has no row.

    Args:
        routed: `[rows, num_layers, top_k]` ``CompletionOutput.routed_experts``, unconverted; or, from an engine with
            a row store, ``routed_experts_info["store_key"]`` (or ``open_rows(key)``): nothing is read here, and
            :func:`to_megatron` reads only the rank's slice.
        prompt_len: ``len(prompt_token_ids)``.
        output_len: ``len(output.token_ids)``.
        prompt_start: ``SamplingParams.routed_experts_prompt_start`` (0.22+ only: the record's ``first_token``);
            for a key, its stored first token unless given (and refused if another is given).

    Returns:
        :class:`Aligned` holding ``routed`` itself (its ``valid`` is false before ``prompt_start`` and on the
        last token; ``routes`` is the int64 form with ``INVALID`` there).

    Raises:
        ValueError: the array matches no generation's contract for these lengths; the message names
            the row count expected.
    """
    if isinstance(routed, str):
        routed = open_rows(routed)
    if isinstance(routed, StoredRows):
        if prompt_start is not None and prompt_start != routed.first_token:
            raise ValueError(
                f"prompt_start={prompt_start}, but the stored rows {routed.header.key!r} start at token "
                f"{routed.first_token}: pass the record's first_token, or none"
            )
        prompt_start = routed.first_token
    else:
        routed = np.asarray(routed)
    prompt_start = 0 if prompt_start is None else int(prompt_start)
    num_tokens = int(prompt_len) + int(output_len)
    if prompt_len < 0 or output_len < 0 or num_tokens < 1:
        raise ValueError(f"prompt_len={prompt_len}, output_len={output_len}: a request has at least one token")
    if not 0 <= prompt_start < num_tokens:
        raise ValueError(f"prompt_start={prompt_start} outside [0, {num_tokens}) for {num_tokens} tokens")
    new_rows = num_tokens - 1 - prompt_start
    expected = (
        f"{_FROM_TOKEN_0[0]}: {_FROM_TOKEN_0[1]} with T-1 = {num_tokens - 1} rows, or {_FROM_START[0]}: "
        f"{_FROM_START[1]} with T-1-prompt_start = {new_rows} rows (T = {prompt_len} prompt + {output_len} output "
        "tokens)"
    )
    if routed.ndim != 3:
        raise ValueError(f"routed_experts of shape {routed.shape}: expected [rows, num_layers, top_k]; {expected}")
    contract = ROW_CONTRACTS.get(routed.dtype)
    if contract is None:
        raise ValueError(f"routed_experts of dtype {routed.dtype}: pass the array as vLLM returned it; {expected}")
    if prompt_start and not contract.takes_prompt_start:
        raise ValueError(
            f"an {routed.dtype} array is {contract.releases}'s, which has no prompt_start (got {prompt_start}): "
            f"expected T-1 = {num_tokens - 1} rows from token 0"
        )
    if routed.shape[0] != new_rows:
        raise ValueError(
            f"routed_experts has {routed.shape[0]} rows of dtype {routed.dtype}; {expected} "
            "(a prompt_start other than the request's, or rows another layer already cut or padded)"
        )
    return Aligned((routed,), int(prompt_start), num_tokens)


def check(
    routed: np.ndarray,
    num_experts: int,
    moe_layers: Sequence[int] | None,
    *,
    valid: np.ndarray | None = None,
    expected_rows: int | None = None,
    limit: int = 5,
    zero_experts: int = 0,
) -> list[Violation]:
    """Rows that break the contract: validation mode's rules (``contract.check``), for a trainer.

    Ids in ``[0, num_experts + zero_experts)`` (zero experts, e.g. LongCat-Flash's, follow the routed ones:
    ``contract.zero_experts(hf_config)``) and distinct within a MoE-layer row, dense-layer rows zero, no MoE layer
    all zero across the rows. Works on vLLM's array or on :func:`align`'s ``routes`` (pass its ``valid``:
    rows without recorded routing are not checked). Empty list: the rows are fit to replay.
    """
    return _check(
        np.asarray(routed),
        num_experts=num_experts,
        moe_layers=moe_layers,
        valid=valid,
        expected_rows=expected_rows,
        limit=limit,
        zero_experts=zero_experts,
    )


class SharedPrompt(NamedTuple):
    """A GRPO group's rows with its prompt's rows held once: :func:`share_prompt`'s result.

    ``prompt_rows`` are tokens ``prompt_start .. prompt_len - 1`` (the last prompt token's row included: it
    was forwarded in the prefill), ``responses[i]`` sample ``i``'s rows after its prompt (tokens
    ``prompt_len .. T_i - 2``). Ship these instead of the n arrays; :meth:`sample` rebuilds sample ``i``
    for :func:`to_megatron` without a copy.
    """

    prompt_rows: np.ndarray  # [prompt_len - prompt_start, num_layers, top_k], vLLM's dtype
    responses: tuple[np.ndarray, ...]  # one [output_len_i - 1, num_layers, top_k] per sample
    prompt_len: int
    prompt_start: int = 0

    def sample(self, i: int) -> Aligned:
        response = self.responses[i]
        return Aligned((self.prompt_rows, response), self.prompt_start, self.prompt_len + len(response) + 1)

    @property
    def nbytes(self) -> int:
        """What shipping the group this way costs."""
        return int(self.prompt_rows.nbytes) + sum(int(r.nbytes) for r in self.responses)


def share_prompt(
    group: Sequence[np.ndarray | str], prompt_len: int, output_lens: Sequence[int], prompt_start: int = 0
) -> SharedPrompt:
    """Hold a GRPO group's shared prompt rows once: the n samples of one prompt, as vLLM returned them.

    Under prefix caching every sample of a prompt routes the prompt's tokens the same way, so its rows
    are the same n times; this keeps sample 0's and checks that every other sample's are identical.

    Args:
        group: each sample's ``routed_experts``, unconverted, for the same prompt.
        prompt_len: the prompt's token count.
        output_lens: each sample's ``len(output.token_ids)``.
        prompt_start: ``routed_experts_prompt_start`` the group was sampled with (0.22+).

    Raises:
        ValueError: a sample's array breaks :func:`align`'s contract, or its prompt rows differ from sample
            0's (not prefix-cached, or not the same prompt): the message names the sample, token and layer.
    """
    if not group or len(group) != len(output_lens):
        raise ValueError(f"{len(group)} arrays for {len(output_lens)} output lengths: one per sample, at least one")
    arrays = [np.asarray(open_rows(r) if isinstance(r, str) else r) for r in group]  # keys: compared whole
    aligned = [align(routed, prompt_len, out, prompt_start) for routed, out in zip(arrays, output_lens, strict=True)]
    shared = prompt_len - prompt_start  # rows of tokens prompt_start .. prompt_len - 1
    if shared < 1:
        raise ValueError(f"prompt_start={prompt_start} leaves no prompt row of a {prompt_len}-token prompt to share")
    first = aligned[0].parts[0]
    prompt_rows = first[:shared]
    for i, sample in enumerate(aligned[1:], start=1):
        rows = sample.parts[0]
        if rows.dtype != first.dtype or rows.shape[1:] != first.shape[1:]:
            raise ValueError(
                f"sample {i}: {rows.dtype} {rows.shape[1:]} rows, sample 0 has {first.dtype} {first.shape[1:]}"
            )
        differ = np.nonzero((rows[:shared] != prompt_rows).any(axis=2))
        if len(differ[0]):
            token, layer = int(differ[0][0]) + prompt_start, int(differ[1][0])
            raise ValueError(
                f"sample {i}'s prompt rows differ from sample 0's ({len(differ[0])} (token, layer) rows, first at "
                f"token {token} layer {layer}): not one prompt served from the prefix cache; send its rows whole"
            )
    responses = tuple(sample.parts[0][shared:] for sample in aligned)
    return SharedPrompt(prompt_rows, responses, int(prompt_len), int(prompt_start))


class Conversation:
    """A multi-turn conversation's rows, each token's received once.

    Each turn re-sends the whole context; ask vLLM 0.22+ for the new rows only with
    ``SamplingParams(routed_experts_prompt_start=conversation.prompt_start)`` (or, with this plugin, the
    per-request ``routed_experts_omit``: ``conversation.prompt_start`` or ``"cached"``; then pass the start it
    reports, ``routed_experts_info["first_token"]``) and :meth:`add_turn` the array:

        conversation = Conversation()
        for turn in turns:
            params = SamplingParams(..., routed_experts_prompt_start=conversation.prompt_start)
            out = llm.generate(context, params)
            conversation.add_turn(out.routed_experts, len(context), len(out.token_ids), conversation.prompt_start)
        sample = conversation.aligned()   # the whole conversation, for to_megatron

    A token's row is the one recorded by the turn that first forwarded it (the turn that sampled it, for
    a response token), which is what that turn's log-probs came from: a turn whose rows start before the rows
    held (``"cached"`` starts at a KV block's first token) has its re-sent rows dropped. vLLM 0.20.x (int32
    arrays) has no ``prompt_start`` and returns every row every turn: pass ``prompt_start=0``; the rows already
    held are dropped here (what vLLM sends is not reduced, what the trainer keeps and ships is).
    """

    def __init__(self) -> None:
        self._parts: list[Any] = []  # np.ndarray, or StoredRows windows (turns given as keys: read when packed)
        self._num_tokens = 0

    @property
    def prompt_start(self) -> int:
        """The next turn's ``routed_experts_prompt_start``: the rows held (tokens 0 .. this - 1)."""
        return sum(len(part) for part in self._parts)

    def add_turn(
        self, routed: np.ndarray | str | StoredRows, prompt_len: int, output_len: int, prompt_start: int
    ) -> int:
        """Add one turn's array (``prompt_len`` tokens of context, this turn's ``output_len``); returns the rows
        added.

        Raises:
            ValueError: the array breaks :func:`align`'s contract, ``prompt_start`` is past the rows held (a
                0.22+ turn missing rows), the context is shorter than the conversation so far, or the dtype or
                layers changed.
        """
        held = self.prompt_start
        if prompt_len < self._num_tokens:
            raise ValueError(
                f"a turn of {prompt_len} context tokens after a conversation of {self._num_tokens}: each turn's "
                "prompt is the whole conversation so far plus the new message"
            )
        aligned = align(routed, prompt_len, output_len, prompt_start)
        rows = aligned.parts[0]
        contract = ROW_CONTRACTS[rows.dtype]
        if self._parts and (rows.dtype != self._parts[0].dtype or rows.shape[1:] != self._parts[0].shape[1:]):
            raise ValueError(f"a turn of {rows.dtype} {rows.shape[1:]} rows after {self._parts[0].dtype} ones")
        if contract.takes_prompt_start:
            if prompt_start > held:
                raise ValueError(
                    f"a turn whose rows start at token {prompt_start}, but {held} rows are held: the rows of tokens "
                    f"{held}..{prompt_start - 1} were neither held nor sent; ask with at most "
                    f"conversation.prompt_start ({held})"
                )
            new = rows[held - prompt_start :]  # rows re-sent (prefix-cache omission starts at a block) are held
        else:
            new = rows[held:]  # rows from token 0 (0.20.x): every row again; keep the new ones
        self._parts.append(new)
        self._num_tokens = prompt_len + output_len
        return len(new)

    def aligned(self) -> Aligned:
        """The whole conversation on its token axis (its last turn's ``prompt + output``), without a copy."""
        if not self._parts:
            raise ValueError("a conversation without turns")
        return Aligned(tuple(self._parts), 0, self._num_tokens)

    @property
    def nbytes(self) -> int:
        return sum(int(part.nbytes) for part in self._parts)
