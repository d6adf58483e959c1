"""Every graph: an advanced index that only spreads a tensor's dims apart becomes a view.

Hugging Face's masks spread a padding mask [batch, keys] to [batch, 1, 1, keys] by indexing it
with constant ranges, `mask[arange(B)[:, None, None, None], arange(T)[None, None, None, :]]`:
PyTorch runs a gather kernel for what is a view of the same elements. An `index.Tensor` whose
index tensors are constants (weights, after `fold_constants`), one per dim of a contiguous input,
each a range over its dim laid along one axis of the result, those axes in the dims' order, is
that view, and becomes `view(x, shape)`.
"""

from __future__ import annotations

import dataclasses

import torch

from ..ir import WEIGHT, Graph, Op, Ref, contiguous_strides
from .substitute import rebuild

INDEX = "aten::index.Tensor"
VIEW = "aten::view.default"


def index_as_view(graph: Graph, weights: dict[str, torch.Tensor]) -> tuple[Graph, dict[str, torch.Tensor]]:
    """Each index that only spreads its input's dims apart (see the module docstring) as a view."""
    shapes = {op.id: shape for op in graph.ops if (shape := _spread(graph, weights, op)) is not None}
    if not shapes:
        return graph, weights
    values, ops = list(graph.values), []
    for op in graph.ops:
        if op.id not in shapes:
            ops.append(op)
            continue
        x, shape = op.args[0], shapes[op.id]
        ops.append(dataclasses.replace(op, target=VIEW, args=(x, shape), kwargs=()))
        out = values[op.outputs[0]]
        spec = dataclasses.replace(out.spec, strides=contiguous_strides(shape), offset=graph.values[x.id].spec.offset)
        values[out.id] = dataclasses.replace(out, spec=spec, alias_of=graph.root(x.id))
    return rebuild(graph, ops, values=values), weights


def _spread(graph: Graph, weights: dict[str, torch.Tensor], op: Op) -> tuple[int, ...] | None:
    """The shape of the view `op` is, or None where it is not one."""
    if op.target != INDEX or op.kwargs or op.mutates or len(op.outputs) != 1 or len(op.args) != 2 \
            or not isinstance(op.args[0], Ref) or not isinstance(op.args[1], tuple):
        return None
    x, indices = graph.values[op.args[0].id], op.args[1]
    result = graph.values[op.outputs[0]].spec
    if len(indices) != len(x.spec.shape) or not x.spec.is_contiguous or result.dtype != x.spec.dtype \
            or graph.values[op.outputs[0]].alias_of is not None:
        return None
    axes = []
    for n, index in zip(x.spec.shape, indices):
        if not isinstance(index, Ref) or graph.values[index.id].kind != WEIGHT:
            return None
        t = weights.get(graph.values[index.id].name)
        if t is None or t.dtype != torch.int64 or t.dim() > len(result.shape):
            return None
        sizes = (1,) * (len(result.shape) - t.dim()) + tuple(t.shape)
        spread = [a for a, m in enumerate(sizes) if m != 1]
        if n == 1 and not spread and int(t.reshape(-1)[0]) == 0:
            continue  # a dim of one element: it lands on no axis of its own
        if len(spread) != 1 or sizes[spread[0]] != n or not torch.equal(t.reshape(-1), torch.arange(n)):
            return None
        axes.append((spread[0], n))
    if [a for a, _ in axes] != sorted({a for a, _ in axes}):
        return None  # two dims on one axis, or out of order: a gather, not a view
    shape = [1] * len(result.shape)
    for a, n in axes:
        shape[a] = n
    return tuple(shape) if tuple(shape) == tuple(result.shape) else None
