"""Reduced-precision graphs: an op that `reduce_precision` runs in float32 between two casts
reads and writes the reduced dtype instead, where that gives the same values.

Autocast's float32 list puts layer norm and pow in float32, so a float16 transformer ran each of
them as three kernels: a cast of its float16 input up, the op in float32, a cast of its result
down for the next GEMM (GPT-2 at batch 8: 76 casts, a third of its kernel time at fp16 on the
H100). PyTorch's elementwise kernels on float16 compute in float32 (`opmath`) and round the result
once, as nimble's generated ones do: reading the float16 value directly and rounding once is
exactly what the two casts did around the float32 op, in one kernel. Layer norm computes its
statistics in float32 too, but takes its weight and bias in its input's dtype (on CUDA), so they
are stored in the reduced dtype for it, as a module cast with `.half()` has them: its result then
differs from autocast's by the rounding of those weights (at most 2**-11 relative for float16),
which the compile's check against the model covers. The layer norm can then also join the kernel
of the elementwise op before it (`pairs.norm_pairs`).

An op is rewritten where it is aten::layer_norm (whose weight and bias are weights, or absent) or
a one-tensor elementwise op a fused body may hold (`ops/fusion.py`), its tensor input is a cast up
from float16 or bfloat16 that nothing else reads, and every reader of its float32 result is a cast
back down to that same dtype (at least one; the result is no graph output and no view shares it).
The casts go; the readers of the casts down read the op's result. A pass that adds weights.
"""

from __future__ import annotations

import dataclasses

import torch

from ..ir import WEIGHT, Graph, Op, Ref, Special, TensorSpec
from ..ops import fusion, types
from .edit import Edit
from .reduce_precision import CAST, SHORT
from .rewrite import Facts
from .substitute import free_name, read_weights

LAYER_NORM = "aten::layer_norm.default"
REDUCED = ("float16", "bfloat16")
_PLAIN_CAST = {"layout": None, "device": None, "pin_memory": None, "non_blocking": False, "memory_format": None}


def drop_precision_casts(graph: Graph, weights: dict[str, torch.Tensor]) -> tuple[Graph, dict[str, torch.Tensor]]:
    """Each float32 op between a cast up and casts down computes in the reduced dtype instead."""
    facts = Facts(graph)
    ops = {op.id: op for op in graph.ops}
    weights = dict(weights)
    edit = Edit(graph)
    stored: dict[tuple[int, str], int] = {}  # (float32 weight, reduced dtype) -> its reduced copy
    for op in graph.ops:
        found = _between_casts(graph, facts, op)
        if found is None:
            continue
        up, downs, source = found
        low = graph.values[source].spec.dtype
        args = list(op.args)
        args[0] = Ref(source)
        for k in (2, 3) if op.target == LAYER_NORM else ():  # weight and bias, in the input's dtype
            if k < len(args) and isinstance(args[k], Ref) and graph.values[args[k].id].spec.dtype != low:
                w = graph.values[args[k].id]
                if (w.id, low) not in stored:
                    name = free_name(f"{w.name}_{SHORT[low]}", weights)
                    weights[name] = weights[w.name].to(types.DTYPES[low])
                    stored[w.id, low] = edit.value(WEIGHT, TensorSpec(w.spec.shape, low), name, before=w.id).id
                args[k] = Ref(stored[w.id, low])
        ops[op.id] = dataclasses.replace(op, args=tuple(args))
        result = edit.values[op.outputs[0]]
        edit.change(dataclasses.replace(result, spec=dataclasses.replace(result.spec, dtype=low)))
        del ops[up.id]
        for down in downs:
            del ops[down.id]
            edit.replace_uses(down.outputs[0], result.id)
    if not edit.changed:
        return graph, weights
    return read_weights(edit.finish(list(ops.values())), weights)


def _between_casts(graph: Graph, facts: Facts, op: Op) -> tuple[Op, list[Op], int] | None:
    """(the cast up, the casts down, the reduced value the cast up read) around `op`, where the
    module docstring's rule holds; else None."""
    if op.target != LAYER_NORM and not (op.target in fusion.POINTWISE and fusion.POINTWISE[op.target] == (0,)):
        return None
    if len(op.outputs) != 1 or op.mutates or not op.args or not isinstance(op.args[0], Ref):
        return None
    if op.target != LAYER_NORM and fusion.pointwise_problem((op.target, op.args, op.kwargs)):
        return None
    if op.target == LAYER_NORM and any(isinstance(a, Ref) and graph.values[a.id].kind != WEIGHT for a in op.args[1:]):
        return None
    x, result = graph.values[op.args[0].id], graph.values[op.outputs[0]]
    if x.producer is None or result.spec.dtype != "float32" or x.spec.dtype != "float32" \
            or facts.only_reader(x.id) != op.id or result.id in facts.outputs or result.id in facts.aliased:
        return None
    up = graph.ops[x.producer]
    source = _cast(up, "float32")
    if source is None or graph.values[source].spec.dtype not in REDUCED:
        return None
    low = graph.values[source].spec.dtype
    readers = facts.readers.get(result.id, set())
    downs = [graph.ops[r] for r in sorted(readers)]
    if not downs or any(_cast(d, low) != result.id for d in downs):
        return None
    return up, downs, source


def _cast(op: Op, dtype: str) -> int | None:
    """The value `op` casts, where it is a plain cast (no device, layout or format change) to `dtype`."""
    if op.target != CAST or len(op.args) != 1 or not isinstance(op.args[0], Ref) or len(op.outputs) != 1 \
            or op.mutates:
        return None
    kwargs = dict(op.kwargs)
    if kwargs.get("dtype") != Special("dtype", dtype) or any(kwargs.get(k, v) != v for k, v in _PLAIN_CAST.items()) \
            or set(kwargs) - {"dtype", *_PLAIN_CAST}:
        return None
    return op.args[0].id
