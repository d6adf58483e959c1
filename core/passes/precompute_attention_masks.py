"""Inference graphs: a boolean attention mask becomes an additive one once, not in every layer.

`scaled_dot_product_attention` given a boolean mask turns it into a float one on every call (0
where allowed, -inf elsewhere: three kernels before the attention kernel on CUDA). GPT-2 passes
the same causal-and-padding mask to all twelve layers, so eager PyTorch, and nimble before this
pass, converted it twelve times. Here each boolean mask read by attention is converted by one
`aten::where.Scalar(mask, 0.0, -inf)` op placed before its first reader, and every attention op
that read the mask reads the float mask instead. The result is the same: the conversion is the
one the attention op makes (torch.compile hoists it the same way).

Only where the query is float32: `where.Scalar` gives the default float dtype, and attention
wants a float mask of the query's dtype. `reduce_precision`, which runs later, casts the float
mask down once for an fp16 or bf16 attention, as it casts any float32 input.
"""

from __future__ import annotations

import dataclasses

from ..ir import ACTIVATION, Graph, Op, Ref, TensorSpec
from .edit import Edit

ATTENTION = "aten::scaled_dot_product_attention.default"
CONVERT = "aten::where.Scalar"
_MASK = 3  # attn_mask's position in scaled_dot_product_attention's schema


def precompute_attention_masks(graph: Graph) -> Graph:
    """Each boolean mask that float32 attention reads is converted to an additive mask once."""
    ops: list[Op] = []
    edit = Edit(graph)
    converted: dict[int, int] = {}  # boolean mask value -> its float mask value
    for op in graph.ops:
        mask = _boolean_mask(graph, op)
        if mask is None:
            ops.append(op)
            continue
        if mask not in converted:
            spec = graph.values[mask].spec
            name = f"{graph.values[mask].name}_additive"
            float_mask = edit.value(ACTIVATION, TensorSpec(spec.shape, "float32"), name, before=op.outputs[0])
            ops.append(edit.op(CONVERT, (Ref(mask), 0.0, float("-inf")), (), (float_mask,), op.source))
            converted[mask] = float_mask.id
        args = list(op.args)
        args[_MASK] = Ref(converted[mask])
        ops.append(dataclasses.replace(op, args=tuple(args)))
    if not converted:
        return graph
    return edit.finish(ops)


def _boolean_mask(graph: Graph, op: Op) -> int | None:
    """The boolean mask value a float32 attention op reads in its attn_mask slot, or None."""
    if op.target != ATTENTION or len(op.args) <= _MASK or op.mutates or len(op.outputs) != 1 \
            or not isinstance(op.args[_MASK], Ref):
        return None
    query, mask = op.args[0], graph.values[op.args[_MASK].id]
    if not isinstance(query, Ref) or graph.values[query.id].spec.dtype != "float32" or mask.spec.dtype != "bool":
        return None
    return mask.id
