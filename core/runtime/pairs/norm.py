"""Norm pairs: a layer norm in the kernel of the elementwise op whose result it reads."""

from __future__ import annotations

from typing import Sequence

import torch

from ...ir import Graph
from ...ops import arguments
from ..kernels.fused import FusedKernel
from ..kernels.generated import NormAfter
from ..placed.placement import PlacedOp
from .common import after, body_of_call, elementwise_kernel


def norm_pairs(graph: Graph, placed: Sequence[PlacedOp], order: Sequence[int], stream_of: Sequence[int],
               waits: Sequence) -> dict[int, tuple[PlacedOp, bool, FusedKernel]]:
    """elementwise op -> (the layer norm that reads its result, whether anything else reads that
    result, the kernel that runs both) for each elementwise op (fused or alone) whose result a
    layer norm reads, where the norm is the next op issued on the same stream and waits for
    nothing. `run` runs each pair as one kernel (`FusedKernel.with_norm`), or as two where the
    tensors do not fit it."""
    norms = [op for op in graph.ops if op.target == "aten::layer_norm.default" and len(op.args) >= 5]
    return after(graph, placed, order, stream_of, waits, norms, elementwise_kernel)


def run(issue, p: PlacedOp, args, kwargs, out: torch.Tensor) -> bool:
    """The elementwise op `p` and the layer norm after it in one kernel; False, with nothing run,
    where it cannot. `issue` is the `PairedRun` issuing them."""
    norm, store, kernel = issue.pairs.norms[p.op.id]
    norm_out = issue.views.get(norm.op.outputs[0])
    if norm_out is None:
        return False
    body = body_of_call(p.op, args, kwargs)
    issue.env[p.op.outputs[0]] = out  # the norm's input, bound before its producer returns
    (_, shape, weight, bias, eps, *_), _ = arguments.op_arguments(norm.op, issue.env, issue.device)
    if not kernel.with_norm(body, out, NormAfter(tuple(shape), weight, bias, eps, norm_out, store)):
        return False
    issue.written.add(norm.op.id)
    return True
