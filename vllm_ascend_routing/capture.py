# SPDX-License-Identifier: Apache-2.0
"""What one MoE layer records per forward, independent of vLLM generation and backend."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vllm_ascend_routing.ops import eager_view, record_topk_ids_op, storage_limit
from vllm_ascend_routing.ops._library import check_arguments
from vllm_ascend_routing.parallel import RankLayout, local_topk_ids
from vllm_ascend_routing.sentinel import Sentinel

# Narrowest signed storage that holds every id of any MoE in use; -1 marks an invalid id.
CAPTURE_DTYPE = torch.int16
_ID_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class LayerCapture:
    """Records one layer's logical top-k ids, token ``i`` into ``buffer[i, layer_id]``.

    ``buffer`` is allocated before the first forward and never reallocated, so compiled graphs (and
    CUDA/ACL graphs) that bake its address in stay valid.
    """

    buffer: torch.Tensor  # [max_tokens, num_hidden_layers, top_k] int16
    layer_id: int
    num_experts: int
    errors: torch.Tensor  # [1] int64, out-of-range ids seen (shared by a model's layers)
    # Data parallel / token-split layouts: the router may see other ranks' tokens or a TP shard.
    layout: RankLayout | None = None

    # Eager mode on the CPU: ``buffer[:, layer_id]``, written directly (``ops.eager_view``; ``None`` on other
    # devices, where the op's native kernel or the reference must run), and the ids it accepts: [0, _limit).
    _view: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    _limit: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.layout is None:
            object.__setattr__(self, "_view", eager_view(self.buffer, self.layer_id))
            object.__setattr__(self, "_limit", min(self.num_experts, storage_limit(self.buffer.dtype)))

    def __call__(self, topk_ids: torch.Tensor) -> None:
        """Runs once per MoE layer per step. No Python argument checks: buffer and layer were validated at bind
        time, and the fake kernel checks shapes when compiled.

        Eager (not traced) on the CPU, in-range ids are written here, with no dispatcher round trip into the
        op's Python kernel (issue #19). Measured per call in the eager vLLM 0.30.0 engine (8 MoE layers, 64
        requests, median): the op with its NumPy host kernel 25 us, this 12 us, vLLM's own capture (one slice
        assignment) 11 us. Written with the ATen ops the forward already runs (hot in the caches): NumPy's
        reduction and strided cast-copy, though faster in a hot microbenchmark, cost 18 us there. The bounds
        are read from CPU memory: nothing to wait for. Out-of-range ids go to the op, which stores them as
        invalid and counts them. Whenever ``torch.compile`` traces this (``is_compiling()`` is a constant
        there), or the ids are not a plain tensor (fake/functional tensors of other tracers), the op is
        emitted: a custom op mutating ``out`` is what keeps the write in compiled graphs and graph captures.
        """
        if not torch.compiler.is_compiling():
            view = self._view
            if (
                view is not None
                and type(topk_ids) is torch.Tensor
                and topk_ids.is_cpu
                and topk_ids.dtype in _ID_DTYPES
                and topk_ids.dim() == 2
                and topk_ids.shape[1] == view.shape[1]
            ):
                n = topk_ids.shape[0]
                if n == 0:
                    return
                low, high = torch.aminmax(topk_ids)
                if low.item() >= 0 and high.item() < self._limit:
                    view[:n].copy_(topk_ids)  # more rows than the buffer's raise; copy_ narrows like the op
                    return
        if self.layout is None:
            record_topk_ids_op(topk_ids, self.buffer, self.layer_id, None, self.num_experts, self.errors)
            return
        layout = self.layout
        record_local_topk_ids_op(
            topk_ids,
            self.buffer,
            self.layer_id,
            self.num_experts,
            self.errors,
            layout.dp_rank,
            layout.tp_size,
            layout.split_over_tp,
        )


@dataclass(frozen=True)
class PreparedCapture:
    """A target model's capture, bound at load time: one buffer, one error counter, all MoE layers, and the
    always-on check of each step's rows."""

    buffer: torch.Tensor  # [max_tokens, num_hidden_layers, top_k] int16, zeroed
    errors: torch.Tensor
    num_experts: int  # routed experts
    bound_layers: tuple[int, ...]  # the layer ids bound, ascending
    id_range: int  # ids recorded as valid: [0, id_range) (routed experts, then zero experts)
    sentinel: Sentinel
    # Layers left to vLLM's own binder (``backends.upstream``), bound when vLLM hands over its capturer; their
    # layer ids are in ``bound_layers`` (the always-on check covers their rows).
    deferred: tuple[torch.nn.Module, ...] = ()

    @classmethod
    def bound(
        cls,
        buffer: torch.Tensor,
        errors: torch.Tensor,
        num_experts: int,
        bound_layers: tuple[int, ...],
        id_range: int | None = None,
        deferred: tuple[torch.nn.Module, ...] = (),
    ) -> PreparedCapture:
        layers = tuple(sorted(set(bound_layers)))
        ids = num_experts if id_range is None else id_range
        sentinel = Sentinel.for_capture(buffer, errors, layers, ids)
        return cls(buffer, errors, num_experts, layers, ids, sentinel, deferred)

    @property
    def num_bound_layers(self) -> int:
        return len(self.bound_layers)


