"""Reduced precision: a float32 graph computed in float16 or bfloat16, as autocast would run it,
with weights stored in the reduced dtype (`nimble compile --precision fp16|bf16`).

The rule, op by op, in program order:
- An op in `FP32_OPS` (autocast's float32 list, as far as nimble lowers it: softmax, the norms,
  exp, log, pow, reciprocal square roots, sums, products and other large reductions) computes in
  float32, and so does an op in `Precision.keep` (the ops the precision search, or the user,
  kept). Its reduced floating inputs are cast up first.
- A view, and an op in `FOLLOW_OPS` (cat, max pooling, padding, gathers: no arithmetic), computes
  in the dtype its inputs come in, as ATen would.
- Every other op computes in the reduced dtype: its float32 inputs are cast down first, and a
  float32 dtype argument (`x.to(torch.float32)`, `torch.full(..., dtype=torch.float32)`) becomes
  the reduced dtype, as it would be had the model been converted with `.half()` before tracing.
- A batch norm left after the rewrites (`affine_batch_norm` makes most a multiply-add) applies the
  statistics it stores, which stay float32 (weight, bias, running mean and variance); its kernels
  compute in float32 and store the reduced dtype.
- A tensor an op writes in place is never cast (the write must land in the tensor itself).
- Only float32 values change: float64, integer and boolean values stay as they are.
- Weights are stored in the dtype their readers compute in: reduced, or float32 where only
  float32 ops (or batch norm's statistics) read them. A weight both kinds read is stored twice.
- `Precision.io`: "model" keeps the model's float32 inputs and outputs (cast inside the graph);
  "reduced" makes them the reduced dtype.

Each cast is one `aten::_to_copy` op, shared by all readers of the value. The graph is built again
through the frontends' builder, which types every op on the meta device, so each spec and alias
follows from the ops. Values keep their names; a cast is named after what it casts
(`relu_12_f16`). `convert` also returns, for the precision search, which value of the new graph
each old value became, and which ops computed in float32 and why.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ..frontend.builder import GraphBuilder
from ..frontend.finalize import finalize
from ..ir import WEIGHT, Graph, Ref, Special
from ..ops import targets, types

SHORT = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}
FP32_OPS = frozenset({
    "softmax", "_softmax", "log_softmax", "_log_softmax", "layer_norm", "native_layer_norm", "group_norm",
    "native_group_norm", "instance_norm", "rms_norm", "exp", "log", "pow", "rsqrt", "reciprocal", "softplus",
    "sum", "prod", "cumsum", "var", "std", "norm", "linalg_vector_norm", "logsumexp",
})
# Ops that move or pick values without arithmetic: like views, they compute in whatever dtype their
# inputs come in, so that keeping an op in float32 is not undone by a cast before the next view.
FOLLOW_OPS = frozenset({
    "cat", "concat", "stack", "clone", "contiguous", "max_pool1d", "max_pool2d", "max_pool3d",
    "max_pool2d_with_indices", "adaptive_max_pool2d", "index_select", "gather", "index", "pad", "constant_pad_nd",
    "reflection_pad2d", "replication_pad2d", "flip", "roll", "repeat", "channel_shuffle", "native_channel_shuffle",
    "tril", "triu", "pixel_shuffle", "upsample_nearest2d",
})
CAST = "aten::_to_copy.default"
# batch norm: (input, weight, bias, running_mean, running_var, ...); the four after the input stay float32
STATISTICS = {"aten::batch_norm.default": range(1, 5),
              "aten::_native_batch_norm_legit_no_training.default": range(1, 5)}


@dataclass(frozen=True)
class Precision:
    dtype: str  # "float16" or "bfloat16"
    io: str = "model"  # "model": inputs and outputs keep float32; "reduced": they take `dtype`
    keep: frozenset[int] = frozenset()  # ids of ops (in the graph `convert` takes) kept in float32


@dataclass
class Converted:
    graph: Graph
    weights: dict[str, torch.Tensor]
    value_of: dict[int, int] = field(default_factory=dict)  # old value id -> new value id (same data)
    fp32: dict[int, str] = field(default_factory=dict)  # old op id -> "policy" or "kept"


def short_target(target: str) -> str:
    return target.split("::")[-1].split(".")[0]


def computes_in_fp32(graph: Graph, op_id: int, precision: Precision) -> str | None:
    """Why op `op_id` computes in float32 ("policy": FP32_OPS; "kept": Precision.keep), or None."""
    if short_target(graph.ops[op_id].target) in FP32_OPS:
        return "policy"
    return "kept" if op_id in precision.keep else None


def convert(graph: Graph, weights: dict[str, torch.Tensor], precision: Precision) -> Converted:
    """`graph` computed at `precision` (the module docstring's rule)."""
    low = precision.dtype
    b = GraphBuilder("reduce_precision")
    out = Converted(graph, {})
    casts: dict[tuple[int, str], Ref] = {}  # (new value id, dtype) -> its cast
    stored: dict[tuple[int, str], Ref] = {}  # (old weight id, dtype) -> the weight stored so
    names: dict[int, str] = {}  # new value id -> name

    for vid in graph.inputs:
        v = graph.values[vid]
        dtype = low if precision.io == "reduced" and v.spec.dtype == "float32" else v.spec.dtype
        ref = b.add_input(v.name, type(v.spec)(v.spec.shape, dtype, v.spec.strides, v.spec.offset))
        out.value_of[vid], names[ref.id] = ref.id, v.name

    def cast(ref: Ref, dtype: str, source: str) -> Ref:
        have = b.values[ref.id].spec.dtype
        if have == dtype or have not in ("float32", low):
            return ref
        if (ref.id, dtype) not in casts:
            new = b.op(CAST, [ref, types.DTYPES[dtype]], source)
            names[new.id] = f"{names[ref.id]}_{SHORT[dtype]}"
            casts[ref.id, dtype] = new
        return casts[ref.id, dtype]

    def weight(vid: int, dtype: str) -> Ref:
        v = graph.values[vid]
        if v.spec.dtype != "float32":
            dtype = v.spec.dtype
        if (vid, dtype) not in stored:
            tensor = weights[v.name].to(types.DTYPES[dtype])
            b.name_constant(tensor, v.name)
            stored[vid, dtype] = b.as_ref(tensor)
            names[stored[vid, dtype].id] = b.values[stored[vid, dtype].id].name
        return stored[vid, dtype]

    for op in graph.ops:
        why = computes_in_fp32(graph, op.id, precision)
        if why:
            out.fp32[op.id] = why
        schema = targets.resolve(op.target)._schema
        want = "float32" if why else (None if _follows(schema) else low)  # None: as the inputs come
        statistics = STATISTICS.get(op.target, ())
        written = set(op.mutates)

        def arg(a, position: int, name: str):
            if name == "dtype" and type(a) is int:  # a dtype as TorchScript passes it (its ScalarType number)
                a = Special("dtype", types.SCALAR_TYPES[a])
            if isinstance(a, Ref):
                v = graph.values[a.id]
                need = "float32" if position in statistics else want
                if v.kind == WEIGHT:
                    return weight(a.id, need or low)
                new = Ref(out.value_of[a.id])
                return new if a.id in written or need is None else cast(new, need, op.source)
            if isinstance(a, Special):
                if a.kind == "dtype":
                    return types.DTYPES[low if a.name == "float32" and want == low else a.name]
                if a.kind == "device":
                    return torch.device(a.name)
                return types.ENUMS[a.kind][a.name]
            if isinstance(a, tuple):
                return tuple(arg(x, position, "") for x in a)
            return a

        given = dict(op.kwargs)
        ins, position = [], 0
        for spec in schema.arguments:
            if spec.kwarg_only:
                ins.append(arg(given[spec.name], -1, spec.name) if spec.name in given else spec.default_value)
            else:
                ins.append(arg(op.args[position], position, spec.name) if position < len(op.args)
                           else spec.default_value)
                position += 1
        result = b.emit(schema, op.target, ins, op.source)
        results = [result] if isinstance(result, Ref) else result
        for old, new in zip(op.outputs, results):
            out.value_of[old] = new.id
            names.setdefault(new.id, graph.values[old].name)

    outputs = []
    for vid in graph.outputs:  # a cast output keeps the model's name; what it casts takes the suffix
        ref, was = Ref(out.value_of[vid]), graph.values[vid].spec.dtype
        if was == "float32":
            final = cast(ref, "float32" if precision.io == "model" else low, "")
            if final != ref and names[final.id] != graph.values[vid].name:
                names[ref.id], names[final.id] = names[final.id], graph.values[vid].name
            ref = final
        outputs.append(ref.id)
    values = [v if v.kind == WEIGHT else replace(v, name=names[v.id]) for v in b.values]
    new_graph, new_weights = finalize(values, b.ops, b.inputs, outputs, b.weights)
    out.graph, out.weights = new_graph, new_weights
    return out


def _follows(schema) -> bool:
    """A view (its result aliases an input, unwritten) or an op in FOLLOW_OPS; not a conversion
    (`x.to(dtype)` may alias its input, but it makes the dtype it is given)."""
    if schema.name.split("::")[-1] in FOLLOW_OPS:
        return True
    if any(a.name == "dtype" for a in schema.arguments):
        return False
    ret = schema.returns[0].alias_info if schema.returns else None
    return ret is not None and not ret.is_write
