"""Ops that one kernel runs together with the op issued before them, on CUDA, chosen at load from
the issue order: a layer norm in the kernel of the elementwise op whose result it reads
(`norm_pairs`, run by `FusedKernel.with_norm`), the mean over height and width in the kernel of
the fused op whose result it reads (`mean_pairs`, run by `fused_mean.run`), and the head merge
after attention, whose copy takes attention's result straight into its buffer (`copy_pairs`), and
the elementwise op after a float32 product (bias and GELU, a residual add) in the product's
kernel (`product_pairs`, run by `gemm.Gemm.with_epilogue`), and the copy that reads a float32
product through views, whose elements the product's kernel stores where the copy would put them
(`scatter_pairs`, run by `gemm.Gemm.through`). `find` finds all five;
`placement.PlacedRun` runs each pair, and runs the two ops apart where the tensors do not fit.
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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from ..ir import ACTIVATION, Graph, Op, Ref
from ..ops import fusion
from ..plan.memory import read_later
from .kernels.gemm import Gemm
from .base import settings
from .kernels.fused import FusedKernel
from .placed.placement import RESHAPES, PlacedOp, height_and_width



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
         waits: Sequence, prologues: bool = False) -> Pairs:
    """The pairs of this issue order, on CUDA streams `stream_of` with `waits`; the prologue pairs
    too with `prologues`."""
    norms = norm_pairs(graph, placed, order, stream_of, waits)
    now = settings.current()
    found = Pairs(norms, mean_pairs(graph, placed, order, stream_of, waits) if now.mean_pairs else {},
                  copy_pairs(graph, placed, order, stream_of, waits),
                  product_pairs(graph, placed, order, stream_of, waits, set(norms)) if now.product_pairs else {},
                  scatter_pairs(graph, placed, order, stream_of, waits) if now.scatter_pairs else {})
    if now.input_pairs:
        found.inputs = input_pairs(graph, placed, order, stream_of, waits, taken(found))
    if prologues:
        found.prologues = prologue_pairs(graph, placed, taken(found))
    return found


def taken(found: Pairs) -> set[int]:
    """The ops in `found`'s pairs of every kind but prologues: none of them can be in a prologue pair."""
    ops: set[int] = set()
    for kind in (found.norms, found.means, found.copies, found.products, found.scatters):
        for first, rest in kind.items():
            ops |= {first, *_op_ids(rest)}
    for second, first in found.inputs.items():
        ops |= {first, second}
    return ops


def input_pairs(graph: Graph, placed: Sequence[PlacedOp], order: Sequence[int], stream_of: Sequence[int],
                waits: Sequence, taken: set[int]) -> dict[int, int]:
    """1x1 convolution op -> the elementwise op whose result it alone reads (`memory.read_later`,
    the pairs whose inputs the memory plan holds until the convolution), where both run as fused
    kernels, the convolution is the next op issued on the elementwise op's stream and waits for
    no other, and neither op is in another pair (`taken`). The elementwise op then writes
    nothing, and the convolution's kernel applies its body to each block of the input it loads
    (`pointwise_conv`), or runs it first where that does not fit. The executable keeps a pair only
    where the plan proves that it holds the elementwise op's inputs (`held_by`)."""
    next_on_stream = _next_on_stream(order, stream_of)
    found = {}
    for second, first in read_later(graph).items():
        if first in taken or second in taken or waits[second] or next_on_stream.get(first) != second \
                or not isinstance(placed[first].substitute, FusedKernel) \
                or not isinstance(placed[second].substitute, FusedKernel):
            continue
        found[second] = first
    return found


def held_by(graph: Graph, inputs: dict[int, int]) -> dict[int, list[int]]:
    """op -> the values it must hold for `inputs` (`input_pairs`): each elementwise op's inputs,
    held by its convolution (for `verify.check_plan`)."""
    return {second: list(graph.ops[first].refs()) for second, first in inputs.items()}


def _op_ids(obj) -> set[int]:
    """The ops of every PlacedOp in `obj` (a pair's tuple, lists within it)."""
    if isinstance(obj, PlacedOp):
        return {obj.op.id}
    return set().union(*(_op_ids(o) for o in obj)) if isinstance(obj, (tuple, list)) else set()


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
    readers, outputs, aliased = _readers(graph)
    found = {}
    for op in graph.ops:
        consumer = placed[op.id].substitute
        if op.id in taken or not isinstance(consumer, FusedKernel) or not _depthwise(graph, consumer.body):
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
                and not _depthwise(graph, before.body) and _per_channel(graph, before.body[1:], x):
            found[op.id] = producer
    return found


