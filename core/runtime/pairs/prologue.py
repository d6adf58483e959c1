"""Prologue pairs: a depthwise convolution that applies its producer's epilogue as it loads each tap
(channels_last candidates only, `depthwise_conv.Prologue`). Both ops still run, each as its own
kernel, but the producer writes its convolution alone (`FusedKernel.bare`) and its epilogue moves
into its reader's kernel (`kernels/on_load.OnLoad`); the lowering of a candidate sets them
(`assemble/lower.py`)."""

from __future__ import annotations

from typing import Sequence

from ...ir import Graph, Ref
from ...ops import fusion
from ..kernels.fused import FusedKernel
from ..placed.placement import PlacedOp
from .common import readers_of


def prologue_pairs(graph: Graph, placed: Sequence[PlacedOp], taken: set[int]) -> dict[int, int]:
    """depthwise op -> producer, for each fused op led by a depthwise convolution (groups = its
    input's channels, one input channel per filter) whose input is the result of a fused op led
    by a convolution (not depthwise) with an epilogue that reads nothing but values per channel
    (its bias, folded batch norms, activations), where that result has no other reader (the
    depthwise body reads it only as its convolution's input), is no output and no view's base,
    and neither op is in another pair (`taken`). The producer then
    writes its convolution alone and the depthwise kernel applies the rest to each tap it loads
    (`FusedKernel.bare`, `depthwise_conv.Prologue`): the epilogue's kernel and a pass of the
    map through memory go. The executable sets these for channels_last candidates, the layout
    the depthwise kernel takes."""
    readers, outputs, aliased = readers_of(graph)
    found = {}
    for op in graph.ops:
        consumer = placed[op.id].substitute
        if op.id in taken or not isinstance(consumer, FusedKernel) or not depthwise(graph, consumer.body):
            continue
        x = consumer.body[0][1][0].id
        if any(isinstance(a, Ref) and graph.root(a.id) == x for _, args, _ in consumer.body[1:] for a in args):
            continue  # the body reads the producer's result past its convolution too (a residual sum)
        producer = graph.values[x].producer
        if producer is None or producer in taken or readers.get(x) != {op.id} or x in outputs or x in aliased \
                or graph.values[x].alias_of is not None:
            continue
        before = placed[producer].substitute
        if isinstance(before, FusedKernel) and len(before.body) > 1 and fusion.leads_with_convolution(before.body) \
                and not depthwise(graph, before.body) and per_channel(graph, before.body[1:], x):
            found[op.id] = producer
    return found


def depthwise(graph: Graph, body) -> bool:
    """Whether `body` leads with a 2-D convolution of each channel alone, over a graph value."""
    if not fusion.leads_with_convolution(body):
        return False
    p = fusion.conv_params(body[0][0], body[0][1])
    if p is None or not isinstance(p["input"], Ref) or not isinstance(p["weight"], Ref):
        return False
    x, w = graph.values[p["input"].id].spec.shape, graph.values[p["weight"].id].spec.shape
    return len(x) == 4 and len(w) == 4 and w[1] == 1 and p["groups"] == w[0] == x[1]


def per_channel(graph: Graph, nodes, x: int) -> bool:
    """Whether every graph value `nodes` read broadcasts along the channels of value `x` alone."""
    shape = graph.values[x].spec.shape
    for _, args, _ in nodes:
        for a in args:
            if not isinstance(a, Ref):
                continue
            s = graph.values[a.id].spec.shape
            if len(s) > 4:
                return False
            padded = (1,) * (4 - len(s)) + tuple(s)
            if padded[0] != 1 or padded[2] != 1 or padded[3] != 1 or padded[1] not in (1, shape[1]):
                return False
    return True
