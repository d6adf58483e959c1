"""Input pairs: an elementwise op whose result a 1x1 convolution alone reads. The first op writes
nothing (`FusedKernel.deferred`), and the convolution's kernel computes its input as it loads it
(`kernels/pointwise_conv`, run by `kernels/on_load.OnLoad`); the lowering of a candidate sets them
(`assemble/lower.py`). An input pair moves the first op's reads later, to the second: the memory plan
holds the first op's inputs until the second (`memory.held_inputs`), and the load proves that on
the plan it loaded (`held_by`)."""

from __future__ import annotations

from typing import Sequence

from ...ir import Graph
from ...plan.memory import read_later
from ..kernels.fused import FusedKernel
from ..placed.placement import PlacedOp
from .common import next_on_stream


def input_pairs(graph: Graph, placed: Sequence[PlacedOp], order: Sequence[int], stream_of: Sequence[int],
                waits: Sequence, taken: set[int]) -> dict[int, int]:
    """1x1 convolution op -> the elementwise op whose result it alone reads (`memory.read_later`,
    the pairs whose inputs the memory plan holds until the convolution), where both run as fused
    kernels, the convolution is the next op issued on the elementwise op's stream and waits for
    no other, and neither op is in another pair (`taken`). The elementwise op then writes
    nothing, and the convolution's kernel applies its body to each block of the input it loads
    (`pointwise_conv`), or runs it first where that does not fit. The executable keeps a pair only
    where the plan proves that it holds the elementwise op's inputs (`held_by`)."""
    following = next_on_stream(order, stream_of)
    found = {}
    for second, first in read_later(graph).items():
        if first in taken or second in taken or waits[second] or following.get(first) != second \
                or not isinstance(placed[first].substitute, FusedKernel) \
                or not isinstance(placed[second].substitute, FusedKernel):
            continue
        found[second] = first
    return found


def held_by(graph: Graph, inputs: dict[int, int]) -> dict[int, list[int]]:
    """op -> the values it must hold for `inputs` (`input_pairs`): each elementwise op's inputs,
    held by its convolution (for `verify.check_plan`)."""
    return {second: list(graph.ops[first].refs()) for second, first in inputs.items()}
