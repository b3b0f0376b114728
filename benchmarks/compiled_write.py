#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""What the capture costs inside a ``torch.compile``'d graph, by the form of its write, in one run.

    python benchmarks/compiled_write.py [--tokens 64 512 4096] [--layers 8] [--rows 8192] [--rounds 7]

A stand-in for a compiled MoE forward's routing (``make bench``'s model shapes: hidden 512, 64 experts, top-8,
float32): per layer a gate matmul, softmax, top-k, renormalised weights and a pointwise use of weights and ids,
compiled as vLLM compiles (``dynamic=True``: a symbolic token count; every guard dropped), each layer's ids
recorded into one ``[rows, layers, top_k]`` int16 buffer by one of:
  none              no capture: the base;
  plugin            the plugin's ``LayerRecorder`` as traced: with a native build the ``record_topk_ids`` custom op
                    (its C++ CPU kernel, called between Inductor's fused kernels); without one the same rule as
                    ATen ops (``ops/_in_graph.py``: ``index_put_`` into the buffer, which Inductor fuses);
  op                the custom op whatever the install (without a native build its CPU kernel is the Python host
                    kernel, reached back through the dispatcher);
  slice             the rule as a slice assignment (``buffer[:n, layer] = where(valid, ids, -1)``, ``errors +=``);
  slice-unchecked   the slice assignment alone (upstream vLLM's form, ``buffer[:n, layer] = ids``).
Before timing, every variant's buffer is compared with the ids of an eager run (a write the compiler dropped fails
the run), and the calls of the code Inductor generated are counted per forward: its fused kernels, the ATen
kernels it calls (matmul, top-k) and custom ops. The same fused kernels with and without the op mean the op splits
no fusion: it is one more call per layer; the in-graph forms add no call at all (what they cost is in the fused
kernels' loops: a slice assignment rewrites every row of the buffer, ``--rows`` shows it). Timing: every variant's
compiled function in turn, the order rotated each round, the best block's per-call time (other work on a shared
machine only ever adds time); printed per token count: µs per forward, the capture's cost per layer
((variant - none) / layers) and none/variant.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
import types
from collections import Counter
from collections.abc import Callable

import torch
from torch._inductor.utils import run_and_get_code

from vllm_ascend_routing.ops import OUT_DTYPE, LayerRecorder, kernel_backend
from vllm_ascend_routing.ops._library import record_topk_ids_op

HIDDEN, EXPERTS, TOP_K = 512, 64, 8
INVALID_ID = -1

Capture = Callable[[int, torch.Tensor], None]


def skip_all_guards(entries: list[object]) -> list[bool]:
    return [False for _ in entries]


class Router(torch.nn.Module):
    """The routing part of ``layers`` MoE layers, each layer's ids handed to ``capture``."""

    def __init__(self, layers: int, capture: Capture | None) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.gates = torch.nn.Parameter(torch.randn(layers, HIDDEN, EXPERTS, generator=generator) / HIDDEN**0.5)
        self.capture = capture

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in range(self.gates.shape[0]):
            weights, ids = torch.topk(torch.softmax(x @ self.gates[layer], dim=-1), TOP_K, dim=-1)
            if self.capture is not None:
                self.capture(layer, ids)
            weights = weights / weights.sum(dim=-1, keepdim=True)
            x = x * weights.sum(dim=-1, keepdim=True) + ids.to(x.dtype).mean(dim=-1, keepdim=True) * 1e-3
        return x


def plugin_capture(out: torch.Tensor, errors: torch.Tensor) -> Capture:
    recorders = [LayerRecorder(out, layer, EXPERTS, errors) for layer in range(out.shape[1])]
    return lambda layer, ids: recorders[layer](ids)


def op_capture(out: torch.Tensor, errors: torch.Tensor) -> Capture:
    return lambda layer, ids: record_topk_ids_op(ids, out, layer, EXPERTS, errors)


def slice_capture(out: torch.Tensor, errors: torch.Tensor) -> Capture:
    def capture(layer: int, ids: torch.Tensor) -> None:
        valid = (ids >= 0) & (ids < EXPERTS)
        out[: ids.shape[0], layer] = torch.where(valid, ids, INVALID_ID).to(OUT_DTYPE)
        errors.add_((~valid).sum())

    return capture


def unchecked_slice_capture(out: torch.Tensor, errors: torch.Tensor) -> Capture:
    def capture(layer: int, ids: torch.Tensor) -> None:
        out[: ids.shape[0], layer] = ids

    return capture


VARIANTS: dict[str, Callable[[torch.Tensor, torch.Tensor], Capture] | None] = {
    "none": None,
    "plugin": plugin_capture,
    "op": op_capture,
    "slice": slice_capture,
    "slice-unchecked": unchecked_slice_capture,
}


KERNEL_CALL = re.compile(r"^\s+(?:\w+ = )?(cpp_fused_\w+|extern_kernels\.\w+|torch\.ops\.(\w+)\.\w+(?:\.default)?)\(")


def kernel_calls(code: list[str]) -> Counter[str]:
    """Calls per forward in Inductor's generated wrapper code: fused kernels, ATen kernels, custom ops."""
    calls: Counter[str] = Counter()
    for source in code:
        for line in source.splitlines():
            match = KERNEL_CALL.match(line)
            if match is None:
                continue
            if match.group(1).startswith("cpp_fused_"):
                calls["fused"] += 1
            elif match.group(2) in (None, "aten"):
                calls["aten"] += 1
            else:
                calls[match.group(2)] += 1
    return calls


def reference_ids(router: Router, x: torch.Tensor) -> torch.Tensor:
    """``[tokens, layers, top_k]`` ids of an eager run of the same weights."""
    seen: list[torch.Tensor] = []
    eager = Router(router.gates.shape[0], lambda layer, ids: seen.append(ids.clone()))
    eager.load_state_dict(router.state_dict())
    with torch.no_grad():
        eager(x)
    return torch.stack(seen, dim=1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[64, 512, 4096])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--rows", type=int, default=8192, help="the buffer's rows (vLLM: max batched tokens)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--seconds", type=float, default=0.1, help="per timed block")
    args = parser.parse_args()
    if max(args.tokens) > args.rows:
        parser.error("--tokens must not exceed --rows")

    torch.manual_seed(0)
    buffers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    compiled: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {}
    for name, make in VARIANTS.items():
        out = torch.zeros(args.rows, args.layers, TOP_K, dtype=OUT_DTYPE)
        errors = torch.zeros(1, dtype=torch.int64)
        buffers[name] = (out, errors)
        router = Router(args.layers, None if make is None else make(out, errors)).eval()
        # Its own code object: with no guards, Dynamo would hand every variant the first one compiled for ``forward``.
        code = Router.forward.__code__.replace(co_name=f"forward_{name.replace('-', '_')}")
        router.forward = types.MethodType(types.FunctionType(code, Router.forward.__globals__), router)  # type: ignore[method-assign]
        # Without guards, as vLLM compiles (its wrapper drops them all): guard evaluation is not the capture's cost.
        compiled[name] = torch.compile(router, dynamic=True, options={"guard_filter_fn": skip_all_guards})

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; op kernels: {kernel_backend()}")
    shape = f"[{args.rows}, {args.layers}, {TOP_K}]"
    print(f"{args.layers} layers, top-{TOP_K} of {EXPERTS}, hidden {HIDDEN}, buffer {shape}")
    failed = False
    with torch.no_grad():
        x = torch.randn(max(args.tokens), HIDDEN)
        for name, fn in compiled.items():  # the first call compiles: its generated code is counted
            _, generated = run_and_get_code(fn, x[: min(args.tokens)])
            counted = ", ".join(f"{what} {count}" for what, count in sorted(kernel_calls(generated).items()))
            print(f"{name:>17}: calls per forward: {counted}")
        for n in sorted(set(args.tokens)):
            want = reference_ids(Router(args.layers, None), x[:n]).to(OUT_DTYPE)
            for name, (out, errors) in buffers.items():
                if name == "none":
                    continue
                out.zero_()
                compiled[name](x[:n])
                if not torch.equal(out[:n], want) or int(errors) != 0:
                    print(f"FAIL {name} at {n} tokens: compiled write != eager ids", file=sys.stderr)
                    failed = True

        print(f"{'tokens':>7} {'variant':>17} {'us/forward':>11} {'capture us/layer':>17} {'none/variant':>13}")
        for n in args.tokens:
            xn = x[:n]
            samples: dict[str, list[float]] = {name: [] for name in compiled}
            names = list(compiled)
            for round_index in range(args.rounds):
                order = names[round_index % len(names) :] + names[: round_index % len(names)]
                for name in order:
                    fn = compiled[name]
                    for _ in range(3):
                        fn(xn)
                    calls, start = 0, time.perf_counter()
                    while (elapsed := time.perf_counter() - start) < args.seconds:
                        fn(xn)
                        calls += 1
                    samples[name].append(elapsed / calls * 1e6)
            base = min(samples["none"])
            for name in names:
                per_call = min(samples[name])
                per_layer = (per_call - base) / args.layers
                print(f"{n:>7} {name:>17} {per_call:>11.1f} {per_layer:>17.2f} {base / per_call:>13.3f}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