def _depthwise(graph: Graph, body) -> bool:
    """Whether `body` leads with a 2-D convolution of each channel alone, over a graph value."""
    if not fusion.leads_with_convolution(body):
        return False
    p = fusion.conv_params(body[0][0], body[0][1])
    if p is None or not isinstance(p["input"], Ref) or not isinstance(p["weight"], Ref):
        return False
    x, w = graph.values[p["input"].id].spec.shape, graph.values[p["weight"].id].spec.shape
    return len(x) == 4 and len(w) == 4 and w[1] == 1 and p["groups"] == w[0] == x[1]


def _per_channel(graph: Graph, nodes, x: int) -> bool:
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


def norm_pairs(graph: Graph, placed: Sequence[PlacedOp], order: Sequence[int], stream_of: Sequence[int],
               waits: Sequence) -> dict[int, tuple[PlacedOp, bool, FusedKernel]]:
    """elementwise op -> (the layer norm that reads its result, whether anything else reads that
    result, the kernel that runs both) for each elementwise op (fused or alone) whose result a
    layer norm reads, where the norm is the next op issued on the same stream and waits for
    nothing. `PlacedRun` runs each pair as one kernel (`FusedKernel.with_norm`), or as two where
    the tensors do not fit it."""
    norms = [op for op in graph.ops if op.target == "aten::layer_norm.default" and len(op.args) >= 5]
    return _after(graph, placed, order, stream_of, waits, norms, _elementwise_kernel)


def mean_pairs(graph: Graph, placed: Sequence[PlacedOp], order: Sequence[int], stream_of: Sequence[int],
               waits: Sequence) -> dict[int, tuple[PlacedOp, bool, FusedKernel]]:
    """fused op -> (the spatial mean that reads its 4-D result, whether anything else reads that
    result, the op's kernel) for each fused op whose result a mean over height and width reads
    (adaptive_avg_pool2d to 1x1, or mean.dim over the last two dimensions), where the mean is the
    next op issued on the same stream and waits for nothing. `PlacedRun` runs each pair as one
    kernel (`fused_mean.run`), or as two where the tensors do not fit it."""
    means = [op for op in graph.ops if _spatial_mean(graph, op)]

    def fused(graph: Graph, p: PlacedOp) -> FusedKernel | None:  # a cat-led body reads no tile of positions
        return p.substitute if isinstance(p.substitute, FusedKernel) \
            and not fusion.leads_with_concat(fusion.body_of(p.op)) else None

    return _after(graph, placed, order, stream_of, waits, means, fused)


def _spatial_mean(graph: Graph, op: Op) -> bool:
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


def _after(graph: Graph, placed: Sequence[PlacedOp], order: Sequence[int], stream_of: Sequence[int], waits: Sequence,
           seconds: Sequence[Op], kernel_of) -> dict[int, tuple[PlacedOp, bool, FusedKernel]]:
    """producer -> (the op of `seconds` that reads its result as its first argument and no
    other, whether anything else reads that result, `kernel_of(graph, producer)`), where that op
    is the next issued on the producer's stream, waits for nothing, and the kernel is not None."""
    next_on_stream = _next_on_stream(order, stream_of)
    readers, outputs, aliased = _readers(graph)
    pairs = {}
    for second in seconds:
        if not isinstance(second.args[0], Ref):
            continue
        x = second.args[0].id
        producer = graph.values[x].producer
        if producer is None or graph.values[x].alias_of is not None or waits[second.id] \
                or next_on_stream.get(producer) != second.id or any(isinstance(a, Ref) and a.id == x
                                                                    for a in second.args[1:]):
            continue
        kernel = kernel_of(graph, placed[producer])
        if kernel is None:
            continue
        store = readers.get(x, set()) != {second.id} or x in outputs or x in aliased
        pairs[producer] = (placed[second.id], store, kernel)
    return pairs


def _readers(graph: Graph) -> tuple[dict[int, set[int]], set[int], set[int]]:
    """(root value -> the ops that read it or a view of it, the roots of the graph's outputs, the
    roots that have views)."""
    return graph.readers(), {graph.root(o) for o in graph.outputs}, set(_views_of(graph))


def _views_of(graph: Graph) -> dict[int, set[int]]:
    """root value -> the values that are views of it."""
    views: dict[int, set[int]] = {}
    for v in graph.values:
        if v.alias_of is not None:
            views.setdefault(v.alias_of, set()).add(v.id)
    return views


