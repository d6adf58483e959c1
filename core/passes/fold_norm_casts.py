"""Training graphs (in `train.JOINT_PASSES`, after `fuse_layer_norm_adds`): in a mixed-precision
step, a layer norm writes its result in the reduced dtype that the product after it reads, and its
backward reads the product's gradient in the reduced dtype, instead of a cast kernel each way.

Under autocast a layer norm computes in float32, and the linear after it casts the norm's result
down to bfloat16; in the backward the linear's gradient is cast up to float32 for the norm's
backward. vit_b_16's bf16 step casts so 48 maps of (32, 197, 768) a step, each a kernel that reads
one and writes another. With this pass the forward norm (`ops/add_norm`'s `dtype=`) rounds its
float32 result as it stores it, as the cast rounded it, and the backward widens the gradient as it
loads it (`runtime/kernels/step_norms` on CUDA; aten's ops and the cast elsewhere): the results
are the casts' own, bit for bit.

Taken where:
- forward: a float32 norm result (of `native_layer_norm` or `nimble::add_layer_norm`) that one
  plain cast to float16 or bfloat16 reads (the result itself, or a view of it laid out as the cast's
  result is) and nothing else reads but views; the result and its views take the cast's dtype, the
  cast's readers read them, and an aten norm becomes `nimble::layer_norm`;
- backward: a float32 gradient (of `native_layer_norm_backward` or
  `nimble::layer_norm_backward_add`) that is a plain cast's result (or a view of one), of a source
  laid out as that result, that nothing else reads but views; the norm's backward reads the
  source (an aten backward becomes `nimble::layer_norm_backward`).
Neither where the values involved are graph outputs or written in place.
"""

from __future__ import annotations

import dataclasses

from ..ir import Graph, Op, Ref, Special, contiguous_strides
from ..ops import add_norm
from .group_casts import cast_to
from .substitute import rebuild

NORM = "aten::native_layer_norm.default"
NORM_BACKWARD = "aten::native_layer_norm_backward.default"
REDUCED = ("float16", "bfloat16")
# norm op -> the position of its normalised result among its outputs
FORWARDS = {NORM: 0, add_norm.ADD_LAYER_NORM: 1}
BACKWARDS = {NORM_BACKWARD: add_norm.LAYER_NORM_BACKWARD, add_norm.LAYER_NORM_BACKWARD_ADD: add_norm.LAYER_NORM_BACKWARD_ADD}


def fold_norm_casts(graph: Graph) -> Graph:
    readers = graph.readers()  # root -> the ops that read it or a view of it
    outputs = set(graph.outputs)
    mutated = {graph.root(m) for op in graph.ops for m in op.mutates}
    aliases: dict[int, list[int]] = {}
    for v in graph.values:
        if v.alias_of is not None:
            aliases.setdefault(v.alias_of, []).append(v.id)
    values = list(graph.values)
    same: dict[int, int] = {}
    replaced: dict[int, Op] = {}
    dropped: set[int] = set()

    def views_only(root: int, but: set[int]) -> bool:
        """Every op that reads `root` or a view of it, but those of `but`, makes views of it."""
        return all(o in but or all(values[v].alias_of == root for v in graph.ops[o].outputs)
                   for o in readers.get(root, ()))

    def retyped(root: int, dtype: str) -> None:
        for v in (root, *aliases.get(root, ())):
            values[v] = dataclasses.replace(values[v], spec=dataclasses.replace(values[v].spec, dtype=dtype))

    for op in graph.ops:
        if op.mutates or op.id in replaced:
            continue
        if op.target in FORWARDS and len(op.outputs) > FORWARDS[op.target]:
            y = op.outputs[FORWARDS[op.target]]
            casts = [graph.ops[o] for o in readers.get(y, ()) if cast_to(graph, graph.ops[o]) in REDUCED]
            if len(casts) != 1 or values[y].spec.dtype != "float32" or values[y].alias_of is not None \
                    or not views_only(y, {casts[0].id}):
                continue
            cast = casts[0]
            read, made = values[cast.args[0].id], values[cast.outputs[0]]
            if {y, read.id, made.id} & outputs or {y, made.id} & mutated or not _laid_alike(read.spec, made.spec):
                continue
            dtype = made.spec.dtype
            kwargs = dict(op.kwargs)
            kwargs["dtype"] = Special("dtype", dtype)
            replaced[op.id] = dataclasses.replace(op, target=add_norm.LAYER_NORM if op.target == NORM else op.target,
                                                  kwargs=tuple(kwargs.items()))
            retyped(y, dtype)
            same[made.id] = read.id
            dropped.add(cast.id)
        elif op.target in BACKWARDS and op.args and isinstance(op.args[0], Ref):
            g = values[op.args[0].id]
            root = g.alias_of if g.alias_of is not None else g.id
            producer = values[root].producer
            cast = graph.ops[producer] if producer is not None else None
            if cast is None or cast.id in dropped or cast_to(graph, cast) != "float32" \
                    or values[cast.args[0].id].spec.dtype not in REDUCED or root in outputs or root in mutated \
                    or graph.root(cast.args[0].id) in mutated \
                    or any(a in outputs for a in aliases.get(root, ())) or not views_only(root, {op.id}):
                continue
            source = values[cast.args[0].id]
            if not _laid_alike(source.spec, values[root].spec) or source.spec.offset:
                continue
            retyped(root, source.spec.dtype)
            same[root] = source.id
            dropped.add(cast.id)
            replaced[op.id] = dataclasses.replace(op, target=BACKWARDS[op.target])
    if not replaced:
        return graph
    kept = [replaced.get(op.id, op) for op in graph.ops if op.id not in dropped]
    return rebuild(graph, kept, same=same, values=values)


def _laid_alike(a, b) -> bool:
    """The same shape, strides and offset (a cast that kept its source's layout)."""
    return tuple(a.shape) == tuple(b.shape) and a.offset == b.offset \
        and tuple(a.strides or contiguous_strides(a.shape)) == tuple(b.strides or contiguous_strides(b.shape))
