"""Training graphs (the last of `train.JOINT_PASSES`): each layer norm takes in the residual join
before it, and each layer norm's backward the add after it, as `nimble::add_layer_norm` and
`nimble::layer_norm_backward_add` (`ops/add_norm.py`), which `runtime/kernels/step_norms` runs as
one kernel each on CUDA. In vit_b_16's step these are 24 joins of the residual stream (float32,
one operand through a transpose) and the 24 adds that gather its gradient: 48 elementwise kernels
that each read two maps and write one, 0.87 ms of a 14 ms bf16 step at batch 32 on an H200; with
them taken in, the step went from 12.08 to 11.60 ms (2026-12-01, `tools/train_step_ab.py --without
fuse_layer_norm_adds`).

A join `s = add(a, b)` (two maps of s's shape, no alpha, s float32) is taken where a
`native_layer_norm` reads s and every other reader of s (or of a view of it) comes after that norm: the fused op goes
where the norm was, writes s and the norm's three results, and the add goes.

A `native_layer_norm_backward` asking for all three gradients is taken where its input gradient
dx is read by one add alone, `add(dx, r)` or `add(r, dx)` (no alpha; dx, r and the sum all float32
and of one shape), and everything that reads the weight's or bias's gradient comes after that add:
the fused op goes where the add was (its operands all exist there) and the backward goes.

Nothing changes where an op involved writes in place. The sums are those of the ops replaced, in
float32, so results are unchanged (addition in the other order is the same IEEE sum).
"""

from __future__ import annotations

import dataclasses

from ..ir import Graph, Op, Ref
from ..ops import add_norm
from .substitute import rebuild

ADD = "aten::add.Tensor"
NORM = "aten::native_layer_norm.default"
NORM_BACKWARD = "aten::native_layer_norm_backward.default"


def fuse_layer_norm_adds(graph: Graph) -> Graph:
    readers = graph.readers()  # of each value or a view of it
    ops = graph.ops
    replaced: dict[int, Op] = {}
    dropped: set[int] = set()
    values = list(graph.values)
    for op in ops:
        if op.target == NORM and len(op.args) == 5 and not op.kwargs and isinstance(op.args[0], Ref) \
                and not op.mutates:
            s = op.args[0].id
            join = ops[values[s].producer] if values[s].producer is not None else None
            if join is not None and join.id not in dropped and _plain_add(graph, join) \
                    and all(o > op.id for o in readers[s] if o != op.id):
                dropped.add(join.id)
                replaced[op.id] = Op(op.id, add_norm.ADD_LAYER_NORM, (*join.args, *op.args[1:]), (),
                                     (s, *op.outputs), source=op.source)
                values[s] = dataclasses.replace(values[s], producer=op.id)
        elif op.target == ADD and _plain_add(graph, op) and op.id not in replaced:
            taken = _gradient_add(graph, ops, readers, op)
            if taken is not None and taken[0].id not in dropped and taken[0].id not in replaced:
                back, residual = taken
                dropped.add(back.id)
                replaced[op.id] = Op(op.id, add_norm.LAYER_NORM_BACKWARD_ADD, (*back.args[:7], residual), (),
                                     (op.outputs[0], *back.outputs[1:]), source=back.source)
                for v in back.outputs[1:]:
                    values[v] = dataclasses.replace(values[v], producer=op.id)
    if not replaced:
        return graph
    kept = [replaced.get(op.id, op) for op in ops if op.id not in dropped]
    return rebuild(graph, kept, values=values)


def _plain_add(graph: Graph, op: Op) -> bool:
    """`op` is add(a, b) of two maps of its result's shape, alpha 1, a float32 result, in no place."""
    if op.target != ADD or len(op.args) != 2 or not all(isinstance(a, Ref) for a in op.args) \
            or any(k != "alpha" or v != 1 for k, v in op.kwargs) or op.mutates or len(op.outputs) != 1:
        return False
    out = graph.values[op.outputs[0]]
    return out.spec.dtype == "float32" and out.alias_of is None \
        and all(graph.values[a.id].spec.shape == out.spec.shape for a in op.args)


def _gradient_add(graph: Graph, ops, readers: dict[int, set[int]], add: Op) -> tuple[Op, Ref] | None:
    """(the layer norm backward whose input gradient `add` alone reads, the add's other operand),
    where the two can be one op at the add's place."""
    for k, a in enumerate(add.args):
        other = add.args[1 - k]
        producer = graph.values[a.id].producer
        back = ops[producer] if producer is not None else None
        if back is None or back.target != NORM_BACKWARD or len(back.args) != 8 or back.kwargs or back.mutates \
                or not isinstance(back.args[7], (list, tuple)) or list(back.args[7]) != add_norm.EVERY_GRADIENT \
                or len(back.outputs) != 3 \
                or back.outputs[0] != a.id or other == a:
            continue
        if readers.get(a.id) != {add.id} or graph.values[a.id].spec.dtype != "float32" \
                or graph.values[other.id].spec.dtype != "float32":
            continue
        if all(o > add.id for v in back.outputs[1:] for o in readers.get(v, ())):
            return back, other
    return None
