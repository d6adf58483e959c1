"""Inference graphs: a batch norm that no convolution absorbed (`fold_batch_norm` runs first)
becomes what it computes, a per-channel multiply and add, `x * scale + shift`, with scale and shift
worked out here from its running statistics, weight and bias (`<bn>.scale`, `<bn>.shift`, shaped
(1, C, 1, ...)). The pointwise fusion then takes the two into one kernel with their neighbours:
densenet's pre-activation batch norm -> relu becomes one generated kernel instead of cuDNN's batch
norm and a relu (torch.compile does the same). A pass that rewrites weights."""

from __future__ import annotations

import dataclasses

import torch

from ..ir import ACTIVATION, WEIGHT, Graph, Op, Ref, TensorSpec
from ..ops import types
from .edit import Edit
from .substitute import binary_spec, free_name, read_weights

_META = torch.device("meta")


def affine_batch_norm(graph: Graph, weights: dict[str, torch.Tensor]) -> tuple[Graph, dict[str, torch.Tensor]]:
    """Each inference `aten::batch_norm` (running statistics, not training) whose weight, bias,
    mean and variance are weights and whose input has a channel dimension becomes mul then add."""
    weights = dict(weights)
    ops: list[Op] = []
    edit = Edit(graph)
    for op in graph.ops:
        stats = _affine(graph, op, weights)
        if stats is None:
            ops.append(op)
            continue
        x = graph.values[op.args[0].id]
        out = graph.values[op.outputs[0]]
        scale, shift = stats
        shape = (1, x.spec.shape[1], *[1] * (len(x.spec.shape) - 2))
        base = _base_name(graph, op)
        new = []
        for tensor, suffix in ((scale, "scale"), (shift, "shift")):
            tensor = tensor.to(types.DTYPES[x.spec.dtype]).reshape(shape).contiguous()
            name = free_name(f"{base}.{suffix}", weights)
            weights[name] = tensor
            new.append(edit.value(WEIGHT, TensorSpec(shape, x.spec.dtype), name, before=out.id))
        mul = binary_spec("aten::mul.Tensor", x.spec, new[0].spec)
        product = edit.value(ACTIVATION, mul, f"{out.name}_scaled", before=out.id)
        ops.append(edit.op("aten::mul.Tensor", (op.args[0], Ref(new[0].id)), (), (product,), op.source))
        ops.append(dataclasses.replace(op, target="aten::add.Tensor", args=(Ref(product.id), Ref(new[1].id)),
                                       kwargs=(("alpha", 1),)))
        edit.change(dataclasses.replace(out, spec=binary_spec("aten::add.Tensor", mul, new[1].spec)))
    if not edit.changed:
        return graph, weights
    result = edit.finish(ops)
    return read_weights(result, weights)


def _affine(graph: Graph, op: Op, weights) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(scale, shift) of an inference batch norm this pass rewrites, else None."""
    if op.target != "aten::batch_norm.default" or len(op.args) < 8 or op.args[5] is not False or op.kwargs \
            or len(op.outputs) != 1 or op.mutates or not isinstance(op.args[0], Ref):
        return None
    x = graph.values[op.args[0].id]
    if len(x.spec.shape) < 2 or x.spec.dtype not in ("float32", "float16", "bfloat16", "float64"):
        return None

    def tensor(arg):
        if arg is None:
            return None
        value = graph.values[arg.id] if isinstance(arg, Ref) else None
        return weights[value.name].double() if value is not None and value.kind == WEIGHT else False

    gamma, beta, mean, var = (tensor(a) for a in op.args[1:5])
    if any(t is False for t in (gamma, beta, mean, var)) or mean is None or var is None:
        return None
    channels = x.spec.shape[1]
    if any(t is not None and tuple(t.shape) != (channels,) for t in (gamma, beta, mean, var)):
        return None
    scale = torch.rsqrt(var + float(op.args[7]))
    scale = scale * gamma if gamma is not None else scale
    shift = (beta if beta is not None else torch.zeros_like(mean)) - mean * scale
    return scale, shift


def _base_name(graph: Graph, op: Op) -> str:
    """`features.norm0` from the batch norm's weight or mean ('features.norm0.running_mean')."""
    for arg in (op.args[1], op.args[3]):
        if isinstance(arg, Ref):
            name = graph.values[arg.id].name
            return name.rsplit(".", 1)[0] if "." in name else name
    return graph.values[op.outputs[0]].name
