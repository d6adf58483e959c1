"""Mean pairs: the mean over height and width in the kernel of the fused op whose result it reads."""

from __future__ import annotations

from typing import Sequence

import torch

from ...ir import Graph, Op, Ref
from ...ops import fusion
from ..kernels import fused_mean
from ..kernels.fused import FusedKernel
from ..placed.placement import PlacedOp
from ..placed.substitutes import height_and_width
from .common import after


def mean_pairs(graph: Graph, placed: Sequence[PlacedOp], order: Sequence[int], stream_of: Sequence[int],
               waits: Sequence) -> dict[int, tuple[PlacedOp, bool, FusedKernel]]:
    """fused op -> (the spatial mean that reads its 4-D result, whether anything else reads that
    result, the op's kernel) for each fused op whose result a mean over height and width reads
    (adaptive_avg_pool2d to 1x1, or mean.dim over the last two dimensions), where the mean is the
    next op issued on the same stream and waits for nothing. `run` runs each pair as one kernel
    (`fused_mean.run`), or as two where the tensors do not fit it."""
    means = [op for op in graph.ops if spatial_mean(graph, op)]

    def fused(graph: Graph, p: PlacedOp) -> FusedKernel | None:  # a cat-led body reads no tile of positions
        return p.substitute if isinstance(p.substitute, FusedKernel) \
            and not fusion.leads_with_concat(fusion.body_of(p.op)) else None

    return after(graph, placed, order, stream_of, waits, means, fused)


def spatial_mean(graph: Graph, op: Op) -> bool:
    """Whether `op` is a mean of a 4-D floating tensor over its last two dimensions, in its dtype."""
    x = op.args[0] if op.args else None
    if not isinstance(x, Ref) or len(op.outputs) != 1 or graph.values[x.id].spec.dtype not in fusion.FLOATS \
            or len(graph.values[x.id].spec.shape) != 4:
        return False
    if op.target == "aten::adaptive_avg_pool2d.default":
        return len(op.args) == 2 and isinstance(op.args[1], (list, tuple)) and list(op.args[1]) == [1, 1] \
            and not op.kwargs
    if op.target != "aten::mean.dim" or len(op.args) < 2 or (len(op.args) > 3 and op.args[3] is not None) \
            or any(k != "keepdim" and not (k == "dtype" and v is None) for k, v in op.kwargs):
        return False
    return height_and_width(op.args[1])


def run(issue, p: PlacedOp, args, out: torch.Tensor) -> torch.Tensor | None:
    """The fused op `p` and, where one kernel can run both, the spatial mean after it
    (`fused_mean.run`): the tensor holding `p`'s result, or None with nothing run."""
    mean, store, kernel = issue.pairs.means[p.op.id]
    mean_out = issue.views.get(mean.op.outputs[0])
    if mean_out is None:
        return None
    done = fused_mean.MeanAfter(mean_out, store)
    got = fused_mean.run(kernel, args[0], out, done)
    if done.done:
        issue.written.add(mean.op.id)
    return got
