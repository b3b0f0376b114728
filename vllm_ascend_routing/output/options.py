# SPDX-License-Identifier: Apache-2.0
"""The per-request routed-experts options a caller sets in ``SamplingParams.extra_args`` (over HTTP: the body's
``vllm_xargs``, which vLLM copies into ``extra_args``), read the same way in every process.

    SamplingParams(extra_args={"return_routed_experts": False})      # this request: no rows, no engine work
    SamplingParams(extra_args={"routed_experts_omit": "cached"})     # rows from the first token not served
                                                                      # from the prefix cache
    SamplingParams(extra_args={"routed_experts_omit": 1200})         # rows from prompt token 1200 on
    SamplingParams(extra_args={"routed_experts_transport": "inline"}) # on a store engine: this request's rows in
                                                                      # the output, not behind a key

Plain Python: the front end checks them when a request arrives, the engine core acts on them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

RETURN = "return_routed_experts"
OMIT = "routed_experts_omit"
OMIT_CACHED = "cached"
TRANSPORT = "routed_experts_transport"
TRANSPORTS = ("inline", "store")
KEYS = (RETURN, OMIT, TRANSPORT)

_TRUE = (True, 1, "1", "true", "True", "yes")
_FALSE = (False, 0, "0", "false", "False", "no")


class RequestOptionError(ValueError):
    """A per-request routed-experts option this engine cannot honour, or a malformed one."""


@dataclass(frozen=True)
class RequestOptions:
    """One request's options. ``returns``: ``None`` leaves it to the engine's ``--enable-return-routed-experts``."""

    returns: bool | None = None
    omit_cached: bool = False  # rows of prompt tokens served from the local prefix cache are not sent
    omit_before: int = 0  # rows of tokens before this one are not sent (like routed_experts_prompt_start)
    transport: str | None = None  # "inline" or "store"; None: the engine's (VLLM_ASCEND_ROUTING_STORE)

    @property
    def inline(self) -> bool:
        return self.transport == "inline"

    @property
    def opted_out(self) -> bool:
        return self.returns is False

    @property
    def selects_rows(self) -> bool:
        """Whether the engine core has to move this request's first row (or drop its rows)."""
        return self.opted_out or self.omit_cached


NONE = RequestOptions()


def parse(extra_args: Mapping[str, Any] | None) -> RequestOptions:
    """The options in ``extra_args`` (``NONE`` where it holds none of ``KEYS``).

    Raises:
        RequestOptionError: a value of the wrong kind (the message names the key and what it accepts).
    """
    if not extra_args or not any(key in extra_args for key in KEYS):
        return NONE
    returns = _flag(extra_args.get(RETURN))
    transport = extra_args.get(TRANSPORT)
    if transport is not None and transport not in TRANSPORTS:
        raise RequestOptionError(
            f"{TRANSPORT}={transport!r}: expected 'inline' (this request's rows in the output) or 'store' (behind "
            "routed_experts_info['store_key'], on an engine with VLLM_ASCEND_ROUTING_STORE set)"
        )
    omit = extra_args.get(OMIT)
    if omit is None:
        return RequestOptions(returns, transport=transport)
    if omit == OMIT_CACHED:
        return RequestOptions(returns, omit_cached=True, transport=transport)
    if isinstance(omit, bool) or not isinstance(omit, int | str) or not str(omit).isdigit():
        raise RequestOptionError(
            f"{OMIT}={omit!r}: expected {OMIT_CACHED!r} (omit the rows of prompt tokens served from the prefix "
            "cache) or a token index N >= 0 (omit the rows of tokens before N)"
        )
    return RequestOptions(returns, omit_before=int(omit), transport=transport)


def of(params: Any) -> RequestOptions:
    """The options of a ``SamplingParams`` (``NONE`` for pooling requests and requests without ``extra_args``)."""
    return parse(getattr(params, "extra_args", None))


def _flag(value: Any) -> bool | None:
    if value is None:
        return None
    if value in _TRUE and not isinstance(value, float):
        return True
    if value in _FALSE and not isinstance(value, float):
        return False
    raise RequestOptionError(f"{RETURN}={value!r}: expected true or false")
