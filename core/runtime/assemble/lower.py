"""One tuning candidate's kernels: fresh objects for each build (`lower`), so that nothing a
candidate sets is left on the kernels another candidate runs, and closing a load drops them all.

A fused op's kernel (`FusedKernel.lowered`) takes the candidate's convolution fusion and the
load's cuDNN workspaces; the kernel objects share what their calls measured (a choice measured
once holds for every candidate). A float32 product with a bias takes its GEMM bias
(`BiasedGemm`). Then the pairs the candidate's order allows (`pairs.find`, on the fresh kernels)
say which op defers its call to the 1x1 convolution that reads it (input pairs) and which writes
its convolution bare for the depthwise convolution that applies its epilogue (prologue pairs,
channels_last only)."""

from __future__ import annotations

import copy
import dataclasses

from ..kernels import gemm
from ..kernels.fused import FusedKernel
from ..kernels.pooled_conv import SmallLinear
from ..placed.placement import PlacedOp
from ..placed.substitutes import BiasedGemm
from .choice import Choice


def lower(placed: list[PlacedOp], choice: Choice, workspaces) -> list[PlacedOp]:
    """`placed` with each substitute made afresh for `choice` (the kernels share what they measured)."""
    return [dataclasses.replace(p, substitute=_lowered(p.substitute, choice, workspaces)) for p in placed]


def _lowered(substitute, choice: Choice, workspaces):
    if isinstance(substitute, FusedKernel):
        return substitute.lowered(choice.convolutions == "cudnn-fused", workspaces)
    if isinstance(substitute, (SmallLinear, gemm.Gemm)):  # the substitutes a product falls back to
        made = copy.copy(substitute)
        made.fallback = _lowered(substitute.fallback, choice, workspaces)
        return made
    if isinstance(substitute, BiasedGemm):
        made = copy.copy(substitute)
        made.separate = choice.gemm_bias == "separate"
        return made
    return substitute


def pair(placed: list[PlacedOp], found, choice: Choice) -> None:
    """Set the pairs `found` (`pairs.Pairs`, of these fresh kernels) on the kernels that run them."""
    for second, first in found.inputs.items():  # the 1x1 convolution computes its input
        placed[first].substitute.deferred = True
        placed[second].substitute.reads_deferred = placed[first].substitute
    if choice.layout == "channels_last":  # the layout the depthwise kernel takes: it applies its producer's epilogue
        for consumer, producer in found.prologues.items():
            placed[producer].substitute.bare = True
            placed[consumer].substitute.after_bare = placed[producer].substitute
