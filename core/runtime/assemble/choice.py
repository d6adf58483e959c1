"""What one load-time choice is (`Choice`): the layout, the CUDA streams, cuDNN's algorithms, the
convolution fusion, the GEMM bias and the depthwise prologues a load builds and captures with.
`tune/choices.py` says which candidates a graph has and how they are searched; this floor builds
any of them (`lower.py`, `order.py`), and says what each setting touches: which weights a layout
re-strides (`conv_weights`) and which buffers (`channels_last_values`)."""

from __future__ import annotations

from dataclasses import dataclass

from ...ir import ACTIVATION, WEIGHT, Graph, Ref, refs_of
from ...ops import fusion
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
    found.update(graph.root(r) for op in graph.ops if op.target in UNMARKED_VIEWS for r in op.refs())
    return found


def channels_last_values(graph: Graph, same_strides: frozenset[str] = frozenset()) -> set[int]:
    """Planned 4-D buffers that no view shares (`viewed`) and that the artifact declares
    contiguous (its strides given as contiguous ones, or left out): the ones channels_last
    re-strides."""
    shared = viewed(graph, same_strides)
    return {v.id for v in graph.values if v.kind == ACTIVATION and v.alias_of is None and v.id not in shared
            and len(v.spec.shape) == 4 and not v.spec.offset
            and v.spec.is_contiguous}