def _elementwise_kernel(graph: Graph, p: PlacedOp) -> FusedKernel | None:
    """The kernel that computes `p` with a layer norm after it: its own, for an elementwise fused
    op; one made for it, for a lone elementwise op the fusion left alone (Swin's residual adds,
    which read a copying reshape); None for anything else."""
    op = p.op
    if isinstance(p.substitute, FusedKernel):
        return p.substitute if fusion.is_pointwise(fusion.body_of(op)) else None
    if op.target not in fusion.POINTWISE or op.mutates or len(op.outputs) != 1 \
            or graph.values[op.outputs[0]].spec.dtype not in fusion.FLOATS \
            or fusion.pointwise_problem((op.target, op.args, op.kwargs)) is not None:
        return None
    return FusedKernel(Op(op.id, fusion.FUSED, (((op.target, op.args, op.kwargs),),), (), op.outputs, (), (),
                          op.source))


def _next_on_stream(order: Sequence[int], stream_of: Sequence[int]) -> dict[int, int]:
    """op -> the op issued next on its stream."""
    following, last = {}, {}
    for op in order:
        if stream_of[op] in last:
            following[last[stream_of[op]]] = op
        last[stream_of[op]] = op
    return following


COPYING_READERS = frozenset({"aten::contiguous.default", "aten::reshape.default", "aten::flatten.using_ints"})


def copy_pairs(graph: Graph, placed: Sequence[PlacedOp], order: Sequence[int], stream_of: Sequence[int],
               waits: Sequence) -> dict[int, tuple[PlacedOp, PlacedOp]]:
    """op -> (a view of its result, the op that copies that view into a buffer) where the op has no
    out= kernel (its result is computed, then copied in), that view is its result's one reader and
    the copy the view's, and the view and the copy are the next ops on its stream, waiting for
    nothing. The head merge after attention is this: sdpa, transpose(1, 2), contiguous or reshape.
    `PlacedRun` then copies the computed result through the view straight into the copy's buffer
    (one copy where there were two; sdpa's result is already laid out as the merged heads), and
    the attention's own buffer is never written: only that view, then the copy, read it."""
    following = _next_on_stream(order, stream_of)
    readers: dict[int, set[int]] = {}
    for op in graph.ops:
        for r in op.refs():
            readers.setdefault(r, set()).add(op.id)
    outputs = set(graph.outputs)
    views_of = _views_of(graph)
    pairs = {}
    for p in placed:
        op = p.op
        if p.substitute is not None or p.out_fn is not None or len(op.outputs) != 1 or op.mutates \
                or graph.values[op.outputs[0]].alias_of is not None or graph.values[op.outputs[0]].kind != ACTIVATION:
            continue
        value = op.outputs[0]
        view = following.get(op.id)
        copy = following.get(view) if view is not None else None
        if copy is None or readers.get(value, set()) != {view} or value in outputs or waits[view] or waits[copy]:
            continue
        seen = graph.ops[view].outputs
        if len(seen) != 1 or graph.ops[view].mutates or views_of.get(value) != {seen[0]} or seen[0] in outputs or seen[0] in views_of \
                or readers.get(seen[0], set()) != {copy} or graph.ops[copy].target not in COPYING_READERS \
                or graph.values[graph.ops[copy].outputs[0]].alias_of is not None:
            continue
        pairs[op.id] = (placed[view], placed[copy])
    return pairs


def product_pairs(graph: Graph, placed: Sequence[PlacedOp], order: Sequence[int], stream_of: Sequence[int],
                  waits: Sequence, heads: set[int] = frozenset()
                  ) -> dict[int, tuple[PlacedOp, FusedKernel, tuple | None]]:
    """product op -> (the elementwise op that reads its result, the kernel that would run that op,
    (the view's value, its shape) where that op reads the result through a reshape, else None)
    for each float32 product (`gemm.applies`; not a small linear, `pooled_conv.SmallLinear`) whose result
    only that op reads, of the same shape, where it is the next op issued on the same stream and
    waits for nothing, and is not the first of a norm pair (`heads`: its kernel then takes the
    layer norm after it). Between the two there may be one view that reshapes the result, dense,
    into the op's shape (`_reshape`: GPT-2's `Conv1D` multiplies rows, then views them as
    [batch, tokens, features]), issued between them and waiting for nothing.
    `PlacedRun` runs each pair as one kernel where the product runs as nimble's
    (`gemm.Gemm.with_epilogue`); the product's own buffer is then never written."""
    following = _next_on_stream(order, stream_of)
    readers, outputs, aliased = _readers(graph)
    views_of = _views_of(graph)
    pairs = {}
    for p in _products(placed):
        value = p.op.outputs[0]
        second, shape, between, through = following.get(p.op.id), graph.values[value].spec.shape, set(), None
        if second is not None and not waits[second] and _reshape(graph, graph.ops[second], value, views_of):
            seen = graph.ops[second].outputs[0]
            shape, between, through = graph.values[seen].spec.shape, {second}, (seen, graph.values[seen].spec.shape)
            second = following.get(second)
        elif value in aliased:
            continue
        if second is None or second in heads or waits[second] or readers.get(value, set()) != {second} | between \
                or value in outputs or len(graph.ops[second].outputs) != 1 \
                or graph.values[graph.ops[second].outputs[0]].spec.shape != shape:
            continue
        kernel = _elementwise_kernel(graph, placed[second])
        if kernel is not None:
            pairs[p.op.id] = (placed[second], kernel, through)
    return pairs


