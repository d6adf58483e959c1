"""Inference graphs: a convolution whose small result is broadcast into a larger elementwise op
(squeeze-and-excitation's scale) gives its bias to that op's fused group, so that the group
computes the scale where it multiplies and the convolution runs as one kernel.

torchvision's squeeze-and-excitation ends `x * sigmoid(fc2(s))`, fc2 a 1x1 convolution of the
pooled [N, C', 1, 1] map with a bias, x [N, C, H, W]. Fused as a convolution-led body, fc2 ran as
two kernels (cuDNN's convolution, then a generated one adding the bias and taking the sigmoid of
N x C numbers) and the multiply as a third. Here the convolution loses its bias to an add of the
bias shaped (1, C, 1, 1) just after it; `fuse_pointwise` then takes the add and the sigmoid into
the multiply's group, leaving the convolution out (a convolution leads only a body whose result
is its own shape), and `fuse_lone_convolutions` runs it alone: two kernels where there were
three. efficientnet_b0 has 16 such blocks. The multiply's kernel takes the sigmoid of a
broadcast number per element, which costs nothing in a kernel bound by memory; Inductor does the
same. A pass that rewrites weights (the reshaped bias is a new weight).

The sum is the same: a generated epilogue added the bias after the convolution there too.
"""

from __future__ import annotations

from ..ir import ACTIVATION, WEIGHT, Graph, Op, Ref, TensorSpec, Value
from ..ops import fusion
from .fuse_conv import _leader
from .fuse_pointwise import elementwise
from .rewrite import Facts
from .edit import Edit
from .substitute import free_name, read_weights

ADD = "aten::add.Tensor"


def bias_into_broadcast(graph: Graph, weights: dict) -> tuple[Graph, dict]:
    """Each convolution whose result flows, through elementwise ops of its own shape that are each
    the one reader of what they read, into an elementwise op with a larger result becomes the
    convolution without its bias and an add of the bias."""
    facts = Facts(graph)
    weights = dict(weights)
    ops: list[Op] = []
    edit = Edit(graph)
    for op in graph.ops:
        bias = _movable_bias(graph, facts, op)
        if bias is None:
            ops.append(op)
            continue
        out = graph.values[op.outputs[0]]
        channels = out.spec.shape[1]
        shape = (1, channels, 1, 1)
        name = free_name(f"{bias.name}.broadcast", weights)
        weights[name] = weights[bias.name].reshape(shape).contiguous()
        moved = edit.value(WEIGHT, TensorSpec(shape, bias.spec.dtype), name, before=out.id)
        bare = edit.value(ACTIVATION, out.spec, f"{out.name}_unbiased", before=out.id)
        ops.append(edit.renumbered(op, args=(*op.args[:2], None, *op.args[3:]), outputs=(bare.id,)))
        ops.append(edit.op(ADD, (Ref(bare.id), Ref(moved.id)), (("alpha", 1),), (out.id,), op.source, op_id=op.id))
    if not edit.changed:
        return graph, weights
    result = edit.finish(ops)
    return read_weights(result, weights)


def _movable_bias(graph: Graph, facts: Facts, op: Op) -> Value | None:
    """The bias weight of convolution `op` where the rewrite applies, else None."""
    out = _leader(graph, facts, op)
    if out is None or len(op.args) < 3 or not isinstance(op.args[2], Ref):
        return None
    bias = graph.values[op.args[2].id]
    if bias.kind != WEIGHT or bias.spec.shape != out.spec.shape[1:2] or bias.spec.dtype != out.spec.dtype \
            or not bias.spec.is_contiguous or bias.spec.offset:
        return None
    last = out
    while True:  # along the chain the pointwise fusion would take in
        reader = facts.only_reader(last.id)
        result = elementwise(graph, facts, graph.ops[reader]) if reader is not None else None
        if result is None:
            return None
        if result.spec.shape != out.spec.shape:
            return bias if result.spec.numel > out.spec.numel and _fusible(graph, graph.ops[reader], last) else None
        last = result


def _fusible(graph: Graph, reader: Op, value: Value) -> bool:
    """True if `reader` reads `value` as a tensor operand it may take into its group."""
    return any(pos < len(reader.args) and reader.args[pos] == Ref(value.id) for pos in fusion.POINTWISE[reader.target])
