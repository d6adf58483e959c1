"""What one load-time choice is (`Choice`): the layout, the CUDA streams, cuDNN's algorithms, the
convolution fusion, the GEMM bias and the depthwise prologues a load builds and captures with.
`tune/choices.py` says which candidates a graph has and how they are searched; this floor builds
any of them (`lower.py`, `order.py`), and says what each setting touches: which weights a layout
re-strides (`conv_weights`) and which buffers (`channels_last_values`)."""

from __future__ import annotations

from dataclasses import dataclass

from ...ir import ACTIVATION, WEIGHT, Graph, Ref, refs_of
from ...ops import fusion
from ...ops.add_norm import ADD_LAYER_NORM, LAYER_NORM_BACKWARD_ADD
from ...plan.capped import CAPS

LAYOUTS = ("contiguous", "channels_last")
CAP = CAPS[0]  # the CUDA streams of the capped stream candidate, which the artifact stores
STREAMS = ("planned", f"at most {CAP}", "serial")
ALGORITHMS = ("heuristic", "benchmark")
CONVOLUTIONS = ("cudnn-fused", "split")
GEMM_BIAS = ("epilogue", "separate")
PROLOGUES = ("apart", "in depthwise")


@dataclass(frozen=True)
class Choice:
    layout: str = "contiguous"
    streams: str = "planned"
    algorithms: str = "heuristic"
    convolutions: str = "cudnn-fused"
    gemm_bias: str = "epilogue"
    prologues: str = "apart"

    def describe(self) -> str:
        """The four first settings; the GEMM bias and the prologues only where not the default."""
        separate = ", separate GEMM bias" if self.gemm_bias == "separate" else ""
        prologues = ", depthwise prologues" if self.prologues == PROLOGUES[1] else ""
        return (f"{self.layout}, {self.streams} streams, {self.algorithms} algorithms, {self.convolutions}"
                f"{separate}{prologues}")


def stream_cap(streams: str) -> int | None:
    """The most CUDA streams a `Choice.streams` setting allows (None: as many as planned)."""
    return {"planned": None, "serial": 1}.get(streams, CAP)


def every_choice() -> list[Choice]:
    return [Choice(layout, s, a, k, b, p) for layout in LAYOUTS for s in STREAMS for a in ALGORITHMS
            for k in CONVOLUTIONS for b in GEMM_BIAS for p in PROLOGUES]


def choice_of(fields: str) -> Choice | None:
    """The load-time choice that comma-separated `fields` name, Choice's fields in order (the later
    ones may be left out: their defaults), or None where they name none."""
    try:
        choice = Choice(*fields.split(","))
    except TypeError:  # too many fields
        return None
    return choice if choice in every_choice() else None


def conv_weights(graph: Graph) -> set[int]:
    """4-D weights that only convolutions read, as their weight operand."""
    as_weight, elsewhere = set(), set()
    for op in graph.ops:
        for target, args, kwargs in fusion.nodes_of(op):
            params = fusion.conv_params(target, args) if target in fusion.CONVOLUTIONS else None
            w = params["weight"] if params else None
            for r in refs_of((args, tuple(v for _, v in kwargs))):
                if graph.values[r].kind == WEIGHT:
                    (as_weight if w == Ref(r) and len(graph.values[r].spec.shape) == 4 else elsewhere).add(r)
    return as_weight - elsewhere


# ops whose result can share its input's storage though their schema does not say so (a training
# step's `_unsafe_view`: the graph gives its result no alias, but it runs as a view)
UNMARKED_VIEWS = frozenset({"aten::_unsafe_view.default"})


def viewed(graph: Graph, same_strides: frozenset[str] = frozenset()) -> set[int]:
    """The values (roots) that a view shares, but for views by an op of `same_strides` (a
    training step's `detach`: computed at run time, with its input's strides), and those that an
    op of UNMARKED_VIEWS reads (a vit_b_16 step's clone of attention's input gradient, which
    `_unsafe_view` could not view once laid out channels_last)."""
    found = {v.alias_of for v in graph.values if v.alias_of is not None
             and (v.producer is None or graph.ops[v.producer].target not in same_strides)}
    return found | _unmarked_reads(graph)


def _unmarked_reads(graph: Graph) -> set[int]:
    """The roots an op of UNMARKED_VIEWS reads."""
    return {graph.root(r) for op in graph.ops if op.target in UNMARKED_VIEWS for r in op.refs()}


