"""Inference graphs: a 2-D convolution that no group took in becomes a fused op of one node, so
that the runtime can run it and its bias as one kernel that writes its planned buffer.

As an op of its own, a convolution with a bias ran as eager PyTorch runs it on cuDNN: the
convolution through its out= kernel, then the bias added in place, a second kernel. The
projections of efficientnet_b0 and mobilenet_v2 (1x1, batch norm folded into a bias, read by a
residual add or the next block) and resnet50's downsampling convolutions are such ops. Fused, the
runtime offers the convolution and its bias to cuDNN as one operation graph
(`runtime/kernels/cudnn_graph.py`, with the `cudnn` extra) and keeps that where it is correct and as
fast as the two kernels; its workspace then comes from nimble's region, not the graph's pool.
Otherwise the op runs as before (`runtime/kernels/fused.py`). On the CPU the body is the convolution,
interpreted as it was.

Runs after the other fusion passes, on what they left.
"""

from __future__ import annotations

from ..ir import Graph
from .fuse_conv import _leader
from .rewrite import Facts, fuse


def fuse_lone_convolutions(graph: Graph) -> Graph:
    """Each 2-D convolution that may lead a fused body (`fuse_conv._leader`) becomes one."""
    facts = Facts(graph)
    return fuse(graph, [[op.id] for op in graph.ops if _leader(graph, facts, op) is not None])
