"""A pointwise op whose second operand is a 0-d constant (`x * tensor(0.5)`: what freezing a
TorchScript module makes of a Python number, as in GPT-2's tanh GELU) takes the number itself
(`x * 0.5`, the `.Scalar` overload). A 0-d tensor and a number take part in type promotion the
same way (neither sets the result's dtype beyond its category), so the result is the same; but
the pointwise fusion only fuses numbers, not weights, so without this GPT-2 loaded from a `.pt`
file fused none of its 12 GELUs. A pass that reads weights.

The same for an operand filled on the device with one number (`fill(empty_like(x), 1)`, which
torch's trace of SiLU's backward computes `1 - sigmoid(x)` from): where it has the shape and
dtype of the other operand and of the result, the op takes the number, and the filled tensor
(its bytes written and read once per step: 752 MiB for efficientnet_b0 at 224 px, batch 32)
goes with its last reader. `c - y` becomes `(-y) + c`, which rounds alike."""

from __future__ import annotations

import dataclasses

import torch

from ..ir import ACTIVATION, WEIGHT, Graph, Ref
from .edit import Edit
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
    if changed:
        graph, weights = read_weights(rebuild(graph, ops), weights)
    return _inline_filled(graph), weights


FILL = "aten::fill.Scalar"


def _inline_filled(graph: Graph) -> Graph:
    """Each op of SCALAR_TWIN with an operand filled with one number (see the module) takes the
    number; `c - y` becomes `neg(y) + c`."""
    filled = {op.outputs[0]: op.args[1] for op in graph.ops
              if op.target == FILL and len(op.args) == 2 and not op.kwargs and not op.mutates
              and isinstance(op.args[1], (int, float)) and not isinstance(op.args[1], bool)}
    if not filled:
        return graph
    edit = Edit(graph)
    ops = []
    for op in graph.ops:
        at = _filled_at(graph, op, filled)
        if at is None:
            ops.append(op)
            continue
        number, other = filled[op.args[at].id], op.args[1 - at]
        if op.target == "aten::sub.Tensor" and at == 0:  # c - y: neg(y) + c
            result = graph.values[op.outputs[0]]
            negated = edit.value(ACTIVATION, result.spec, f"{result.name}_neg", before=result.id)
            ops.append(edit.op("aten::neg.default", (other,), (), (negated,), op.source))
            ops.append(dataclasses.replace(op, target="aten::add.Scalar", args=(Ref(negated.id), number), kwargs=()))
        else:
            ops.append(dataclasses.replace(op, target=SCALAR_TWIN[op.target], args=(other, number), kwargs=()))
    return edit.finish(ops)


def _filled_at(graph: Graph, op, filled: dict) -> int | None:
    """Which operand of `op` is a filled tensor the op can take as a number, or None."""
    if not _twin_fits(op):
        return None
    out = graph.values[op.outputs[0]].spec
    for at in (1, 0) if op.target != "aten::div.Tensor" else (1,):
        constant, other = op.args[at], op.args[1 - at]
        if isinstance(constant, Ref) and isinstance(other, Ref) and constant.id in filled \
                and graph.values[constant.id].alias_of is None \
                and graph.values[constant.id].spec.shape == graph.values[other.id].spec.shape == out.shape \
                and graph.values[constant.id].spec.dtype == graph.values[other.id].spec.dtype == out.dtype:
            return at
    return None


def _twin_fits(op) -> bool:
    """Whether `op` is a SCALAR_TWIN op its twin can replace once an operand is a number: two
    operands, one result, no mutation, no alpha but 1 (the twin's default: it goes)."""
    return op.target in SCALAR_TWIN and len(op.args) == 2 and not op.mutates and len(op.outputs) == 1 \
        and op.kwargs in ((), (("alpha", 1),))


def _number(graph: Graph, op, weights, at: int) -> float | int | None:
    """The Python number of the 0-d weight `op` reads at argument `at`, where the rewrite holds."""
    if not _twin_fits(op):
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
