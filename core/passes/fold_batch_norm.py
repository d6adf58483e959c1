"""Inference graphs: a batch norm whose input is a convolution that nothing else reads is folded
into that convolution's weight and bias, as torch's FoldFrozenConvBatchnorm (`torch.jit.freeze`)
does for TorchScript; the folded tensors are named `<conv>.weight_fused_bn`, `<conv>.bias_fused_bn`.
A pass that rewrites weights: it takes and returns them beside the graph."""

from __future__ import annotations

import dataclasses

import torch

from ..ir import WEIGHT, Graph, Ref
from .edit import Edit
from .rewrite import Facts
from .substitute import read_weights

_CONVOLUTIONS = {"aten::conv1d", "aten::conv2d", "aten::conv3d", "aten::convolution"}


def fold_batch_norm(graph: Graph, weights: dict[str, torch.Tensor]) -> tuple[Graph, dict[str, torch.Tensor]]:
    """Fold each inference `aten::batch_norm` (running statistics, not training) into the 2-D, 1-D
    or 3-D convolution (not transposed) before it, when every parameter of both is a weight."""
    facts = Facts(graph)
    weights = dict(weights)
    ops = list(graph.ops)
    edit, dropped = Edit(graph), set()
    for bn in graph.ops:
        found = _foldable(graph, bn, facts, weights)
        if found is None:
            continue
        conv, (w, b, gamma, beta, mean, var) = found
        scale = torch.rsqrt(var + bn.args[7])
        scale = scale * gamma if gamma is not None else scale
        bias = (b if b is not None else torch.zeros_like(mean)) - mean
        bias = bias * scale + (beta if beta is not None else 0)
        weight = (w * scale.reshape(-1, *[1] * (w.dim() - 1))).to(w.dtype)
        base = graph.values[conv.args[1].id].name.removesuffix(".weight")
        new = [edit.weight(weights, f"{base}.weight_fused_bn", weight, before=conv.outputs[0]),
               edit.weight(weights, f"{base}.bias_fused_bn", bias.to(w.dtype), before=conv.outputs[0])]
        args = (*conv.args[:1], Ref(new[0].id), Ref(new[1].id), *conv.args[3:])
        ops[conv.id] = dataclasses.replace(conv, args=args)
        edit.replace_uses(bn.outputs[0], conv.outputs[0])
        dropped.add(bn.id)
    if not edit.changed:
        return graph, weights
    folded = edit.finish([op for op in ops if op.id not in dropped])
    return read_weights(folded, weights)


def _foldable(graph: Graph, bn, facts: Facts, weights):
    """(the convolution, its weight and bias and the norm's weight, bias, mean and variance as
    tensors) if `bn` folds into the op before it, else None."""
    if bn.target.split(".")[0] != "aten::batch_norm" or len(bn.args) < 8 or bn.args[5] is not False \
            or bn.kwargs or len(bn.outputs) != 1 or not isinstance(bn.args[0], Ref):
        return None
    x = graph.values[bn.args[0].id]
    if x.producer is None or facts.only_reader(x.id) != bn.id or x.alias_of is not None:
        return None
    conv = graph.ops[x.producer]
    if conv.target.split(".")[0] not in _CONVOLUTIONS or conv.kwargs or conv.mutates or len(conv.args) < 3 \
            or len(conv.outputs) != 1 or (conv.target.startswith("aten::convolution.") and conv.args[6]):
        return None

    def tensor(arg):
        if arg is None:
            return None
        value = graph.values[arg.id] if isinstance(arg, Ref) else None
        return weights[value.name] if value is not None and value.kind == WEIGHT else False

    found = [tensor(a) for a in (conv.args[1], conv.args[2], *bn.args[1:5])]
    if any(t is False for t in found) or found[0] is None or found[4] is None or found[5] is None \
            or not found[0].is_floating_point():
        return None
    return conv, found