def new_error_counter(device: torch.device | str) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int64, device=device)


def check_id_range(num_ids: int) -> None:
    """Refuse an id range (experts, zero experts included) the capture dtype cannot hold."""
    if num_ids > storage_limit(CAPTURE_DTYPE):
        raise ValueError(
            f"{num_ids} expert ids do not fit the capture dtype {CAPTURE_DTYPE} "
            f"(at most {storage_limit(CAPTURE_DTYPE)})."
        )


def new_capture_buffer(
    num_tokens: int, num_layers: int, top_k: int, num_experts: int, device: torch.device | str
) -> torch.Tensor:
    """A zeroed ``[num_tokens, num_layers, top_k]`` buffer; refuses an expert count it cannot hold."""
    check_id_range(num_experts)
    return torch.zeros((num_tokens, num_layers, top_k), dtype=CAPTURE_DTYPE, device=device)


# ``record_local_topk_ids``: place the ids by this step's parallel layout (``parallel.place``), then record.
# A custom op so that torch.compile treats it as opaque: the placement reads host-side counts from vLLM's
# forward context, which a traced graph must not bake in (vLLM's CPU MoE is traced, not a custom op).
_LIBRARY = torch.library.Library("vllm_ascend_routing", "FRAGMENT")
_LIBRARY.define(
    "record_local_topk_ids(Tensor topk_ids, Tensor(a!) out, int layer_id, int? num_experts, Tensor(b!) errors, "
    "int dp_rank, int tp_size, bool split_over_tp) -> ()"
)


def _record_local_topk_ids(
    topk_ids: torch.Tensor,
    out: torch.Tensor,
    layer_id: int,
    num_experts: int | None,
    errors: torch.Tensor,
    dp_rank: int,
    tp_size: int,
    split_over_tp: bool,
) -> None:
    ids = local_topk_ids(topk_ids, RankLayout(dp_rank, tp_size, split_over_tp), out.shape[0])
    record_topk_ids_op(ids, out, layer_id, None, num_experts, errors)


_LIBRARY.impl("record_local_topk_ids", _record_local_topk_ids, "CompositeExplicitAutograd")
record_local_topk_ids_op = torch.ops.vllm_ascend_routing.record_local_topk_ids.default


@torch.library.register_fake("vllm_ascend_routing::record_local_topk_ids")
def _(
    topk_ids: torch.Tensor,
    out: torch.Tensor,
    layer_id: int,
    num_experts: int | None,
    errors: torch.Tensor,
    dp_rank: int,
    tp_size: int,
    split_over_tp: bool,
) -> None:
    # The routed count may exceed ``out``'s rows (all DP ranks' tokens): only the static arguments are checked.
    check_arguments(topk_ids[:0], out, layer_id, None, errors)