def _products(placed: Sequence[PlacedOp]) -> list[PlacedOp]:
    """The ops whose substitute is nimble's float32 product (`gemm.Gemm`; not a small linear's kernel)."""
    return [p for p in placed if isinstance(p.substitute, Gemm) and len(p.op.outputs) == 1]


def _reshape(graph: Graph, op: Op, value: int, views_of: dict[int, set[int]]) -> bool:
    """Whether `op` views dense `value` in another shape, dense, and is its only view: the same
    elements in the same order, so a kernel that writes `value` in row-major order writes the
    view's elements in row-major order too."""
    if op.target not in RESHAPES or op.mutates or len(op.outputs) != 1 or not op.args \
            or not isinstance(op.args[0], Ref) or op.args[0].id != value:
        return False
    seen, spec = graph.values[op.outputs[0]].spec, graph.values[value].spec
    return views_of.get(value) == {op.outputs[0]} and seen.is_contiguous and seen.offset == 0 \
        and spec.is_contiguous and spec.offset == 0 and seen.numel == spec.numel


VIEWS = frozenset({*RESHAPES, "aten::permute.default", "aten::transpose.int"})


def scatter_pairs(graph: Graph, placed: Sequence[PlacedOp], order: Sequence[int], stream_of: Sequence[int],
                  waits: Sequence) -> dict[int, tuple[list[PlacedOp], PlacedOp]]:
    """product op -> (the views of its result, in issue order, the copy that reads the last) for
    each float32 product (`gemm.applies`; not a small linear) whose result is read only through a
    chain of 1 to `max_views` views (reshapes, permutations, transposes), each view the only reader
    and only view of the one before, ending in one copying op (`COPYING_READERS`) into a buffer of
    its own, where the views and the copy are the next ops on the product's stream and wait for
    nothing. Swin's window merge is this: the projection's rows [windows, 49, C] viewed as [B,
    h/7, w/7, 7, 7, C], permuted to [B, h/7, 7, w/7, 7, C] and reshaped (a copy) to [B, h, w, C].
    `PlacedRun` has the product's kernel store each element where the copy would put it
    (`gemm.Gemm.through`); the copy then has nothing left to do, and the product's own buffer is
    never written. The memory plan holds the product's inputs until the copy
    (`memory.held_inputs`), whose buffer the kernel writes while other tiles still read them."""
    following = _next_on_stream(order, stream_of)
    readers, outputs, _ = _readers(graph)
    views_of = _views_of(graph)
    pairs = {}
    for p in _products(placed):
        root, chain = p.op.outputs[0], []
        value, at = root, p.op.id
        while True:
            nxt = following.get(at)
            if nxt is None or waits[nxt] or len(chain) > settings.current().max_views:
                break
            op = graph.ops[nxt]
            if op.mutates or len(op.outputs) != 1 or not op.args or op.args[0] != Ref(value):
                break
            result = graph.values[op.outputs[0]]
            if op.target in COPYING_READERS and result.alias_of is None and result.kind == ACTIVATION:
                views = {graph.ops[v].outputs[0] for v in chain}
                if chain and root not in outputs and readers.get(root) == {*chain, nxt} \
                        and views_of.get(root) == views:
                    pairs[p.op.id] = ([placed[v] for v in chain], placed[nxt])
                break
            if op.target not in VIEWS or result.alias_of != root:
                break
            chain.append(nxt)
            value, at = op.outputs[0], nxt
    return pairs
