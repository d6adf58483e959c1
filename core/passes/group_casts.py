"""Training graphs (the last of `train.JOINT_PASSES`): a mixed-precision step's casts of its
gradients become a few `nimble::cast_group` ops (`ops/casts.py`), which a step copies into their
buffers a few dozen to a kernel (`runtime/joint.cast_group_into`: `torch._foreach_copy_`). A
bf16 step of vit_b_16 casts 102 bfloat16 gradients to float32 at the end of its backward, each a
copy kernel of its own: the step went from 11.76 to 11.59 ms with them grouped (H200, torch
2.11, batch 32 at 224 px, 2026-12-01: `tools/train_step_ab.py --model vit_b_16 --precision bf16
--without group_casts`). Alone, in CUDA graphs of the copies, 102 such casts of its shapes took
0.58 ms a copy each and 0.17 ms grouped; in a step most of that ran beside other kernels.

Every cast whose result is a graph output (a gradient) that no op reads becomes part of a group
of about `GROUP_BYTES` of results, in program order, each group where its last cast was (every
source exists there, and nothing in the graph waits for the results). The gradients of a
data-parallel step are all-reduced in buckets of 25 MB by default as their last gradient is made:
groups of a similar size keep that overlap, and a bfloat16 gradient waits for its group at most.

The forward's casts of the weights are left as they are: grouped into one op at the start of the
step (with the gradients' groups too, and a generated kernel for both), they made vit_b_16's
bf16 step 0.3 ms slower (12.02 against 11.73 ms, same command). Lone casts run beside the
forward's first products on the other streams; one op of them all runs before any.

A cast here is `_to_copy` to another floating dtype, and nothing else (no layout, pinning or
memory format asked for). The results are the casts' own, so a step's losses and gradients are
unchanged bit for bit.
"""

from __future__ import annotations

import dataclasses

from ..ir import ITEMSIZE, Graph, Op, Ref, Special
from ..ops import casts
from .substitute import rebuild

CAST = "aten::_to_copy.default"
FLOATS = ("float32", "float16", "bfloat16")
GROUP_BYTES = 32 * 2**20  # results of one backward group, at most (a lone larger cast is a group of its own)
_NEUTRAL = {"layout": (None, Special("layout", "torch.strided")), "device": None, "pin_memory": (None, False),
            "non_blocking": (False,), "memory_format": (None, Special("memory_format", "torch.preserve_format"))}


def group_casts(graph: Graph) -> Graph:
    outputs = set(graph.outputs)
    readers = graph.readers()
    gradients: dict[str, list[Op]] = {}
    for op in graph.ops:
        dtype = _cast_to(graph, op)
        if dtype is not None and op.outputs[0] in outputs and not readers.get(op.outputs[0]):
            gradients.setdefault(dtype, []).append(op)
    groups = [(chunk, chunk[-1]) for members in gradients.values() for chunk in _chunks(graph, members)
              if len(chunk) > 1]
    if not groups:
        return graph
    values = list(graph.values)
    replaced: dict[int, Op] = {}
    dropped: set[int] = set()
    for members, at in groups:
        dtype = graph.values[members[0].outputs[0]].spec.dtype
        results = tuple(m.outputs[0] for m in members)
        replaced[at.id] = Op(at.id, casts.CAST_GROUP, (tuple(m.args[0] for m in members),),
                             (("dtype", Special("dtype", dtype)),), results, source=at.source)
        dropped.update(m.id for m in members if m.id != at.id)
        for v in results:
            values[v] = dataclasses.replace(values[v], producer=at.id)
    kept = [replaced.get(op.id, op) for op in graph.ops if op.id not in dropped]
    return rebuild(graph, kept, values=values)


def _cast_to(graph: Graph, op: Op) -> str | None:
    """The dtype `op` casts a tensor to, where it is a plain cast between floating dtypes."""
    if op.target != CAST or len(op.args) != 1 or not isinstance(op.args[0], Ref) or op.mutates \
            or len(op.outputs) != 1:
        return None
    kwargs = dict(op.kwargs)
    dtype = kwargs.pop("dtype", None)
    if not isinstance(dtype, Special) or dtype.kind != "dtype" or dtype.name not in FLOATS:
        return None
    if any(k not in _NEUTRAL or (_NEUTRAL[k] is not None and v not in _NEUTRAL[k]) for k, v in kwargs.items()):
        return None
    out, src = graph.values[op.outputs[0]], graph.values[op.args[0].id]
    if out.alias_of is not None or out.spec.dtype != dtype.name or src.spec.dtype not in FLOATS \
            or src.spec.dtype == dtype.name or tuple(src.spec.shape) != tuple(out.spec.shape):
        return None
    return dtype.name


def _chunks(graph: Graph, members: list[Op]) -> list[list[Op]]:
    """`members` in runs of at most GROUP_BYTES of results each, in order."""
    chunks: list[list[Op]] = [[]]
    size = 0
    for m in members:
        spec = graph.values[m.outputs[0]].spec
        n = spec.numel * ITEMSIZE[spec.dtype]
        if chunks[-1] and size + n > GROUP_BYTES:
            chunks.append([])
            size = 0
        chunks[-1].append(m)
        size += n
    return chunks
