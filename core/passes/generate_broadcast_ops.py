"""Inference graphs: an elementwise op that fusion left alone, and that broadcasts an operand to
its result, becomes a fused op of one node, so that the runtime runs it as a generated kernel.

The squeeze-and-excitation multiply of efficientnet_b0 (`x * scale`, x [N, C, H, W], scale
[N, C, 1, 1]) was such an op before `bias_into_broadcast`: its one tensor operand is read by the
pooling too, and its scale came from a convolution whose result is smaller than the product, so
no group took it in.
Alone, it ran as PyTorch's elementwise kernel, which reads a broadcast operand through a general
offset calculator, one element at a time; the generated kernel reads it by one division of the
flat index, in either layout. efficientnet_b0 has 16 of them.

Ops whose operands all have the result's shape stay as they are: PyTorch's kernel for those is
vectorised and as fast as a generated one. A selection between two numbers (`where.Scalar`) is
generated always: PyTorch fills a tensor with each number first, three kernels for one. Runs
after `fuse_pointwise`, on what it left.
"""

from __future__ import annotations

from ..ir import Graph
from ..ops import fusion
from .fuse_pointwise import elementwise
from .rewrite import Facts, fuse


def generate_broadcast_ops(graph: Graph) -> Graph:
    """Each lone elementwise op with a broadcast tensor operand becomes a one-node fused op."""
    facts = Facts(graph)
    lone = []
    for op in graph.ops:
        result = elementwise(graph, facts, op)
        if result is None:
            continue
        if result.spec.dtype not in fusion.FLOATS:
            continue  # an and of booleans: a generated kernel stores floating results only
        shapes = [graph.values[op.args[pos].id].spec.shape for pos in fusion.POINTWISE[op.target]]
        if any(shape != result.spec.shape for shape in shapes) or op.target == "aten::where.Scalar":
            lone.append([op.id])
    return fuse(graph, lone)
