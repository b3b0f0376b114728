# SPDX-License-Identifier: Apache-2.0
"""``LayerRecorder``: the ops bound to one layer of a capture buffer, and the choice, made here, between the
eager direct write and the custom ops."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from vllm_ascend_routing.ops import _library
from vllm_ascend_routing.ops._id_rule import UNSIGNED_OF, id_limit
from vllm_ascend_routing.ops._in_graph import record_in_graph
from vllm_ascend_routing.ops._library import record_local_topk_ids_op, record_topk_ids_op
from vllm_ascend_routing.ops._native import RecordRows
from vllm_ascend_routing.parallel import RankLayout

# From this many ids on (8192 tokens at top-8) the eager write without a native build checks and copies with ATen:
# a long prefill's ids are then read and written by torch's threads, where NumPy's max and strided copy use one
# thread (``make bench-kernel``: 65,536 tokens 315 against 759 us on 2 cores); below it NumPy's calls cost less.
LARGE_BATCH_IDS = 65536


def eager_view(out: torch.Tensor, layer_id: int) -> torch.Tensor | None:
    """``out[:, layer_id]`` (a `[R, K]` view) where eager code may write ids into it directly instead of
    calling the op: ``out`` a plain CPU tensor and the C++ or the host kernel serving the CPU (the reference not
    forced). ``None`` elsewhere: devices whose native kernel (or the reference) the op must run, and tensor
    subclasses of tracers. Never for traced code: ``LayerRecorder`` uses it only when not compiling."""
    direct = _library.HOST_KERNEL or _library.NATIVE_RECORD_ROWS is not None
    if not direct or type(out) is not torch.Tensor or not out.is_cpu or out.dim() != 3:
        return None
    return out[:, layer_id]


@dataclass(frozen=True)
class LayerRecorder:
    """Records one layer's top-k ids, token ``i`` into ``out[i, layer_id]``, under the invalid-id rule
    (``_id_rule``) for ``num_experts`` ids; with a ``layout``, this rank's tokens only
    (``record_local_topk_ids``)."""

    out: torch.Tensor  # [max_tokens, num_hidden_layers, top_k] int16
    layer_id: int
    num_experts: int
    errors: torch.Tensor  # [1], invalid ids seen
    layout: RankLayout | None = None

    # Eager mode on the CPU: ``out[:, layer_id]`` as a NumPy view, written directly (``eager_view``; ``None`` on
    # other devices, where the op's native kernel or the reference must run), and the ids it accepts: [0, _limit).
    # With a native build, the C++ kernel's direct entry writes it instead (``_record_rows``, every id: it stores
    # and counts invalid ones); without one, NumPy does (in-range ids only).
    _array: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)
    _limit: int = field(default=0, init=False, repr=False, compare=False)
    _record_rows: RecordRows | None = field(default=None, init=False, repr=False, compare=False)
    _view: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    # Traced on the CPU without a native build: the write as ATen ops the compiler fuses (``_in_graph``), not the op
    # (whose CPU kernel there is the Python host kernel).
    _in_graph: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.layout is None:
            view = eager_view(self.out, self.layer_id)
            object.__setattr__(self, "_view", view)
            object.__setattr__(self, "_array", None if view is None else view.numpy())
            object.__setattr__(self, "_limit", id_limit(self.num_experts))
            if view is not None:
                object.__setattr__(self, "_record_rows", _library.NATIVE_RECORD_ROWS)
                object.__setattr__(self, "_in_graph", _library.HOST_KERNEL)

    @property
    def writes_directly(self) -> bool:
        """Whether eager calls with in-range CPU ids skip the op (see ``__call__``)."""
        return self._array is not None

    def __call__(self, topk_ids: torch.Tensor) -> None:
        """Runs once per MoE layer per step. No Python argument checks: buffer and layer were validated at bind
        time, and the fake kernel checks shapes when compiled.

        Eager (not traced) on the CPU, ids are written here, with no dispatcher round trip (about 3 us a call on
        the CPU, more than the write of a decode step's ids). With a native build, by the C++ kernel's direct
        entry (``_C.record_rows``): one pass that checks, stores (invalid ids as -1) and counts into ``errors``,
        on the tensors themselves. Without one, in-range ids by NumPy: one
        reduction and one strided copy on zero-copy NumPy views (``benchmarks/kernel.py``: a NumPy call costs
        about 1 us where an ATen call costs 1-5); from ``LARGE_BATCH_IDS`` ids on by ATen's ``aminmax`` and
        ``copy_``, which use torch's threads. The check reads CPU memory: nothing to wait for. Viewed as unsigned, a
        negative id is huge, so ``max < limit`` is ``0 <= id < limit`` for every id at once (as in
        ``_id_rule.checked_array``). More tokens than the buffer's rows raise; out-of-range ids go to the op,
        which stores them as invalid and counts them. Whenever ``torch.compile`` traces this
        (``is_compiling()`` is a constant there), or the ids are not a plain tensor (fake/functional tensors
        of other tracers), the op is emitted: a custom op mutating ``out`` is what keeps the write in compiled
        graphs and graph captures. Except traced on the CPU without a native build: there the same rule as
        ATen ops (``_in_graph``), which Inductor fuses into the layer's own kernel instead of calling back
        into the Python host kernel.
        """
        if not torch.compiler.is_compiling():
            array = self._array
            if array is not None and type(topk_ids) is torch.Tensor and topk_ids.is_cpu:
                record_rows = self._record_rows
                if record_rows is not None:
                    # None: not what the kernel accepts, nothing written; the op below raises its error.
                    if record_rows(topk_ids, self.out, self.layer_id, self._limit, self.errors) is not None:
                        return
                    record_topk_ids_op(topk_ids, self.out, self.layer_id, self.num_experts, self.errors)
                    return
                unsigned = UNSIGNED_OF.get(topk_ids.dtype)
                if unsigned is not None:
                    ids = topk_ids.numpy()  # integer tensors never require grad: always a zero-copy view
                    if ids.ndim == 2 and ids.shape[1] == array.shape[1]:
                        n = ids.shape[0]
                        if n == 0:
                            return
                        if n > array.shape[0]:  # never a silent partial write
                            raise RuntimeError(f"record_topk_ids: {n} tokens do not fit out's {array.shape[0]} rows")
                        if ids.size < LARGE_BATCH_IDS:
                            if ids.view(unsigned).max() < self._limit:
                                array[:n] = ids  # NumPy's unsafe cast narrows like ``copy_`` and the op
                                return
                        else:  # ATen's reduction and copy use torch's threads where NumPy's use one
                            view = self._view
                            assert view is not None  # taken with ``_array``
                            low, high = torch.aminmax(topk_ids)
                            if int(low) >= 0 and int(high) < self._limit:
                                view[:n].copy_(topk_ids)
                                return
        elif self._in_graph:
            record_in_graph(topk_ids, self.out, self.layer_id, self._limit, self.errors)
            return
        layout = self.layout
        if layout is None:
            record_topk_ids_op(topk_ids, self.out, self.layer_id, self.num_experts, self.errors)
            return
        record_local_topk_ids_op(
            topk_ids,
            self.out,
            self.layer_id,
            self.num_experts,
            self.errors,
            layout.dp_rank,
            layout.tp_size,
            layout.split_over_tp,
        )
