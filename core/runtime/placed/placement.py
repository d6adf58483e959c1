"""Each op of a graph resolved once for running so that its results land at their planned arena
offsets (`prepare`), and the arena seen as one tensor per planned value (`arena_views`).

Each op whose output is a planned buffer writes straight into its arena view through the op's
`out=` overload. Where that overload would only compute and then copy (convolution, relu), a
substitute with a real out= kernel is used (`substitutes.py`); a fused op runs as its
`FusedKernel`, a float32 product as nimble's (`kernels/gemm.Gemm`), attention as a generated
writer (`kernels/small_attention.Attention`). An op with no out= overload computes, then copies
into its view (`run.PlacedRun`). Views and in-place results are whatever the op returns: views of
the arena, of inputs or of weights.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from ...ir import ACTIVATION, Graph, Op, contiguous_strides, refs_of
from ...ops import fusion, interpret, targets, types
from ...ops.attention import ATTENTION
from ...plan.memory import MemoryPlan
from ..kernels import gemm
from ..kernels.fused import FusedKernel
from ..kernels.pooled_conv import SmallLinear
from ..kernels.small_attention import Attention
from .substitutes import SUBSTITUTES, BiasedGemm, small_product


def _copy_into(self, src, non_blocking=False, *, out):
    """`aten::copy(self, src)` into `out`, a buffer shaped and typed as `self`: its result is src
    broadcast to self's shape in self's dtype, which reads nothing of self but its shape. Its own
    out= overload computes the functional op first, and that clones self with its strides kept:
    self as a view of the arena (a training step's `empty` filled by a copy), the whole arena,
    1894 MiB at once in efficientnet_b0's step at batch 32 (H200, 2026-11-30)."""
    return out.copy_(src, non_blocking=non_blocking)


WRITTEN_OUT = {"aten::copy.default": (_copy_into, ("out",))}  # functional op -> (its out= writer, out names)


@functools.lru_cache(maxsize=None)
def out_overload(target: str, training: bool = False):
    """The `out=` overload that matches a functional overload argument for argument (or one of
    `WRITTEN_OUT`), or None. Returns (overload, names of its out arguments). Cached: a graph
    repeats few targets. `training`: a training graph's target (`targets.resolve`), whose backward
    ops name their out= overloads otherwise too (`threshold_backward.grad_input`)."""
    if target in WRITTEN_OUT:
        return WRITTEN_OUT[target]
    fn = targets.resolve(target, training)
    functional = [(a.name, str(a.type)) for a in fn._schema.arguments]
    packet = fn.overloadpacket
    for name in sorted(packet.overloads()):
        if "out" not in name and not (training and name.startswith("grad_")):
            continue
        schema = getattr(packet, name)._schema
        outs = [a for a in schema.arguments if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write]
        rest = [(a.name, str(a.type)) for a in schema.arguments if a not in outs]
        if rest == functional and len(outs) == len(fn._schema.returns):
            return getattr(packet, name), tuple(a.name for a in outs)
    return None


def copies(overload) -> bool:
    """Whether an out= overload is one that torch generates for a functional op (`autogen` in its
    native functions): it computes the result into new memory, then copies it into `out`. A
    training step binds such an op's results as computed instead (`loose`): the same memory for a
    moment, and one pass over it less (resnet50's step has 53 batch norm backwards and 33 relus
    so). `WRITTEN_OUT`'s copy is nimble's own writer, never one of these. (Inference's
    `COPYING_OUT` names the ones it has substitutes for.)"""
    schema = getattr(overload, "_schema", None)
    if schema is None:
        return False
    name = f"{schema.name}.{schema.overload_name}" if schema.overload_name else schema.name
    return torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeExplicitAutograd")


COPYING_OUT = frozenset({"aten::convolution.default", "aten::_convolution.default", "aten::relu.default",
                         "aten::native_layer_norm.default"})

# ops whose out= kernel writes its result in its input's memory format whatever the given buffer's
# strides, on CUDA: max pooling and its backward of a channels_last map into contiguous buffers
# (buffers that a view reads: the backward of a concatenation after the pooling slices its gradient;
# SqueezeNet's and GoogLeNet's channels_last steps had their gradients wrong below each pooling), and
# average pooling and its backward either way (MaxViT's shortcut pools a contiguous map into a
# channels_last buffer: its step's gradients were 0.97 off; H200, torch 2.11, `tools/out_layouts.py
# --device cuda` finds them). A training step binds their results as computed instead
# (`runtime/joint`); inference computes and copies average pooling in where no substitute of its
# own writes the buffer (nimble's pooling kernels take any strides).
STRIDES_IGNORED = frozenset({"aten::max_pool2d_with_indices.default",
                             "aten::max_pool2d_with_indices_backward.default",
                             "aten::avg_pool2d.default", "aten::avg_pool2d_backward.default"})

# out= kernels that write some buffers wrong, by the buffers they write right (torch 2.13's CPU,
# 0.9 to 5.0 off otherwise): softmax, log-softmax and their backwards a contiguous buffer only
# (Swin V2's attention scores, 4-D, in channels_last steps), exact GELU a contiguous one or one of
# its input's strides (MaxViT's 4-D GELUs). A training step writes through them only there, and
# otherwise computes and copies in (`runtime/joint`).
CONTIGUOUS_OUT, SAME_STRIDES_OUT = "contiguous", "contiguous or its input's strides"
LAYOUT_BOUND = {**{t: CONTIGUOUS_OUT for t in ("aten::_softmax.default", "aten::_log_softmax.default",
                                               "aten::_softmax_backward_data.default",
                                               "aten::_log_softmax_backward_data.default")},
                "aten::gelu.default": SAME_STRIDES_OUT}


@dataclass
class PlacedOp:
    op: Op
    fn: Callable
    out_fn: Callable | None  # the op's out= overload, used when every output is a planned buffer
    out_names: list[str]
    substitute: Callable | None
    clamps: tuple = ()  # index arguments read clamped into range on CUDA (`indices.py`)
    # writes the op's result into any tensor of its shape and dtype, whatever its strides, or
    # declines (False): generated attention (`small_attention.Attention`)
    writer: Callable | None = None


def prepare(graph: Graph) -> list[PlacedOp]:
    """Resolve every op once: its function, out= overload and substitute."""
    placed = []
    for op in graph.ops:
        if op.target == fusion.FUSED:
            placed.append(PlacedOp(op, interpret.run_fused, None, [], FusedKernel(op)))
            continue
        # one-result ops of STRIDES_IGNORED (average pooling): computed and copied in where no
        # substitute writes the buffer; max pooling's indices variant keeps its out= overload here
        found = None if op.target in COPYING_OUT or op.target in STRIDES_IGNORED and len(op.outputs) == 1 \
            else out_overload(op.target)
        substitute = BiasedGemm(op.target == "aten::linear.default") if BiasedGemm.applies(graph, op) \
            else SUBSTITUTES.get(op.target)
        if gemm.applies(graph, op):
            substitute = gemm.Gemm(op.id, op.target, substitute)
        product = small_product(graph, op)
        if product:
            substitute = SmallLinear(op.id, substitute, product)
        writer = None
        if op.target == ATTENTION and not list(refs_of(tuple(v for _, v in op.kwargs))):
            writer = Attention(op.id, dict(op.kwargs))
        placed.append(PlacedOp(op, targets.resolve(op.target), found[0] if found else None,
                               found[1] if found else [], substitute, writer=writer))
    return placed


def arena_views(graph: Graph, memory: MemoryPlan, arena: torch.Tensor, channels_last=()) -> dict[int, torch.Tensor]:
    """Value id -> a tensor over its planned bytes, for every planned (root) activation. The values
    in `channels_last` (dense 4-D buffers) get channels_last strides over the same bytes."""
    views = {}
    for v in graph.values:
        off = memory.offset[v.id]
        if v.kind != ACTIVATION or off is None:
            continue
        dtype = types.DTYPES[v.spec.dtype]
        flat = arena[off: off + memory.size[v.id]].view(dtype)
        if v.id in channels_last:
            n, c, h, w = v.spec.shape
            strides = (h * w * c, 1, w * c, c)
        else:
            strides = v.spec.strides or contiguous_strides(v.spec.shape)
        views[v.id] = flat.as_strided(v.spec.shape, strides, flat.storage_offset() + v.spec.offset)  # absolute
    return views
