# SPDX-License-Identifier: Apache-2.0
"""The one way a generation lifts a refusal of vLLM's where the plugin serves what vLLM refuses: a read that vLLM's
check makes while deciding to refuse answers as served, at that check and only there. Every other reader of the same
property or method, in vLLM or anywhere else, gets vLLM's own answer; the config itself is never rewritten.

A ``Site`` is vLLM's check: its code object and, where the check is one statement of a longer method (0.22-0.30's
``VllmConfig.__post_init__``), the one line that guards the refusal (``guarding_line`` finds it in the bytecode, next to
the refusal's own message). ``lifted(read, site, answer)`` makes the replacement of ``read`` (a property or a method of
vLLM's class, installed through ``patching.replace``): called from the site, it returns ``answer(checked, owner,
value, *args)`` (``checked``: the object the check runs on, its ``self``; ``owner``: whose property or method was
read; ``value``: vLLM's own answer), unless that is ``NOT_LIFTED``.

Used by runner-output (``KVTransferConfig.is_kv_transfer_instance``, at the refusal of routed experts with KV
connectors) and aux-output (``Platform.is_out_of_tree`` and ``KVTransferConfig.has_connector``, in the AuxOutput
check).
"""

from __future__ import annotations

import dis
import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import CodeType, FrameType
from typing import Any

NOT_LIFTED = object()  # an answer that leaves vLLM's own


@dataclass(frozen=True)
class Site:
    """Where vLLM's check reads: its code, and the one guarding line of it (``None``: any line)."""

    code: CodeType
    line: int | None = None

    def holds(self, frame: FrameType) -> bool:
        return frame.f_code is self.code and (self.line is None or frame.f_lineno == self.line)


def guarding_line(code: CodeType, attribute: str, message: tuple[str, ...]) -> int | None:
    """The line of the last read of ``attribute`` before the constant holding every part of ``message`` in ``code``
    (the read that guards that refusal), or ``None`` where ``code`` has no such message."""
    line = None
    for instruction in dis.get_instructions(code):
        if instruction.argval == attribute and instruction.opname.startswith("LOAD_"):
            positions = getattr(instruction, "positions", None)  # Python 3.11+
            line = positions.lineno if positions is not None else instruction.starts_line
        elif isinstance(instruction.argval, str) and all(part in instruction.argval for part in message):
            return line
    return None


class _Property(property):
    """A property that can carry ``patching``'s marker."""


Answer = Callable[..., Any]  # (checked, owner, value, *args) -> an answer, or NOT_LIFTED


def lifted(read: Any, site: Callable[[], Site | None], answer: Answer) -> Any:
    """``read`` (a property, or a function of vLLM's class) as vLLM computes it, except where ``site()`` (found once,
    when first needed) reads it: there ``answer``'s, unless that is ``NOT_LIFTED``."""
    compute = read.fget if isinstance(read, property) else read
    assert compute is not None

    def reading(owner: Any, *args: Any, **kwargs: Any) -> Any:
        value = compute(owner, *args, **kwargs)
        found = site()
        if found is not None:
            caller = sys._getframe(1)
            if found.holds(caller):
                answered = answer(caller.f_locals.get("self"), owner, value, *args)
                if answered is not NOT_LIFTED:
                    return answered
        return value

    if isinstance(read, property):
        return _Property(reading, doc=read.__doc__)
    return functools.wraps(read)(reading)
