"""Every graph: an op that copies its input unchanged into a fresh contiguous buffer of the same
shape and dtype goes, and its readers read the input instead.

Models make such copies where a shape decides at run time whether work is needed: torchvision's
Swin pads each stage's map to a multiple of the window (`F.pad` by zero on every side at 224 x 224:
15 pads, each a kernel plus the copy into its buffer), and code calls `.contiguous()` or `.clone()`
on tensors that already are. Dropped here: `pad` (constant mode) and `constant_pad_nd` by zero on
every side, and `contiguous` and `clone` of a contiguous value. The copy stays where its result is a
graph output, where either side's storage is written in place (then the copy is what keeps them
apart), or where the input's layout is not contiguous (its readers may be views that need it).
"""

from __future__ import annotations

import torch

from ..ir import Graph, Op, Ref, Special
from .rewrite import Facts
from .substitute import rebuild

PADS = frozenset({"aten::pad.default", "aten::constant_pad_nd.default"})
COPIES = frozenset({"aten::contiguous.default", "aten::clone.default"})


def drop_identity_copies(graph: Graph) -> Graph:
    """The graph without its identity copies (see the module docstring)."""
    facts = Facts(graph)
    same: dict[int, int] = {}
    kept: list[Op] = []
    for op in graph.ops:
        source = _identity_of(graph, facts, op)
        if source is None:
            kept.append(op)
        else:
            same[op.outputs[0]] = same.get(source, source)
    return graph if not same else rebuild(graph, kept, same=same)


def _identity_of(graph: Graph, facts: Facts, op: Op) -> int | None:
    """The value `op` copies unchanged, or None."""
    if op.target not in PADS | COPIES or op.mutates or len(op.outputs) != 1 or not op.args \
            or not isinstance(op.args[0], Ref):
        return None
    if op.target in PADS:
        amounts = op.args[1] if len(op.args) > 1 else None
        # pad(input, pad, mode, value); constant_pad_nd(input, pad, value) has no mode, and the value
        # fills nothing where every amount is zero
        mode = "constant" if op.target == "aten::constant_pad_nd.default" \
            else op.args[2] if len(op.args) > 2 else dict(op.kwargs).get("mode", "constant")
        if not isinstance(amounts, (tuple, list)) or any(a != 0 for a in amounts) or mode not in ("constant", None):
            return None
    elif any(a is not None and not _contiguous_format(a) for a in op.args[1:]) \
            or any(not _contiguous_format(v) for k, v in op.kwargs if k == "memory_format"):
        return None
    source, result = graph.values[op.args[0].id], graph.values[op.outputs[0]]
    if result.id in facts.outputs or graph.root(source.id) in facts.mutated or result.id in facts.mutated \
            or result.alias_of is not None or source.spec.shape != result.spec.shape \
            or source.spec.dtype != result.spec.dtype:
        return None
    if not (source.spec.is_contiguous and result.spec.is_contiguous):
        return None
    return source.id


def _contiguous_format(value) -> bool:
    """A memory_format argument that keeps a contiguous tensor as it is."""
    return value is None or isinstance(value, Special) and value.kind == "memory_format" \
        and value.name in (str(torch.contiguous_format), str(torch.preserve_format))
