"""Training graphs (the last of `train.JOINT_PASSES`): a matrix that a GEMM reads or writes, whose
rows are not a multiple of 16 bytes long, is laid out with rows padded to the next multiple, in a
buffer of its own; its views follow. Only the strides change: the elements and the ops are the
trace's.

cuBLAS runs its fast kernels only where each matrix's rows start 16 bytes apart. Swin's windows of
49 tokens make attention scores of 49 x 49 (rows of 98 bytes in bf16), and so every batched
product of its attention, forward and backward, ran as cutlass's `align1` kernels: 72 of them,
1.8 ms of swin_t's 15.7 ms of kernels in a bf16 step at batch 32 (H200, torch 2.11,
`tools/train_step_kernels.py`). Inductor pads such strides too.

Laid out so: a planned activation (not an input or output of the step, nor a view) of a floating
dtype, contiguous as traced, whose last dimension is not a whole number of 16 bytes, written by a
GEMM, a cast, a clone or a fused op (each writes any strides it is given), that a GEMM reads or
writes, directly or through its views, where every view of it is one that takes the new strides
(`ops/views.replay`: a view that would merge the padded rows with the next dimension does not).
"""

from __future__ import annotations

import dataclasses

from ..ir import ACTIVATION, ITEMSIZE, Graph
from ..ops import fusion
from ..ops.types import DTYPES
from ..ops.views import replay, view_trees

ALIGN = 16  # bytes between the starts of a matrix's rows that cuBLAS's fast kernels take
GEMMS = frozenset({"aten::bmm.default", "aten::mm.default", "aten::baddbmm.default", "aten::addmm.default"})
WRITERS = GEMMS | {"aten::_to_copy.default", "aten::clone.default", fusion.FUSED}
FLOATS = ("float32", "float16", "bfloat16")


def pad_gemm_rows(graph: Graph) -> Graph:
    trees = view_trees(graph)
    readers = graph.readers()
    outputs = set(graph.outputs)
    specs = {}
    for v in graph.values:
        spec = v.spec
        if v.kind != ACTIVATION or v.alias_of is not None or v.producer is None or v.id in outputs \
                or spec.dtype not in FLOATS or len(spec.shape) < 2 or not spec.is_contiguous or spec.offset \
                or graph.ops[v.producer].target not in WRITERS or not spec.numel:
            continue
        row = spec.shape[-1] * ITEMSIZE[spec.dtype]
        tree = trees.get(v.id, ())
        family = {v.id} | {o for op in tree for o in op.outputs}
        gemm = graph.ops[v.producer].target in GEMMS or any(graph.ops[r].target in GEMMS for r in readers.get(v.id, ()))
        if row % ALIGN == 0 or not gemm or family & outputs:
            continue
        strides = _padded(spec.shape, -(-row // ALIGN) * ALIGN // ITEMSIZE[spec.dtype])
        env = replay(spec.shape, strides, DTYPES[spec.dtype], v.id, tree)
        if env is None:
            continue
        specs[v.id] = dataclasses.replace(spec, strides=strides)
        for o in family - {v.id}:
            t = env[o]
            specs[o] = dataclasses.replace(graph.values[o].spec, strides=tuple(t.stride()), offset=t.storage_offset())
    if not specs:
        return graph
    return dataclasses.replace(graph, values=tuple(dataclasses.replace(v, spec=specs[v.id]) if v.id in specs else v
                                                   for v in graph.values))


def _padded(shape: tuple, row: int) -> tuple[int, ...]:
    """Row-major strides of `shape` whose last dimension's rows start `row` elements apart."""
    strides = [1, row]
    for n in reversed(shape[1:-1]):
        strides.append(strides[-1] * n)
    return tuple(reversed(strides))
