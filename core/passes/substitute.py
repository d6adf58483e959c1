"""What the rewrite passes share: ops that read one value in place of another, and the graph
rebuilt from the ops a pass keeps."""

from __future__ import annotations

import dataclasses

from ..ir import WEIGHT, Graph, Op, Ref, TensorSpec, Value, map_refs, renumber, with_ordering_edges
from ..ops import arguments, targets, types


def substitute(op: Op, image) -> Op:
    """`op` reading and writing `image(id)` wherever it read or wrote value `id`."""
    def ref(r: Ref) -> Ref:
        return Ref(image(r.id))

    kwargs, mutates = tuple((k, map_refs(v, ref)) for k, v in op.kwargs), tuple(image(m) for m in op.mutates)
    return dataclasses.replace(op, args=map_refs(op.args, ref), kwargs=kwargs, mutates=mutates)


def rebuild(graph: Graph, ops: list[Op], same: dict[int, int] | None = None,
            values: list[Value] | None = None, added: dict[int, list[Value]] | None = None) -> Graph:
    """The graph of `ops` (the ops a pass kept, in order, with their old ids), where every use of a
    value in `same` (graph outputs and aliases included) is a use of its image. `values` replaces
    the graph's values (old ids); `added` places new values (ids past the old ones) just before the
    value they are keyed by. Values that no op, input or output uses any more are dropped, ids are
    made dense, and the ordering edges are worked out again."""
    same = same or {}

    def image(v: int) -> int:
        return same.get(v, v)

    ops = [dataclasses.replace(substitute(op, image), after=()) for op in ops]
    outputs = tuple(image(o) for o in graph.outputs)
    used = set(graph.inputs) | set(outputs)
    for op in ops:
        used.update(op.refs())
        used.update(op.outputs)
    kept = []
    for v in values if values is not None else graph.values:
        kept.extend((added or {}).get(v.id, ()))
        if v.id in used:
            kept.append(v if v.alias_of is None else dataclasses.replace(v, alias_of=image(v.alias_of)))
    return with_ordering_edges(renumber(kept, ops, graph.inputs, outputs))


def in_order(ops: list[Op], before: dict[int, list[Op]]) -> list[Op]:
    """`ops` with each op's new ops in `before` (op id -> ops) just before it."""
    return [new for op in ops for new in (*before.get(op.id, ()), op)]


def read_weights(graph: Graph, weights: dict) -> tuple[Graph, dict]:
    """`graph`, and of `weights` those it still reads (by name)."""
    names = {v.name for v in graph.values if v.kind == WEIGHT}
    return graph, {name: t for name, t in weights.items() if name in names}


def new_weight(weights: dict, name: str, tensor, value_id: int) -> Value:
    """Store `tensor` (made contiguous) in `weights` under `name`, or the first free name after
    it (`free_name`), and return the weight value `value_id` that reads it."""
    name = free_name(name, weights)
    weights[name] = tensor.contiguous()
    return Value(value_id, WEIGHT, TensorSpec(tuple(tensor.shape), types.dtype_name(tensor.dtype),
                                              tuple(weights[name].stride())), name)


def free_name(name: str, weights: dict) -> str:
    """`name`, or `name_1`, `name_2`, ...: the first that no weight has yet."""
    base, n = name, 1
    while name in weights:
        name, n = f"{base}_{n}", n + 1
    return name


ARITHMETIC = frozenset({"aten::add.Tensor", "aten::sub.Tensor", "aten::mul.Tensor"})


def binary_spec(target: str, a: TensorSpec, b: TensorSpec) -> TensorSpec:
    """The result of a broadcasting binary op on `a` and `b`, typed on the meta device (add, sub
    and mul as `elementwise_spec` works it out, without running one)."""
    if target in ARITHMETIC:
        return elementwise_spec(a, b)
    result = targets.resolve(target)(arguments.meta_tensor(a), arguments.meta_tensor(b))
    return TensorSpec(tuple(result.shape), types.dtype_name(result.dtype), tuple(result.stride()),
                      result.storage_offset())


def elementwise_spec(a: TensorSpec, b: TensorSpec) -> TensorSpec:
    """The result of add, sub or mul on `a` and `b` (neither zero-dimensional), worked out as
    torch's own meta function for them does (broadcast shapes, promoted dtype, and the output
    strides of `torch._prims_common.compute_elementwise_output_strides`, here on plain integers)
    but without running the op: a process's first meta add or mul imports torch._dynamo and
    sympy, 1.6 s on the CPU builder and 5 s on the GPU machine, most of densenet121's compile."""
    import torch

    x, y = arguments.meta_tensor(a), arguments.meta_tensor(b)
    if x.dim() == 0 or y.dim() == 0:  # a zero-dimensional operand promotes by category: torch's way
        result = targets.resolve("aten::mul.Tensor")(x, y)
        return TensorSpec(tuple(result.shape), types.dtype_name(result.dtype), tuple(result.stride()), 0)
    shape = broadcast(tuple(x.shape), tuple(y.shape))
    dtype = torch.promote_types(x.dtype, y.dtype)
    operands = [x.expand(shape), y.expand(shape)]
    perm = _physical_order(operands, shape)  # logical -> physical
    physical = [shape[p] for p in perm]
    strides, step = [0] * len(shape), 1
    for k in reversed(range(len(shape))):
        strides[perm[k]] = step
        step *= max(physical[k], 1)
    return TensorSpec(tuple(shape), types.dtype_name(dtype), tuple(strides), 0)


def _physical_order(operands, shape: tuple) -> list[int]:
    """`compute_elementwise_output_logical_to_physical_perm` on concrete strides."""
    ndim = len(shape)
    if ndim == 1:
        return [0]
    import torch

    contiguous = all(t.is_contiguous() for t in operands)
    channels_last = ndim == 4 and all(t.is_contiguous(memory_format=torch.channels_last) for t in operands)
    if contiguous and not channels_last:
        return list(range(ndim))
    if channels_last and not contiguous:
        return [0, *range(2, ndim), 1]

    def ge(p: int, q: int) -> bool:
        return True if q == 0 else False if p == 0 else p >= q or p % q == 0

    def should_swap(i: int, j: int) -> int:
        for t in operands:
            si, sj = t.stride()[i], t.stride()[j]
            if si == 0 or sj == 0:
                continue
            if si == sj:
                if ge(shape[j], shape[i]):
                    continue
                return 1
            if ge(sj, si):
                return -1
            if ge(si, sj):
                return 1
        return 0

    perm = list(reversed(range(ndim)))
    for i in range(1, ndim):
        dim1 = i
        for dim0 in reversed(range(i)):
            comparison = should_swap(perm[dim0], perm[dim1])
            if comparison > 0:
                perm[dim0], perm[dim1] = perm[dim1], perm[dim0]
                dim1 = dim0
            elif comparison < 0:
                break
    return list(reversed(perm))


def broadcast(a: tuple, b: tuple) -> tuple:
    """The broadcast of two shapes (ValueError where they do not broadcast)."""
    n = max(len(a), len(b))
    a, b = (1,) * (n - len(a)) + a, (1,) * (n - len(b)) + b
    if any(p != q and 1 not in (p, q) for p, q in zip(a, b)):
        raise ValueError(f"shapes {a} and {b} do not broadcast")
    return tuple(q if p == 1 else p for p, q in zip(a, b))
