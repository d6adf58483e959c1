"""Scatter pairs: the copy that reads a float32 product through views (Swin's window merge), whose
elements the product's kernel stores where the copy would put them (`kernels/gemm.Gemm.through`)."""

from __future__ import annotations

from typing import Sequence

import torch

from ...ir import ACTIVATION, Graph, Op, Ref
from ..base.settings import DEFAULT
from ..placed.placement import PlacedOp
from ..placed.substitutes import RESHAPES
from .copies import COPYING_READERS
from .common import next_on_stream, readers_of, views_of
from .product import products

VIEWS = frozenset({*RESHAPES, "aten::permute.default", "aten::transpose.int"})


def scatter_pairs(graph: Graph, placed: Sequence[PlacedOp], order: Sequence[int], stream_of: Sequence[int],
                  waits: Sequence, max_views: int = DEFAULT.max_views) -> dict[int, tuple[list[PlacedOp], PlacedOp]]:
    """product op -> (the views of its result, in issue order, the copy that reads the last) for
    each float32 product (`gemm.applies`; not a small linear) whose result is read only through a
    chain of 1 to `max_views` views (reshapes, permutations, transposes), each view the only reader
    and only view of the one before, ending in one copying op (`COPYING_READERS`) into a buffer of
    its own, where the views and the copy are the next ops on the product's stream and wait for
    nothing. Swin's window merge is this: the projection's rows [windows, 49, C] viewed as [B,
    h/7, w/7, 7, 7, C], permuted to [B, h/7, 7, w/7, 7, C] and reshaped (a copy) to [B, h, w, C].
    `run` has the product's kernel store each element where the copy would put it
    (`gemm.Gemm.through`); the copy then has nothing left to do, and the product's own buffer is
    never written. The memory plan holds the product's inputs until the copy
    (`memory.held_inputs`), whose buffer the kernel writes while other tiles still read them."""
    following = next_on_stream(order, stream_of)
    readers, outputs, _ = readers_of(graph)
    views = views_of(graph)
    pairs = {}
    for p in products(placed):
        root, chain = p.op.outputs[0], []
        value, at = root, p.op.id
        while True:
            nxt = following.get(at)
            if nxt is None or waits[nxt] or len(chain) > max_views:
                break
            op = graph.ops[nxt]
            if op.mutates or len(op.outputs) != 1 or not op.args or op.args[0] != Ref(value):
                break
            result = graph.values[op.outputs[0]]
            if op.target in COPYING_READERS and result.alias_of is None and result.kind == ACTIVATION:
                seen = {graph.ops[v].outputs[0] for v in chain}
                if chain and root not in outputs and readers.get(root) == {*chain, nxt} \
                        and views.get(root) == seen:
                    pairs[p.op.id] = ([placed[v] for v in chain], placed[nxt])
                break
            if op.target not in VIEWS or result.alias_of != root:
                break
            chain.append(nxt)
            value, at = op.outputs[0], nxt
    return pairs


def run(issue, p: PlacedOp, args, out: torch.Tensor) -> bool:
    """The product `p` stored straight where the copy that reads it through views puts each
    element; False, with nothing run, where it cannot. `out`, the product's own buffer, is never
    written: only the views, then the copy, read it."""
    chain, copy = issue.pairs.scatters[p.op.id]
    target = issue.views.get(copy.op.outputs[0])
    into = seen_back([v.op for v in chain], target, out) if target is not None else None
    if into is None or not p.substitute.through(args, out, into):  # a gemm.Gemm
        return False
    issue.written.add(copy.op.id)
    return True


def viewed(view: Op, t: torch.Tensor) -> torch.Tensor | None:
    """`t` through `view` (a reshape, permutation or transpose, as `VIEWS`), None for another op."""
    if view.target == "aten::permute.default" and len(view.args) == 2:
        return t.permute([d % t.dim() for d in view.args[1]])
    if view.target == "aten::transpose.int" and len(view.args) == 3:
        return t.transpose(view.args[1], view.args[2])
    if view.target in RESHAPES and len(view.args) == 2:
        return t.reshape(view.args[1])
    return None


def seen_back(chain: list[Op], target: torch.Tensor, out: torch.Tensor) -> torch.Tensor | None:
    """`target` (the dense buffer of a copy of `out` seen through the views `chain`) seen back
    through them, as far as strides can: a tensor whose elements, in row-major order, are where
    the copy puts `out`'s elements in row-major order. Walking back, a permutation is undone; a
    reshape keeps row-major order, so where strides cannot undo one, every view before it must
    be a reshape too, and the walk stops there. None where the views or buffers do not fit."""
    if target.dtype != out.dtype or target.device != out.device or target.numel() != out.numel():
        return None
    shapes = [torch.empty(out.shape, device="meta")]
    for view in chain:
        seen = viewed(view, shapes[-1])
        if seen is None:
            return None
        shapes.append(seen)
    seen = target
    if tuple(seen.shape) != tuple(shapes[-1].shape):
        if not seen.is_contiguous():
            return None
        seen = seen.view(shapes[-1].shape)
    for k in range(len(chain) - 1, -1, -1):
        view = chain[k]
        if view.target == "aten::permute.default":
            dims = [d % seen.dim() for d in view.args[1]]
            seen = seen.permute(sorted(range(len(dims)), key=dims.__getitem__))
        elif view.target == "aten::transpose.int":
            seen = seen.transpose(view.args[1], view.args[2])
        else:
            try:
                seen = seen.view(shapes[k].shape)
            except RuntimeError:
                return seen if all(v.target in RESHAPES for v in chain[:k]) else None
    return seen
