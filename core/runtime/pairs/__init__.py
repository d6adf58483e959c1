"""Ops that one kernel runs together with the op issued before them, on CUDA, chosen at load from
the issue order: a layer norm in the kernel of the elementwise op whose result it reads
(`norm_pairs`, run by `FusedKernel.with_norm`), the mean over height and width in the kernel of
the fused op whose result it reads (`mean_pairs`, run by `fused_mean.run`), and the head merge
after attention, whose copy takes attention's result straight into its buffer (`copy_pairs`), and
the elementwise op after a float32 product (bias and GELU, a residual add) in the product's
kernel (`product_pairs`, run by `gemm.Gemm.with_epilogue`), and the copy that reads a float32
product through views, whose elements the product's kernel stores where the copy would put them
(`scatter_pairs`, run by `gemm.Gemm.through`). `find` finds all five;
`run.PairedRun` runs each pair, and runs the two ops apart where the tensors do not fit.
Where the load's choice asks for depthwise prologues (`tuning.Choice.prologues`, a candidate
while the `prologue_pairs` setting is on), it also finds the depthwise convolutions that apply their producer's
epilogue as they load (`prologue_pairs`): there both ops still run, each as its own kernel, but
the producer's epilogue moves from its kernel into its reader's. And it finds the elementwise ops
whose result a 1x1 convolution alone reads (`input_pairs`): the first op writes nothing, and the
convolution's kernel computes its input as it loads it (`pointwise_conv`).

A pair moves the second op's work earlier past no other op: the second is the next op on the
first's stream, and it waits for no other stream, so its buffer is free when the first runs,
except that it may hold an input the first op still reads (the plan frees an input once its last
reader is done). A kernel that writes one element per element it reads is safe with that; the
product's is not, so it declines where the two overlap. An input pair moves the first op's reads
later, to the second: the memory plan holds the first op's inputs until the second
(`memory.held_inputs`), and the executable proves that on the plan it loaded (`held_by`).

One kind per module, its finder beside its runner, in the order `find` looks for them: `norm`,
`mean`, `copies`, `product`, `scatter`, `inputs`, `prologue` (`common` holds what they share).
Which kinds a load looks for is its settings' (`base/settings.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from ...ir import Graph
from ..base.settings import DEFAULT, Settings
from ..kernels.fused import FusedKernel
from ..placed.placement import PlacedOp
from .common import op_ids
from .copies import copy_pairs
from .inputs import held_by, input_pairs
from .mean import mean_pairs
from .norm import norm_pairs
from .product import product_pairs
from .prologue import prologue_pairs
from .scatter import scatter_pairs

__all__ = ["Pairs", "copy_pairs", "find", "held_by", "input_pairs", "mean_pairs", "norm_pairs", "product_pairs",
           "prologue_pairs", "scatter_pairs", "taken"]


@dataclass
class Pairs:
    """Every pair of one load's issue order (see the module docstring), keyed by the first op."""

    norms: dict[int, tuple[PlacedOp, bool, FusedKernel]] = field(default_factory=dict)
    means: dict[int, tuple[PlacedOp, bool, FusedKernel]] = field(default_factory=dict)
    copies: dict[int, tuple[PlacedOp, PlacedOp]] = field(default_factory=dict)
    products: dict[int, tuple[PlacedOp, FusedKernel, tuple | None]] = field(default_factory=dict)
    scatters: dict[int, tuple[list[PlacedOp], PlacedOp]] = field(default_factory=dict)
    prologues: dict[int, int] = field(default_factory=dict)  # depthwise op -> the op whose epilogue it applies
    inputs: dict[int, int] = field(default_factory=dict)  # 1x1 convolution op -> the elementwise op it computes


def find(graph: Graph, placed: Sequence[PlacedOp], order: Sequence[int], stream_of: Sequence[int],
         waits: Sequence, prologues: bool = False, settings: Settings = DEFAULT) -> Pairs:
    """The pairs of this issue order, on CUDA streams `stream_of` with `waits`, of the kinds
    `settings` allow; the prologue pairs too with `prologues`."""
    norms = norm_pairs(graph, placed, order, stream_of, waits)
    found = Pairs(norms, mean_pairs(graph, placed, order, stream_of, waits) if settings.mean_pairs else {},
                  copy_pairs(graph, placed, order, stream_of, waits),
                  product_pairs(graph, placed, order, stream_of, waits, set(norms)) if settings.product_pairs else {},
                  scatter_pairs(graph, placed, order, stream_of, waits, settings.max_views)
                  if settings.scatter_pairs else {})
    if settings.input_pairs:
        found.inputs = input_pairs(graph, placed, order, stream_of, waits, taken(found))
    if prologues:
        found.prologues = prologue_pairs(graph, placed, taken(found))
    return found


def taken(found: Pairs) -> set[int]:
    """The ops in `found`'s pairs of every kind but prologues: none of them can be in a prologue pair."""
    ops: set[int] = set()
    for kind in (found.norms, found.means, found.copies, found.products, found.scatters):
        for first, rest in kind.items():
            ops |= {first, *op_ids(rest)}
    for second, first in found.inputs.items():
        ops |= {first, second}
    return ops
