"""A pointwise op whose second operand is a 0-d constant (`x * tensor(0.5)`: what freezing a
TorchScript module makes of a Python number, as in GPT-2's tanh GELU) takes the number itself
(`x * 0.5`, the `.Scalar` overload). A 0-d tensor and a number take part in type promotion the
same way (neither sets the result's dtype beyond its category), so the result is the same; but
the pointwise fusion only fuses numbers, not weights, so without this GPT-2 loaded from a `.pt`
file fused none of its 12 GELUs. A pass that reads weights."""

from __future__ import annotations

import dataclasses

import torch

from ..ir import WEIGHT, Graph, Ref
from .substitute import read_weights, rebuild

# the `.Tensor` overloads that have a `.Scalar` twin with the same arguments otherwise
SCALAR_TWIN = {"aten::mul.Tensor": "aten::mul.Scalar", "aten::add.Tensor": "aten::add.Scalar",
               "aten::sub.Tensor": "aten::sub.Scalar", "aten::div.Tensor": "aten::div.Scalar"}
COMMUTES = frozenset({"aten::mul.Tensor"})


def inline_scalar_constants(graph: Graph, weights: dict[str, torch.Tensor]) -> tuple[Graph, dict[str, torch.Tensor]]:
    """Each op of SCALAR_TWIN whose second operand (or, for mul, either) is a 0-d float or integer
    weight, and whose other operand has a dimension, becomes its `.Scalar` twin on that number."""
    ops, changed = [], False
    for op in graph.ops:
        number = _number(graph, op, weights, 1)
        args = op.args
        if number is None and op.target in COMMUTES and len(args) == 2:
            number = _number(graph, op, weights, 0)
            args = (args[1], args[0])
        if number is None:
            ops.append(op)
            continue
        ops.append(dataclasses.replace(op, target=SCALAR_TWIN[op.target], args=(args[0], number), kwargs=()))
        changed = True
    if not changed:
        return graph, weights
    result = rebuild(graph, ops)
    return read_weights(result, weights)


def _number(graph: Graph, op, weights, at: int) -> float | int | None:
    """The Python number of the 0-d weight `op` reads at argument `at`, where the rewrite holds."""
    if op.target not in SCALAR_TWIN or len(op.args) != 2 or op.mutates or len(op.outputs) != 1 \
            or op.kwargs not in ((), (("alpha", 1),)):  # an alpha of 1 is the twin's default: it goes
        return None
    other, constant = op.args[1 - at], op.args[at]
    if not (isinstance(other, Ref) and isinstance(constant, Ref)):
        return None
    x, c = graph.values[other.id], graph.values[constant.id]
    if c.kind != WEIGHT or c.spec.shape != () or not x.spec.shape:
        return None
    tensor = weights[c.name]
    if tensor.dtype.is_complex or tensor.dtype == torch.bool:
        return None
    return tensor.item()
