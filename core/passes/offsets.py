"""Views worked out by replaying them on offsets: a value's elements stood in for by their own
offsets from its first (`offsets`), ops replayed on those (`replay`), the result read back as a
strided view where it is one (`strided`), and such a view made again from allowlisted view ops
(`emit`). The passes that turn copies into views check their work so rather than reasoning it
out from the ops (`stack_views`, `drop_view_clones`).
"""

from __future__ import annotations

import torch

from ..ir import ACTIVATION, Graph, Op, Ref, TensorSpec, contiguous_strides, dense_layout
from ..ops import arguments, targets
from .edit import Edit

PERMUTE, VIEW, SELECT = "aten::permute.default", "aten::view.default", "aten::select.int"

# the most source elements a replay holds (int32 offsets, a few copies of them at once: about 1 GB
# of host memory at most); a larger value is left as it is (vit_b_16's stack at batch 128: 58 M)
REPLAYED = 2**26


def lookups(graph: Graph) -> tuple[dict[int, list[Op]], dict[int, Op], set[int], set[int]]:
    """(the ops that read each value, the op that makes each value, the graph's outputs, the
    storages some op writes in place): what a pass that turns copies into views looks up."""
    readers: dict[int, list[Op]] = {}
    for op in graph.ops:
        for r in set(op.refs()):
            readers.setdefault(r, []).append(op)
    producer = {v: op for op in graph.ops for v in op.outputs}
    return readers, producer, set(graph.outputs), {graph.root(m) for op in graph.ops for m in op.mutates}


def dense(spec: TensorSpec) -> bool:
    """Whether `spec` covers its span exactly (a permutation of a row-major layout)."""
    return dense_layout(spec.shape, spec.strides or contiguous_strides(spec.shape))


def offsets(spec: TensorSpec, base: int, dtype) -> torch.Tensor:
    """A CPU tensor of `spec`'s shape whose elements are `base` plus their offsets from the first."""
    strides = spec.strides or contiguous_strides(spec.shape)
    span = 1 + sum((n - 1) * s for n, s in zip(spec.shape, strides) if n > 0)
    return torch.arange(base, base + span, dtype=dtype).as_strided(spec.shape, strides, 0)


def replay(op: Op, x: torch.Tensor, rest: list | None = None) -> torch.Tensor:
    args = [x, *(rest if rest is not None else op.args[1:])]
    kwargs = {k: arguments.to_torch(v, {}, x.device) for k, v in op.kwargs}
    return targets.resolve(op.target, training=True)(*args, **kwargs)


def strided(g: torch.Tensor, span: int):
    """(shape, strides, offset) such that `g` (integer offsets) holds that strided view's offsets,
    every element compared, or None. Worked out in g's own dtype: no copy of it is made."""
    if g.numel() == 0:
        return None
    first = int(g.reshape(-1)[0])
    strides = []
    for k, size in enumerate(g.shape):
        if size == 1:
            strides.append(0)
            continue
        index = [0] * g.dim()
        index[k] = 1
        strides.append(int(g[tuple(index)]) - first)
    low = first + sum(min(0, (n - 1) * s) for n, s in zip(g.shape, strides))
    high = first + sum(max(0, (n - 1) * s) for n, s in zip(g.shape, strides))
    if low < 0 or high >= span:
        return None
    expected = torch.full((), first, dtype=g.dtype)
    for k, (size, stride) in enumerate(zip(g.shape, strides)):
        shape = [1] * g.dim()
        shape[k] = size
        expected = expected + (torch.arange(size, dtype=g.dtype) * stride).reshape(shape)
    if not torch.equal(expected.expand(g.shape), g):
        return None
    return tuple(g.shape), tuple(strides), first


def emit(edit: Edit, graph: Graph, source: int, steps: list, final: Op) -> tuple[list[Op], int]:
    """The ops of `steps` ((target, arguments after the input) each) on `source`, their values placed before `final`'s result, and
    the id of the last."""
    spec = graph.values[source].spec
    ops, ref = [], source
    root = graph.root(source)
    meta = arguments.meta_tensor(spec)
    for target, rest in steps:
        meta = targets.resolve(target)(meta, *rest)
        value = edit.value(ACTIVATION, TensorSpec(tuple(meta.shape), spec.dtype, tuple(meta.stride()),
                                                  meta.storage_offset()),
                           f"{graph.values[source].name}_piece", before=final.outputs[0], alias_of=root)
        ops.append(edit.op(target, (Ref(ref), *rest), (), (value,), final.source))
        ref = value.id
    return ops, ref


def view_steps(spec: TensorSpec, view) -> list | None:
    """The ops, as (target, arguments after the input), that make `view` (shape, strides, offset
    over the elements of a dense value of `spec`, as `strided` reads it back) from that
    value: a permute of its dimensions into memory order; a view into a row-major shape of the
    view's dimensions (by stride) and the gaps between them; a select of each gap at the view's
    offset; a permute into the view's own order; a view that adds its dimensions of one (each left
    out where it changes nothing). None where the view's dimensions overlap or do not nest."""
    shape, strides, offset = view
    kept = [k for k in range(len(shape)) if shape[k] != 1]
    by_stride = sorted(kept, key=lambda k: -strides[k])
    refined, gaps, outer = [], [], spec.numel
    for k in by_stride:
        size, stride = shape[k], strides[k]
        if stride <= 0 or outer % (size * stride):
            return None
        if outer // (size * stride) > 1:
            gaps.append(len(refined))
            refined.append(outer // (size * stride))
        refined.append(size)
        outer = stride
    if outer > 1:
        gaps.append(len(refined))
        refined.append(outer)
    digits, rest = [], offset
    for step in contiguous_strides(refined):
        digits.append(rest // step)
        rest %= step
    if rest or any(d for i, d in enumerate(digits) if i not in gaps):
        return None
    own = spec.strides or contiguous_strides(spec.shape)
    order = sorted(range(len(spec.shape)), key=lambda k: -own[k])
    steps = []
    if order != list(range(len(order))):
        steps.append((PERMUTE, [order]))
    if list(refined) != [spec.shape[k] for k in order]:
        steps.append((VIEW, [refined]))
    steps.extend((SELECT, [i, digits[i]]) for i in reversed(gaps))
    back = [by_stride.index(k) for k in kept]
    if back != list(range(len(back))):
        steps.append((PERMUTE, [back]))
    if len(kept) != len(shape):
        steps.append((VIEW, [list(shape)]))
    return steps
