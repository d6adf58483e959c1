"""Product pairs: the elementwise op after a float32 product (bias and GELU, a residual add) in the
product's kernel (`kernels/gemm.Gemm.with_epilogue`)."""

from __future__ import annotations

from typing import Sequence

import torch

from ...ir import Graph, Op, Ref
from ...ops import arguments
from ..kernels.fused import FusedKernel
from ..kernels.gemm import Gemm
from ..placed.placement import PlacedOp
from ..placed.substitutes import RESHAPES
from .common import body_of_call, elementwise_kernel, next_on_stream, readers_of, views_of


def product_pairs(graph: Graph, placed: Sequence[PlacedOp], order: Sequence[int], stream_of: Sequence[int],
                  waits: Sequence, heads: set[int] = frozenset()
                  ) -> dict[int, tuple[PlacedOp, FusedKernel, tuple | None]]:
    """product op -> (the elementwise op that reads its result, the kernel that would run that op,
    (the view's value, its shape) where that op reads the result through a reshape, else None)
    for each float32 product (`gemm.applies`; not a small linear, `pooled_conv.SmallLinear`) whose
    result only that op reads, of the same shape, where it is the next op issued on the same stream
    and waits for nothing, and is not the first of a norm pair (`heads`: its kernel then takes the
    layer norm after it). Between the two there may be one view that reshapes the result, dense,
    into the op's shape (`dense_reshape`: GPT-2's `Conv1D` multiplies rows, then views them as
    [batch, tokens, features]), issued between them and waiting for nothing. `run` runs each pair
    as one kernel where the product runs as nimble's; the product's own buffer is then never written."""
    following = next_on_stream(order, stream_of)
    readers, outputs, aliased = readers_of(graph)
    views = views_of(graph)
    pairs = {}
    for p in products(placed):
        value = p.op.outputs[0]
        second, shape, between, through = following.get(p.op.id), graph.values[value].spec.shape, set(), None
        if second is not None and not waits[second] and dense_reshape(graph, graph.ops[second], value, views):
            seen = graph.ops[second].outputs[0]
            shape, between, through = graph.values[seen].spec.shape, {second}, (seen, graph.values[seen].spec.shape)
            second = following.get(second)
        elif value in aliased:
            continue
        if second is None or second in heads or waits[second] or readers.get(value, set()) != {second} | between \
                or value in outputs or len(graph.ops[second].outputs) != 1 \
                or graph.values[graph.ops[second].outputs[0]].spec.shape != shape:
            continue
        kernel = elementwise_kernel(graph, placed[second])
        if kernel is not None:
            pairs[p.op.id] = (placed[second], kernel, through)
    return pairs


def products(placed: Sequence[PlacedOp]) -> list[PlacedOp]:
    """The ops whose substitute is nimble's float32 product (`gemm.Gemm`; not a small linear's kernel)."""
    return [p for p in placed if isinstance(p.substitute, Gemm) and len(p.op.outputs) == 1]


def dense_reshape(graph: Graph, op: Op, value: int, views: dict[int, set[int]]) -> bool:
    """Whether `op` views dense `value` in another shape, dense, and is its only view: the same
    elements in the same order, so a kernel that writes `value` in row-major order writes the
    view's elements in row-major order too."""
    if op.target not in RESHAPES or op.mutates or len(op.outputs) != 1 or not op.args \
            or not isinstance(op.args[0], Ref) or op.args[0].id != value:
        return False
    seen, spec = graph.values[op.outputs[0]].spec, graph.values[value].spec
    return views.get(value) == {op.outputs[0]} and seen.is_contiguous and seen.offset == 0 \
        and spec.is_contiguous and spec.offset == 0 and seen.numel == spec.numel


def run(issue, p: PlacedOp, args, out: torch.Tensor) -> bool:
    """The product `p` and the elementwise op after it as one kernel; False, with nothing run,
    where it cannot."""
    second, kernel, through = issue.pairs.products[p.op.id]
    into = issue.views.get(second.op.outputs[0])
    if into is None:
        return False
    issue.env[p.op.outputs[0]] = held = out  # the second op's operand, bound before its producer returns
    if through is not None:  # read through a reshape (issued between the two; it binds the same view)
        seen, shape = through
        issue.env[seen] = held = out.view(shape)
    body = body_of_call(second.op, *arguments.op_arguments(second.op, issue.env, issue.device))
    operands, _ = kernel.operands(body)
    if not p.substitute.with_epilogue(args, out, body, operands, into, held):  # a gemm.Gemm
        return False
    issue.written.add(second.op.id)
    return True