def channels_last_values(graph: Graph, same_strides: frozenset[str] = frozenset(), *,
                         by_use: bool = False) -> set[int]:
    """Planned 4-D buffers that no view shares (`viewed`) and that the artifact declares
    contiguous (its strides given as contiguous ones, or left out): the ones channels_last
    re-strides.

    `by_use` (inference's layout): also the buffers that only permutes view (`permuted_only`: a
    permute runs on the laid-out buffer, so its view follows), and none of the maps whose last
    dim holds the features (`features_last`). ConvNeXt permutes each convolution's (N, C, H, W)
    result to (N, H, W, C) for its layer norm and linears and back: laid out channels_last, the
    convolution's result is that (N, H, W, C) map, dense, and the linears' (N, H, W, C) maps stay
    dense; re-strided as if their dim 1 were channels, each linear copied its input and result
    (H200, convnext_tiny batch 1: 1.78 ms of kernels a call channels_last, 0.91 contiguous)."""
    shared = viewed(graph, same_strides)
    if by_use:  # the shared values less those only permutes view (`permuted_only`)
        shared = (shared & _viewed_otherwise(graph)) | features_last(graph)
    return {v.id for v in graph.values if v.kind == ACTIVATION and v.alias_of is None and v.id not in shared
            and len(v.spec.shape) == 4 and not v.spec.offset
            and v.spec.is_contiguous}


PERMUTES = frozenset({"aten::permute.default", "aten::transpose.int"})  # views that take any strides


def permuted_only(graph: Graph, same_strides: frozenset[str] = frozenset()) -> set[int]:
    """The shared values (`viewed`) whose every view is a permute of the value itself (PERMUTES),
    read by no op of UNMARKED_VIEWS."""
    return viewed(graph, same_strides) - _viewed_otherwise(graph)


def _viewed_otherwise(graph: Graph) -> set[int]:
    """The roots that a view other than a permute of the root itself shares, or an op of
    UNMARKED_VIEWS reads."""
    other = {v.alias_of for v in graph.values if v.alias_of is not None and not (
        v.producer is not None and graph.ops[v.producer].target in PERMUTES
        and graph.ops[v.producer].args[0] == Ref(v.alias_of))}
    return other | _unmarked_reads(graph)


# ops that compute along their operands' last dim: a 4-D map they read or write is (N, ..., features);
# a training step's backward ops too (layer norm's and attention's)
LAST_DIM = frozenset({"aten::linear.default", "aten::matmul.default", "aten::layer_norm.default",
                      "aten::native_layer_norm.default", "aten::scaled_dot_product_attention.default",
                      "aten::native_layer_norm_backward.default", ADD_LAYER_NORM, LAYER_NORM_BACKWARD_ADD,
                      "aten::_scaled_dot_product_efficient_attention_backward.default",
                      "aten::_scaled_dot_product_flash_attention_backward.default",
                      "aten::_scaled_dot_product_cudnn_attention_backward.default"})
# ... where their dim argument (at the position given) is the last
LAST_DIM_ARG = {"aten::softmax.int": 1, "aten::_softmax.default": 1, "aten::log_softmax.int": 1,
                "aten::_log_softmax.default": 1, "aten::_softmax_backward_data.default": 2,
                "aten::_log_softmax_backward_data.default": 2}
# elementwise ops outside a fused op (a training step's backward keeps some: gelu's, a residual's
# add of two gradients) that join their same-shaped operands and result as a fused elementwise op does
ELEMENTWISE = frozenset({*fusion.POINTWISE, "aten::gelu_backward.default",
                         "aten::silu_backward.default", "aten::sigmoid_backward.default",
                         "aten::tanh_backward.default", "aten::hardtanh_backward.default"})


def _along_last(target: str, args: tuple) -> bool:
    at = LAST_DIM_ARG.get(target)
    return target in LAST_DIM or at is not None and len(args) > at and args[at] in (-1, 3)


def features_last(graph: Graph) -> set[int]:
    """4-D activations that an op of LAST_DIM reads or writes themselves (not through a view: a
    permuted map's base is laid out by its own use), and those an elementwise op (fused, or of
    ELEMENTWISE) joins to one of them (its operands and result of the same shape), to a fixed point."""
    def maps(op) -> set[int]:
        return {r for r in (*op.refs(), *op.outputs) if graph.values[r].kind == ACTIVATION
                and graph.values[r].alias_of is None and len(graph.values[r].spec.shape) == 4}

    found = set()
    for op in graph.ops:
        if any(_along_last(target, args) for target, args, _ in fusion.nodes_of(op)):
            found |= maps(op)
    joins = [op for op in graph.ops if op.target == fusion.FUSED and fusion.is_pointwise(fusion.body_of(op))
             or op.target in ELEMENTWISE]
    grown = True
    while grown:
        grown = False
        for op in joins:
            shape = graph.values[op.outputs[0]].spec.shape
            alike = {v for v in maps(op) if graph.values[v].spec.shape == shape}
            if alike & found and not alike <= found:
                found |= alike
                grown = True
    return found
