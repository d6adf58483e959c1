"""Inference graphs: a cat whose one reader is a cat along the same dimension hands its parts to
that cat, as TorchScript's optimizations do (inception_v3's InceptionE blocks), so both frontends
give the same op graph."""

from __future__ import annotations

import dataclasses

from ..ir import Graph, Ref
from .rewrite import Facts
from .substitute import rebuild

_CAT = "aten::cat.default"


def flatten_concats(graph: Graph) -> Graph:
    """Splice the parts of every absorbed cat (one reader, a cat along the same dimension; not a
    graph output, not viewed) into the cat that reads it, and drop the absorbed cat."""
    facts = Facts(graph)
    absorbed = set()
    for op in graph.ops:
        dim = _dim(graph, op)
        if dim is None:
            continue
        for part in op.args[0]:
            if not isinstance(part, Ref) or graph.values[part.id].producer is None:
                continue
            inner = graph.ops[graph.values[part.id].producer]
            if _dim(graph, inner) == dim and facts.only_reader(part.id) == op.id:
                absorbed.add(inner.id)
    if not absorbed:
        return graph

    def parts(op):
        return tuple(p for a in op.args[0] for p in (
            parts(graph.ops[graph.values[a.id].producer]) if isinstance(a, Ref) and graph.values[a.id].producer
            in absorbed else (a,)))

    ops = [dataclasses.replace(op, args=(parts(op), *op.args[1:])) if _dim(graph, op) is not None else op
           for op in graph.ops if op.id not in absorbed]
    return rebuild(graph, ops)


def _dim(graph: Graph, op) -> int | None:
    """The dimension a cat op joins along, made non-negative, or None for any other op."""
    if op.target != _CAT or op.kwargs or op.mutates or len(op.outputs) != 1:
        return None
    dim = op.args[1] if len(op.args) > 1 else 0
    rank = len(graph.values[op.outputs[0]].spec.shape)
    return dim % rank if rank and isinstance(dim, int) else None
