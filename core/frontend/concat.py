"""Concatenation flattening: a cat whose one reader is a cat along the same dimension hands its
parts to that cat, as TorchScript's optimizations do (inception_v3's InceptionE blocks), so both
frontends give the same op graph."""

from __future__ import annotations

import torch


def _concat_dim(node) -> int | None:
    """The dimension an aten.cat node joins along, made non-negative, or None."""
    if node.op != "call_function" or node.target is not torch.ops.aten.cat.default:
        return None
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    rank = node.meta["val"].dim() if isinstance(node.meta.get("val"), torch.Tensor) else None
    return None if rank is None else dim % rank


def nested_concats(graph) -> set:
    """The cat nodes whose one reader is a cat along the same dimension: that cat takes their
    parts directly, as TorchScript's optimizations do (inception_v3's InceptionE blocks)."""
    absorbed = set()
    for node in graph.nodes:
        dim = _concat_dim(node)
        if dim is None:
            continue
        for part in node.args[0]:
            if isinstance(part, torch.fx.Node) and len(part.users) == 1 and _concat_dim(part) == dim:
                absorbed.add(part)
    return absorbed


class _Flat:
    """A stand-in for a cat node whose absorbed parts are replaced by their own parts."""

    def __init__(self, node, parts):
        self.target, self.meta, self.name = node.target, node.meta, node.name
        self.args, self.kwargs = (parts, *node.args[1:]), node.kwargs


def flat_concat(node, absorbed):
    def parts(n):
        return [p for a in n.args[0] for p in (parts(a) if a in absorbed else [a])]

    return _Flat(node, parts(node))
