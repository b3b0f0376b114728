# SPDX-License-Identifier: Apache-2.0
"""``LayerRecorder``: the ops bound to one layer of a capture buffer, and the choice, made here, between the
eager direct write and the custom ops."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm_ascend_routing.ops import _library
from vllm_ascend_routing.ops._id_rule import ID_DTYPES, id_limit, in_range
from vllm_ascend_routing.ops._library import record_local_topk_ids_op, record_topk_ids_op
from vllm_ascend_routing.parallel import RankLayout


def eager_view(out: torch.Tensor, layer_id: int) -> torch.Tensor | None:
    """``out[:, layer_id]`` (a `[R, K]` view) where eager code may write in-range ids into it directly instead
    of calling the op: ``out`` a plain CPU tensor and the host kernel serving the CPU (the reference not
    forced). ``None`` elsewhere: devices whose native kernel (or the reference) the op must run, and tensor
    subclasses of tracers. Never for traced code: ``LayerRecorder`` uses it only when not compiling."""
    if not _library.HOST_KERNEL or type(out) is not torch.Tensor or not out.is_cpu or out.dim() != 3:
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

    # Eager mode on the CPU: ``out[:, layer_id]``, written directly (``eager_view``; ``None`` on other devices,
    # where the op's native kernel or the reference must run), and the ids it accepts: [0, _limit).
    _view: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    _limit: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.layout is None:
            object.__setattr__(self, "_view", eager_view(self.out, self.layer_id))
            object.__setattr__(self, "_limit", id_limit(self.num_experts))

    @property
    def writes_directly(self) -> bool:
        """Whether eager calls with in-range CPU ids skip the op (see ``__call__``)."""
        return self._view is not None

    def __call__(self, topk_ids: torch.Tensor) -> None:
        """Runs once per MoE layer per step. No Python argument checks: buffer and layer were validated at bind
        time, and the fake kernel checks shapes when compiled.

        Eager (not traced) on the CPU, in-range ids are written here, with no dispatcher round trip into the
        op's Python kernel: the ATen ops the forward already runs (hot in the caches) cost less there than
        the op's NumPy kernel. The bounds are read from CPU memory: nothing to wait for. Out-of-range ids go
        to the op, which stores them as invalid and counts them. Whenever ``torch.compile`` traces this
        (``is_compiling()`` is a constant there), or the ids are not a plain tensor (fake/functional tensors
        of other tracers), the op is emitted: a custom op mutating ``out`` is what keeps the write in
        compiled graphs and graph captures.
        """
        if not torch.compiler.is_compiling():
            view = self._view
            if (
                view is not None
                and type(topk_ids) is torch.Tensor
                and topk_ids.is_cpu
                and topk_ids.dtype in ID_DTYPES
                and topk_ids.dim() == 2
                and topk_ids.shape[1] == view.shape[1]
            ):
                n = topk_ids.shape[0]
                if n == 0:
                    return
                low, high = torch.aminmax(topk_ids)
                if in_range(low.item(), high.item(), self._limit):
                    view[:n].copy_(topk_ids)  # more rows than the buffer's raise; copy_ narrows like the op
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
