"""Inference graphs: attention written out by hand, as Hugging Face's BERT and many models do it,

    scores = q @ k.transpose(-1, -2)  [/ c or * c]  [+ mask, or where(allowed, ., very negative)]
    out = softmax(scores, -1) @ v

(q itself may be scaled first, `q * c`, as Swin does: the scale then joins sdpa's)
becomes one `aten::scaled_dot_product_attention` (q, k, v, attn_mask=mask, scale), which runs as
a fused attention kernel on CUDA instead of two GEMMs, a scale, an add and a softmax, and never
writes the [batch, heads, n, n] scores (torch.compile recognises the same pattern).

It matches only where nothing else reads the scores or the probabilities, q, k and v are 4-D,
the transpose swaps k's last two dimensions, the scale is a number or a 0-d weight, and the mask
is an additive floating tensor, or a boolean one that `where` fills with -1e4 or less elsewhere
(GPT-2's causal mask: a row that masks every key then differs, softmax of -inf being NaN), either
broadcasting to the scores. A pass that reads
weights (the scale), so it takes them beside the graph; dead-op removal drops what it replaced.
"""

from __future__ import annotations

import dataclasses

import torch

from ..ir import WEIGHT, Graph, Op, Ref, TensorSpec
from ..ops import arguments, targets, types
from .rewrite import Facts
from .substitute import rebuild

ATTENTION = "aten::scaled_dot_product_attention.default"
_SOFTMAX = {"aten::softmax.int", "aten::_softmax.default"}


def match_attention(graph: Graph, weights: dict[str, torch.Tensor]) -> tuple[Graph, dict[str, torch.Tensor]]:
    """Each softmax(q @ k^T * scale + mask) @ v the module docstring describes becomes one op."""
    facts = Facts(graph)
    ops = list(graph.ops)
    values = list(graph.values)
    matched = False
    for op in graph.ops:
        found = _match(graph, facts, op, weights)
        if found is None:
            continue
        q, k, v, mask, scale = found
        spec = _attention_spec(graph, q, k, v, mask, scale)
        if spec is None:
            continue
        schema = targets.resolve(ATTENTION)._schema
        given = {"query": q, "key": k, "value": v, "attn_mask": mask, "scale": scale}
        args, kwargs = arguments.by_schema(schema, [given.get(a.name, a.default_value) for a in schema.arguments])
        ops[op.id] = dataclasses.replace(op, target=ATTENTION, args=tuple(args), kwargs=tuple(kwargs))
        values[op.outputs[0]] = dataclasses.replace(values[op.outputs[0]], spec=spec)
        matched = True
    if not matched:
        return graph, weights
    return rebuild(graph, ops, values=values), weights


def _match(graph: Graph, facts: Facts, out: Op, weights):
    """(q, k, v, mask or None, scale) if `out` is the final product of the pattern, else None."""
    if out.target != "aten::matmul.default" or len(out.outputs) != 1 or out.kwargs:
        return None
    probs, v = out.args
    p = _producer(graph, facts, probs, out)
    if p is None or p.target not in _SOFTMAX or p.args[1] not in (-1, 3) or p.args[2] not in (None, False):
        return None
    x = _producer(graph, facts, p.args[0], p)
    mask = None
    if x is not None and x.target == "aten::add.Tensor" and dict(x.kwargs).get("alpha", 1) == 1:
        scores, mask = x.args
        x = _producer(graph, facts, scores, x)
    elif x is not None and x.target == "aten::where.self" and isinstance(x.args[0], Ref) \
            and graph.values[x.args[0].id].spec.dtype == "bool":
        fill = _number(graph, x.args[2], weights)  # GPT-2's causal mask: where(allowed, scores, finfo.min)
        if fill is None or fill > -1e4:
            return None
        mask = x.args[0]
        x = _producer(graph, facts, x.args[1], x)
    scale = None
    if x is not None and x.target in ("aten::div.Tensor", "aten::mul.Tensor", "aten::div.Scalar", "aten::mul.Scalar"):
        c = _number(graph, x.args[1], weights)
        if c is None or c == 0:
            return None
        scale = 1.0 / c if x.target.startswith("aten::div") else c
        x = _producer(graph, facts, x.args[0], x)
    if x is None or x.target != "aten::matmul.default":
        return None
    q, kt = x.args
    t = _producer(graph, facts, kt, x)
    if t is None or t.target != "aten::transpose.int" or not all(isinstance(a, Ref) for a in (q, v, t.args[0])):
        return None
    k = t.args[0]
    if any(len(graph.values[a.id].spec.shape) != 4 for a in (q, k, v)) or {t.args[1] % 4, t.args[2] % 4} != {2, 3}:
        return None
    if mask is not None and (not isinstance(mask, Ref) or graph.values[mask.id].spec.dtype not in
                             ("float32", "float16", "bfloat16", "bool")):
        return None
    if scale is None:  # the scores are q @ k^T as they stand: said, not sdpa's default
        scale = 1.0
    qp = _producer(graph, facts, q, x)  # q scaled before the product (Swin): that scale is sdpa's too
    if qp is not None and qp.target in ("aten::mul.Scalar", "aten::mul.Tensor") and isinstance(qp.args[0], Ref):
        c, unscaled = _number(graph, qp.args[1], weights), graph.values[qp.args[0].id].spec
        if c is not None and c != 0 and (unscaled.shape, unscaled.dtype) == (graph.values[q.id].spec.shape,
                                                                           graph.values[q.id].spec.dtype):
            q, scale = qp.args[0], scale * c
    return q, k, v, mask, float(scale)


def _producer(graph: Graph, facts: Facts, arg, reader: Op) -> Op | None:
    """The op that makes `arg`, where `reader` alone reads it (no view, write or output shares it)."""
    if not isinstance(arg, Ref):
        return None
    value = graph.values[arg.id]
    if value.producer is None or facts.only_reader(arg.id) != reader.id:
        return None
    op = graph.ops[value.producer]
    return op if len(op.outputs) == 1 and not op.mutates else None


def _number(graph: Graph, arg, weights) -> float | None:
    """A scale: a Python number, or a 0-d floating weight."""
    if isinstance(arg, (int, float)) and not isinstance(arg, bool):
        return float(arg)
    if isinstance(arg, Ref) and graph.values[arg.id].kind == WEIGHT and graph.values[arg.id].spec.shape == ():
        tensor = weights[graph.values[arg.id].name]
        return float(tensor) if tensor.is_floating_point() else None
    return None


def _attention_spec(graph: Graph, q: Ref, k: Ref, v: Ref, mask: Ref | None, scale: float) -> TensorSpec | None:
    """The attention's result typed on the meta device; None where it refuses these inputs."""
    meta = {r.id: arguments.meta_tensor(graph.values[r.id].spec) for r in (q, k, v, mask) if r is not None}
    try:
        result = targets.resolve(ATTENTION)(meta[q.id], meta[k.id], meta[v.id],
                                            attn_mask=meta[mask.id] if mask is not None else None, scale=scale)
    except Exception:
        return None
    return TensorSpec(tuple(result.shape), types.dtype_name(result.dtype), tuple(result.stride()),
                      result.storage_offset())
