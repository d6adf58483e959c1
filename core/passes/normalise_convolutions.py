"""Every graph: a batched `aten::conv2d` becomes the `aten::convolution` it calls, so that both
frontends give one op (TorchScript records convolution, torch.export conv2d) and the runtime's
out= path for convolution (`runtime/placed/placement.py`) writes it into its planned buffer, instead of
computing it and copying it in."""

from __future__ import annotations

import dataclasses

from ..ir import Graph, Ref
from ..ops import fusion

CONV2D = "aten::conv2d.default"
CONVOLUTION = "aten::convolution.default"


def normalise_convolutions(graph: Graph) -> Graph:
    """Rewrite each `aten::conv2d.default` of a 4-D input, its defaults filled in, as
    `aten::convolution.default(input, weight, bias, stride, padding, dilation, False, (0, 0),
    groups)`. One with string padding ("same"), an unbatched input or keyword arguments stays."""
    ops, changed = [], False
    for op in graph.ops:
        p = fusion.conv_params(op.target, op.args) if op.target == CONV2D and not op.kwargs else None
        if p is None or not isinstance(p["input"], Ref) or len(graph.values[p["input"].id].spec.shape) != 4:
            ops.append(op)
            continue
        args = (p["input"], p["weight"], p["bias"], tuple(p["stride"]), tuple(p["padding"]), tuple(p["dilation"]),
                False, (0, 0), p["groups"])
        ops.append(dataclasses.replace(op, target=CONVOLUTION, args=args))
        changed = True
    return dataclasses.replace(graph, ops=tuple(ops)) if changed else graph
