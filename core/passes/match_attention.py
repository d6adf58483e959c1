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
broadcasting to the scores.

Shifted windows (Swin's): the scores of B images' W windows, [B * W, heads, n, n], are viewed as
[B, W, heads, n, n] to add the windows' mask, [1, W, 1, n, n], and viewed back before the
softmax. Where that mask and the bias added before it are weights (`fold_constants` made them),
their sum becomes one weight: the mask of the windows of one image, [W, heads, n, n], which
attention reads as it is at batch 1 and through one `aten::repeat` over the batch above it. The
sum must not depend on the image (it never does in Swin: the mask is the windows' own).

A pass that reads weights (the scale) and adds them (the windows' mask), so it takes them beside
the graph; dead-op removal drops what it replaced.
"""

from __future__ import annotations

import dataclasses

import torch

from ..ir import ACTIVATION, WEIGHT, Graph, Op, Ref, TensorSpec, Value
from ..ops import arguments, shapes, targets, types
from ..ops.attention import ATTENTION
from .fold_constants import FOLD_BYTES
from .rewrite import Facts
from .substitute import free_name, in_order, read_weights, rebuild

REPEAT = "aten::repeat.default"
_SOFTMAX = {"aten::softmax.int", "aten::_softmax.default"}
_VIEWS = {"aten::view.default", "aten::reshape.default", "aten::_unsafe_view.default"}


@dataclasses.dataclass(frozen=True)
class _Windows:
    """The windows' mask of shifted-window attention (module docstring): `mask` is added to the
    scores viewed as `shape` ([B, W, heads, n, n]); `bias` (or None) was added before the view."""

    mask: Ref
    bias: Ref | None
    shape: tuple[int, ...]


def match_attention(graph: Graph, weights: dict[str, torch.Tensor]) -> tuple[Graph, dict[str, torch.Tensor]]:
    """Each softmax(q @ k^T * scale + mask) @ v the module docstring describes becomes one op."""
    facts = Facts(graph)
    ops = list(graph.ops)
    values = list(graph.values)
    before: dict[int, list[Op]] = {}  # op id -> new ops that run just before it
    added: dict[int, list[Value]] = {}
    weights = dict(weights)
    next_value, next_op = len(graph.values), len(graph.ops)
    matched = False
    for op in graph.ops:
        found = _match(graph, facts, op, weights)
        if found is None:
            continue
        q, k, v, mask, scale = found
        new_ops, new_values = [], []
        mask_spec = graph.values[mask.id].spec if isinstance(mask, Ref) else None
        if isinstance(mask, _Windows):
            made = _windows_mask(graph, weights, mask, next_value, next_op, op.source)
            if made is None:
                continue
            new_values, new_ops, tensor = made
            weights[new_values[0].name] = tensor
            next_value, next_op = next_value + len(new_values), next_op + len(new_ops)
            mask, mask_spec = Ref(new_values[-1].id), new_values[-1].spec
        spec = _attention_spec(graph, q, k, v, mask_spec, scale)
        if spec is None:
            continue
        schema = targets.resolve(ATTENTION)._schema
        given = {"query": q, "key": k, "value": v, "attn_mask": mask, "scale": scale}
        args, kwargs = arguments.by_schema(schema, [given.get(a.name, a.default_value) for a in schema.arguments])
        ops[op.id] = dataclasses.replace(op, target=ATTENTION, args=tuple(args), kwargs=tuple(kwargs))
        values[op.outputs[0]] = dataclasses.replace(values[op.outputs[0]], spec=spec)
        if new_values:
            added[op.outputs[0]] = new_values
            before[op.id] = new_ops
        matched = True
    if not matched:  # a windows' mask made for a match that then failed is dropped too
        return read_weights(graph, weights)
    return read_weights(rebuild(graph, in_order(ops, before), values=values, added=added), weights)


def _match(graph: Graph, facts: Facts, out: Op, weights):
    """(q, k, v, mask (a Ref, `_Windows` or None), scale) if `out` is the final product of the
    pattern, else None."""
    if out.target != "aten::matmul.default" or len(out.outputs) != 1 or out.kwargs:
        return None
    probs, v = out.args
    p = _producer(graph, facts, probs, out)
    if p is None or p.target not in _SOFTMAX or p.args[1] not in (-1, 3) or p.args[2] not in (None, False):
        return None
    x = _producer(graph, facts, p.args[0], p)
    windows = None
    if x is not None and x.target in _VIEWS:
        x, windows = _windowed(graph, facts, x)
    mask = None
    if x is not None and x.target == "aten::add.Tensor" and dict(x.kwargs).get("alpha", 1) == 1:
        scores, mask = x.args
        x = _producer(graph, facts, scores, x)
    elif x is not None and x.target == "aten::where.self" and isinstance(x.args[0], Ref) \
            and graph.values[x.args[0].id].spec.dtype == "bool" and windows is None:
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
    if windows is not None:
        mask = _Windows(windows[0], mask, windows[1])
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


def _windowed(graph: Graph, facts: Facts, view: Op) -> tuple[Op | None, tuple | None]:
    """Where `view` ends Swin's shifted-window masking (module docstring): (the op that makes the
    4-D scores before it, (the windows' mask, the 5-D shape)); else (`view`, None)."""
    add = _viewed(graph, facts, view)
    if add is None or add.target != "aten::add.Tensor" or dict(add.kwargs).get("alpha", 1) != 1 \
            or not all(isinstance(a, Ref) for a in add.args):
        return view, None
    for scores5, mask in (add.args, add.args[::-1]):
        split = _producer(graph, facts, scores5, add)
        if split is None or split.target not in _VIEWS or not isinstance(split.args[0], Ref):
            continue
        flat, shape = graph.values[split.args[0].id].spec.shape, graph.values[scores5.id].spec.shape
        m = graph.values[mask.id]
        if len(flat) == 4 and len(shape) == 5 and graph.values[view.outputs[0]].spec.shape == flat \
                and shape[0] * shape[1] == flat[0] and shape[2:] == flat[1:] and m.kind == WEIGHT \
                and m.spec.dtype == graph.values[scores5.id].spec.dtype and len(m.spec.shape) <= 5 \
                and graph.values[add.outputs[0]].spec.shape == shape:
            return _viewed(graph, facts, split), (mask, shape)
    return view, None


def _viewed(graph: Graph, facts: Facts, view: Op) -> Op | None:
    """The op that makes the value `view` views, where nothing but `view` reads or views it."""
    base = view.args[0]
    if not isinstance(base, Ref) or base.id in facts.outputs or base.id in facts.mutated \
            or facts.readers.get(base.id) != {view.id}:
        return None
    value = graph.values[base.id]
    if value.producer is None or value.alias_of is not None \
            or [v.id for v in graph.values if v.alias_of == base.id] != list(view.outputs):
        return None
    op = graph.ops[value.producer]
    return op if len(op.outputs) == 1 and not op.mutates else None


def _windows_mask(graph: Graph, weights: dict, windows: _Windows, next_value: int, next_op: int,
                  source: str) -> tuple[list[Value], list[Op], torch.Tensor] | None:
    """The windows' mask and the bias before it summed into one weight for attention (module
    docstring): (the new values, the weight first and the mask attention reads last; the new ops;
    the weight's tensor), or None where they are not weights, the sum depends on the image, or it
    would pass FOLD_BYTES."""
    batch, count = windows.shape[:2]
    parts = [windows.mask] + ([windows.bias] if windows.bias is not None else [])
    if any(not isinstance(r, Ref) or graph.values[r.id].kind != WEIGHT for r in parts):
        return None
    mask = weights[graph.values[windows.mask.id].name]
    total = mask.reshape((1,) * (5 - mask.dim()) + tuple(mask.shape))
    if windows.bias is not None:
        bias = weights[graph.values[windows.bias.id].name]
        if bias.dtype != mask.dtype or bias.dim() > 4:
            return None
        bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))
        if bias.shape[0] not in (1, batch * count):
            return None
        total = total + (bias.reshape(1, 1, *bias.shape[1:]) if bias.shape[0] == 1 else
                         bias.reshape(batch, count, *bias.shape[1:]))
    if total.shape[0] > 1 and not bool((total == total[:1]).all()):
        return None  # the mask differs between images
    total = total[0].contiguous()  # [W or 1, heads or 1, n or 1, n]
    if total.numel() * total.element_size() > FOLD_BYTES:
        return None
    dtype = types.dtype_name(total.dtype)
    name = free_name(f"{graph.values[windows.mask.id].name}_windows", weights)
    weight = Value(next_value, WEIGHT, TensorSpec(tuple(total.shape), dtype), name)
    if batch == 1 or total.shape[0] == 1:  # attention broadcasts it as it is
        return [weight], [], total
    shape = (batch * total.shape[0], *total.shape[1:])
    repeated = Value(next_value + 1, ACTIVATION, TensorSpec(shape, dtype), f"{name}_batch", next_op)
    repeat = Op(next_op, REPEAT, (Ref(weight.id), (batch, 1, 1, 1)), (), (repeated.id,), (), (), source)
    return [weight, repeated], [repeat], total


def _attention_spec(graph: Graph, q: Ref, k: Ref, v: Ref, mask: TensorSpec | None, scale: float) -> TensorSpec | None:
    """The attention's result typed on the meta device (its shape rule, else its meta kernel);
    None where it refuses these inputs."""
    meta = {r.id: arguments.meta_tensor(graph.values[r.id].spec) for r in (q, k, v)}
    kwargs = {"attn_mask": arguments.meta_tensor(mask) if mask is not None else None, "scale": scale}
    try:
        result, = shapes.results(ATTENTION, [meta[q.id], meta[k.id], meta[v.id]], kwargs)
    except Exception:
        return None
    return TensorSpec(tuple(result.shape), types.dtype_name(result.dtype), tuple(result.stride()),
                      result.storage_offset())
