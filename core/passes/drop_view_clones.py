"""Training graphs only (`TrainStep` runs it after `stack_views`, before fusion): a clone whose
result only views read becomes, for each op that takes one of those views, the same view of the
clone's source, where it is one.

nn.MultiheadAttention splits its packed projection so:

    proj = proj.unflatten(-1, (3, E)).unsqueeze(0).transpose(0, -2).squeeze(-2).contiguous()  # a copy
    q = proj[0].view(L, B * H, D).transpose(0, 1).view(B, H, L, D)     # and k, v: attention's inputs

The copy (three maps of a layer's width: 29 MiB per layer of vit_b_16 at batch 32 in bf16, 0.43 ms
of its step on an H200) is there so that the views after it are views; attention takes its query,
key and value through their strides, and reads them so again in the backward. Here q, k and v
become views of the projection itself (a view to (L, B, 3, H, D), a select, a permute), and the
copy goes. A clone read directly by another op (a transposed map copied to be added) becomes the
view it copied.

Whether a view of the source gives the clone's elements is not reasoned out from the ops but
computed, as `stack_views` does it (`offsets`): the source's element offsets are replayed through
the chain to the clone and the views after it, each value handed to another op must read back as
a strided view of the source (`offsets.strided`), and the ops that make it from the source must
give that view (shape, strides and offset, on the meta device), or nothing changes. Taken where the source is a dense
activation no op writes in place, every op between it and the clone and after the clone is a view
of VIEWS with one input, and no value of the chain after the clone is a graph output.
"""

from __future__ import annotations

import torch

from ..ir import ACTIVATION, Graph, Op
from ..ops import arguments, targets
from .edit import Edit
from .offsets import REPLAYED, dense, emit, lookups, offsets, replay, strided, view_steps

CLONE = "aten::clone.default"
VIEWS = frozenset({"aten::view.default", "aten::_unsafe_view.default", "aten::transpose.int", "aten::permute.default",
                   "aten::unsqueeze.default", "aten::squeeze.dim", "aten::t.default", "aten::select.int",
                   "aten::slice.Tensor", "aten::detach.default", "aten::alias.default"})


def drop_view_clones(graph: Graph) -> Graph:
    readers, producer, outputs, written = lookups(graph)
    edit = Edit(graph)
    dropped: set[int] = set()
    views: dict[int, list[Op]] = {}  # clone's id -> the views of its source that replace it, issued there
    known: dict = {}  # a transformer's layers repeat one clone: its views are worked out once
    for op in graph.ops:
        found = _found(graph, op, readers, producer, outputs, written)
        if found is None:
            continue
        source, before, after, handed = found
        key = _key(graph, source, before, op, after, handed)
        if key not in known:
            made = _made(graph, source, before, op, after, handed)
            known[key] = None if made is None else [made[v] for v in handed]
        if known[key] is None:
            continue
        for value, steps in zip(handed, known[key]):
            ops, ref = emit(edit, graph, source, steps, op)
            views.setdefault(op.id, []).extend(ops)
            edit.replace_uses(value, ref)
        dropped.update(o.id for o in (op, *after))
        # the views that led only to the clone go too
        for o in reversed(before):
            if all(r.id in dropped for v in o.outputs for r in readers.get(v, ())):
                dropped.add(o.id)
    if not dropped:
        return graph
    return edit.finish([new for op in graph.ops
                        for new in (*views.get(op.id, ()), *((op,) if op.id not in dropped else ()))])


def _found(graph: Graph, clone: Op, readers, producer, outputs, written):
    """(the source, the views from it to the clone's input, the views after the clone in graph
    order, the values of the clone and after it that other ops read) where the clone is one this
    pass takes; else None."""
    if clone.target != CLONE or len(clone.outputs) != 1 or clone.mutates or not clone.args \
            or not hasattr(clone.args[0], "id"):
        return None
    before, v = [], clone.args[0].id
    source = graph.root(v)
    while v != source:
        p = producer.get(v)
        if p is None or p.target not in VIEWS or len(p.outputs) != 1 or not hasattr(p.args[0], "id"):
            return None
        before.insert(0, p)
        v = p.args[0].id
    spec = graph.values[source].spec
    if graph.values[source].kind != ACTIVATION or not dense(spec) or spec.offset or source in written \
            or spec.numel > REPLAYED:
        return None
    result = clone.outputs[0]
    after, tree, waiting = [], {result}, [result]
    while waiting:  # the views of the clone's result, and of those
        for op in readers.get(waiting.pop(), ()):
            if op.target in VIEWS and len(op.outputs) == 1 and not op.mutates and len(set(op.refs())) == 1 \
                    and op.outputs[0] not in tree:
                after.append(op)
                tree.add(op.outputs[0])
                waiting.append(op.outputs[0])
    after.sort(key=lambda o: o.id)
    if result in written or any(v in outputs for v in tree):
        return None
    viewing = {o.id for o in after}
    handed = [v for v in sorted(tree) if any(r.id not in viewing for r in readers.get(v, ()))]
    return (source, before, after, handed) if handed else None


def _key(graph: Graph, source: int, before: list[Op], clone: Op, after: list[Op], handed: list[int]) -> tuple:
    """What `_made` depends on: the source's spec and each op of the chains with its arguments
    but its input (an op after the clone by where its input is among the clone and the views
    after it), and which of those the handed values are."""
    tree = [clone.outputs[0], *(o.outputs[0] for o in after)]
    return (graph.values[source].spec, tuple((o.target, repr(o.args[1:]), repr(o.kwargs)) for o in (*before, clone)),
            tuple((o.target, repr(o.args[1:]), repr(o.kwargs), tree.index(o.args[0].id)) for o in after),
            tuple(tree.index(v) for v in handed))


def _made(graph: Graph, source: int, before: list[Op], clone: Op, after: list[Op], handed: list[int]):
    """Value -> the ops that make it from the source (`view_steps`), for each value that other
    ops take, where every one is a strided view of the source and those ops replay to the same
    offsets; else None."""
    spec = graph.values[source].spec
    span = spec.numel
    try:
        with torch.no_grad():
            t = offsets(spec, 0, torch.int32)
            for o in before:
                t = replay(o, t)
            env = {clone.outputs[0]: replay(clone, t)}
            for o in after:
                env[o.outputs[0]] = replay(o, env[o.args[0].id])
            made = {}
            for v in handed:
                want = env[v]
                if tuple(want.shape) != graph.values[v].spec.shape:
                    return None
                view = strided(want, span) if want.numel() else None
                steps = view_steps(spec, view) if view is not None else None
                if steps is None:
                    return None
                got = arguments.meta_tensor(spec)
                for target, rest in steps:
                    got = targets.resolve(target)(got, *rest)
                if (tuple(got.shape), tuple(got.stride()), got.storage_offset()) != view:
                    return None
                made[v] = steps
    except (RuntimeError, TypeError, ValueError, IndexError, KeyError):  # a chain that does not replay so
        return None
    return made
