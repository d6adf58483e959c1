"""Training graphs only (`TrainStep` runs it after `stack_select_gradients`, before fusion): a stack
whose pieces were copied (cloned, viewed, cloned again) only to be stacked, and whose result is
copied again through views, becomes one stack of views of the pieces' sources.

    stack([view(clone(transpose(view(clone(dq))))), ...], 0) -> unsqueeze -> transpose -> squeeze -> clone
        ->  stack([permute(dq, (2, 0, 1, 3)), ...], 2) -> view

nn.MultiheadAttention's packed projection gets its gradient so in every layer of a transformer:
vit_b_16's step copied each of the query, key and value gradients twice, stacked them, and copied
the stack again through a transpose, 8 copies of 29 MiB at batch 32 in bf16 per layer where one
stack (3 reads and a write) gives the same bytes.

Taken where every op between a source and the stack is a view or a clone that only the next op
reads, the stack's result is read only by such a chain ending in one clone (or by nothing else
than its readers, when no clone follows), and the sources are dense. Whether the stack of views
gives the clone's bytes is not reasoned out from the ops but computed: the chains are replayed on
tensors holding each source element's own offset (`offsets`), and the positions of each piece in
the final tensor must be a strided view of its source, every element checked, or nothing changes.
Stacks of more than `REPLAYED` source elements are left as they are.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ..ir import ACTIVATION, Graph, Op, Ref, TensorSpec, contiguous_strides
from .edit import Edit
from .offsets import REPLAYED, VIEW, dense, emit, lookups, offsets, replay, strided, view_steps

STACK = "aten::stack.default"
CLONE = "aten::clone.default"
VIEWS = frozenset({"aten::view.default", "aten::transpose.int", "aten::permute.default", "aten::unsqueeze.default",
                   "aten::squeeze.dim", "aten::t.default", "aten::_unsafe_view.default"})


def stack_views(graph: Graph) -> Graph:
    known: dict = {}  # a transformer's layers repeat one stack: its placement is worked out once
    readers, producer, outputs, written = lookups(graph)
    edit = Edit(graph)
    dropped: set[int] = set()
    replaced: dict[int, Op] = {}
    for op in graph.ops:
        if op.target != STACK or op.id in dropped or len(op.args) != 2 or op.kwargs \
                or not isinstance(op.args[1], int) or not all(isinstance(a, Ref) for a in op.args[0]):
            continue
        found = _found(graph, op, readers, producer, outputs, written)
        if found is None:
            continue
        sources, before, after = found
        final = after[-1] if after else op
        key = (tuple(graph.values[v].spec for v in sources), op.args[1], *(
            tuple((o.target, repr(o.args[1:]), repr(o.kwargs)) for o in chain) for chain in (*before, after)))
        if key not in known:
            try:
                known[key] = _placed(graph, sources, before, op, after)
            except (RuntimeError, TypeError, ValueError, IndexError):  # a chain that does not replay so
                known[key] = None
        placed = known[key]
        if placed is None:
            continue
        dim, steps, shape = placed
        pieces = [emit(edit, graph, source, piece, final) for source, piece in zip(sources, steps)]
        for chain_op in (*[o for chain in before for o in chain], op, *after):
            dropped.add(chain_op.id)
        dropped.discard(final.id)
        for new in (o for ops, _ in pieces for o in ops):
            edit.insert_before(final.id, new)
        args = (tuple(Ref(ref) for _, ref in pieces), dim)
        result = graph.values[final.outputs[0]]
        if shape == result.spec.shape:
            replaced[final.id] = Op(final.id, STACK, args, (), final.outputs, (), (), final.source)
            continue
        # the pieces split a dimension (a source's two as one): stacked in the finer shape, then viewed
        stacked = edit.value(ACTIVATION, TensorSpec(shape, result.spec.dtype), f"{result.name}_stacked",
                             before=result.id)
        edit.insert_before(final.id, edit.op(STACK, args, (), (stacked,), final.source))
        edit.change(dataclasses.replace(result, alias_of=stacked.id))
        replaced[final.id] = Op(final.id, VIEW, (Ref(stacked.id), list(result.spec.shape)), (), final.outputs,
                                (), (), final.source)
    if not replaced:
        return graph
    return edit.finish([replaced.get(op.id, op) for op in graph.ops if op.id not in dropped or op.id in replaced])


def _found(graph: Graph, stack: Op, readers, producer, outputs, written):
    """(the pieces' sources, each piece's chain from its source, the chain after the stack) where
    the stack is one this pass takes, with at least one clone among the chains; else None.
    `written`: the storages some op writes in place (the new stack reads its sources later than
    the old chains did)."""
    before = []
    sources = []
    for ref in stack.args[0]:
        chain, v = [], ref.id
        while True:
            p = producer.get(v)
            if p is None or p.target not in VIEWS | {CLONE} or len(p.outputs) != 1 or p.mutates \
                    or not isinstance(p.args[0], Ref) or _only_reader(v, readers, outputs) is None:
                break
            chain.insert(0, p)
            v = p.args[0].id
        before.append(chain)
        sources.append(v)
    after, v = [], stack.outputs[0]
    while True:
        reader = _only_reader(v, readers, outputs)
        if reader is None or reader.target not in VIEWS | {CLONE} or len(reader.outputs) != 1 or reader.mutates \
                or not isinstance(reader.args[0], Ref) or reader.args[0].id != v:
            break
        after.append(reader)
        v = reader.outputs[0]
        if reader.target == CLONE:
            break
    if after and after[-1].target != CLONE:
        after = []  # views that end in no copy: the stack stays where it is, its pieces still change
    copies = sum(o.target == CLONE for chain in before for o in chain) + len(after and [after[-1]])
    final = graph.values[(after[-1] if after else stack).outputs[0]].spec
    if not copies or not final.is_contiguous or final.offset \
            or any(graph.values[s].kind != ACTIVATION or not dense(graph.values[s].spec)
                   or graph.root(s) in written for s in sources):
        return None
    return sources, before, after


def _only_reader(value: int, readers, outputs) -> Op | None:
    """The one op that reads `value`, if it is not a graph output (a view of it is read by the op
    that makes the view)."""
    found = readers.get(value, [])
    return found[0] if len(found) == 1 and value not in outputs else None


def _placed(graph: Graph, sources: list[int], before: list[list[Op]], stack: Op, after: list[Op]):
    """(the new stack's dimension, the ops that make each piece from its source (`offsets.view_steps`), the
    new stack's shape) where the final tensor is a stack of strided views of the sources, else None."""
    specs = [graph.values[s].spec for s in sources]
    spans = [1 + sum((n - 1) * s for n, s in zip(sp.shape, sp.strides or contiguous_strides(sp.shape)) if n > 0)
             for sp in specs]
    bases = [sum(spans[:i]) for i in range(len(spans))]
    if sum(spans) > REPLAYED:
        return None
    dtype = torch.int32
    with torch.no_grad():
        pieces = []
        for spec, base, chain in zip(specs, bases, before):
            t = offsets(spec, base, dtype)
            for o in chain:
                t = replay(o, t)
            pieces.append(t)
        final = torch.stack(pieces, stack.args[1])
        for o in after:
            final = replay(o, final)
    if tuple(final.shape) != graph.values[(after[-1] if after else stack).outputs[0]].spec.shape:
        return None
    n = len(sources)
    for dim in [d for d in range(final.dim()) if final.shape[d] == n]:
        pieces = [final.select(dim, i).to(torch.int64) - base for i, base in zip(range(n), bases)]
        factors = _factors(pieces)
        if factors is None:
            continue
        refined = [f for per in factors for f in per]
        views = [strided(p.reshape(refined), span) for p, span in zip(pieces, spans)]
        # each piece the whole of its source, from its first element
        steps = [view_steps(spec, v) for spec, v in zip(specs, views)
                 if v is not None and v[2] == 0 and math.prod(v[0]) == spec.numel]
        if len(steps) == n and all(s is not None for s in steps):
            at = sum(len(per) for per in factors[:dim])
            return at, steps, tuple(refined[:at]) + (n,) + tuple(refined[at:])
    return None


def _factors(pieces: list[torch.Tensor]) -> list[list[int]] | None:
    """Per dimension of the pieces, its sizes (outer to inner) split where the step between
    neighbouring offsets along it changes in any piece (a dimension that merged two of a source's,
    as attention's heads and head width), or None where such a split does not divide it."""
    out = []
    for k, size in enumerate(pieces[0].shape):
        cuts = set()  # inner sizes where some piece's step changes, as products from the innermost
        for g in pieces:
            line, inner = g.movedim(k, -1).reshape(-1, size)[0], 1
            while line.numel() > 1:
                steps = line[1:] - line[:-1]
                changed = (steps != steps[0]).nonzero()
                j = int(changed[0]) + 1 if changed.numel() else line.numel()
                if line.numel() % j:
                    return None
                inner *= j
                cuts.add(inner)
                line = line[::j]
        ordered = sorted(cuts | {size})
        if any(b % a for a, b in zip(ordered, ordered[1:])) or ordered[-1] != size:
            return None
        sizes = [b // a for a, b in zip([1] + ordered, ordered)]
        out.append(list(reversed(sizes)) or [size])
    return out
