"""nimble's IR: a static op list over typed tensor values. Plain frozen dataclasses, no torch.

A `Graph` holds `Value`s (graph inputs, weights and activations, each with a `TensorSpec`) and
`Op`s in program order. An op's arguments are IR constants: `Ref` for a tensor value, `Special`
for a torch enum (dtype, device, layout, memory format), plain Python scalars, `None`, strings and
tuples of these. A fused op's body (`ops/fusion.py`) also uses `Local` for a result inside it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Any

from .dtypes import STORABLE
from .errors import GraphError

INPUT, WEIGHT, ACTIVATION = "input", "weight", "activation"

ITEMSIZE = {d.name: d.itemsize for d in STORABLE}  # the dtypes a value may have (dtypes.py)


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: str
    strides: tuple[int, ...] = ()  # () means contiguous
    offset: int = 0  # storage offset in elements (nonzero for some views)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def is_contiguous(self) -> bool:
        """Row-major, whether the strides are left out or written down."""
        return not self.strides or tuple(self.strides) == contiguous_strides(self.shape)

    @functools.cached_property
    def nbytes(self) -> int:
        """Bytes of storage the tensor spans (a strided view may span more than numel elements)."""
        if self.numel == 0:
            return 0
        strides = self.strides or contiguous_strides(self.shape)
        span = 1 + sum((n - 1) * s for n, s in zip(self.shape, strides) if n > 0)
        return span * ITEMSIZE[self.dtype]

    @functools.cached_property
    def storage_nbytes(self) -> int:
        """Bytes of storage from its start to the tensor's last element."""
        return self.offset * ITEMSIZE[self.dtype] + self.nbytes


def dense_layout(shape, strides) -> bool:
    """Whether `strides` lay `shape`'s elements over their span once each (a permutation of a
    row-major layout; dims of one element may have any stride)."""
    expected = 1
    for stride, size in sorted((s, n) for n, s in zip(shape, strides) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


@dataclass(frozen=True)
class Ref:
    """An op argument that is the tensor value `id`."""

    id: int


@dataclass(frozen=True)
class Local:
    """Inside a fused op's body (`ops/fusion.py`): the result of the body's node `index`."""

    index: int


@dataclass(frozen=True)
class Special:
    """A torch enum argument: kind is 'dtype', 'device', 'layout' or 'memory_format'."""

    kind: str
    name: str


@dataclass(frozen=True)
class Value:
    id: int
    kind: str  # INPUT, WEIGHT or ACTIVATION
    spec: TensorSpec
    name: str
    producer: int | None = None  # the op that writes it; None for inputs and weights
    alias_of: int | None = None  # the value whose storage this one shares (its root base)


@dataclass(frozen=True)
class Op:
    id: int
    target: str  # e.g. "aten::_convolution.default"
    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...]
    outputs: tuple[int, ...]
    mutates: tuple[int, ...] = ()  # values this op writes in place
    after: tuple[int, ...] = ()  # ordering edges: ops that must finish first beyond data edges
    source: str = ""  # "file.py:12" of the model code that made this op

    def refs(self) -> tuple[int, ...]:
        """Ids of the tensor values this op reads, in argument order. Worked out once per op (an op
        is immutable; `replace` makes a new one): every pass and every `lint` asks, 44 times per op
        on a 12,000-op compile, which was 3 of its 16 s."""
        known = self.__dict__.get("_refs")
        if known is None:
            found: list[int] = []
            _collect(self.args + tuple(v for _, v in self.kwargs), found)
            known = self.__dict__["_refs"] = tuple(found)
        return known


# ------------------------------------------------------------------ walking and renumbering
def refs_of(arg) -> list[int]:
    """The value ids of every Ref in an argument (tuples walked, fused bodies included)."""
    if isinstance(arg, Ref):
        return [arg.id]
    found: list[int] = []
    if isinstance(arg, tuple):
        _collect(arg, found)
    return found


def _collect(arg: tuple, found: list[int]) -> None:
    # a loop with recursion only into nested tuples: every pass and every `lint` walks every op's
    # arguments, and nested generators (one per tuple level, each re-yielding) were the largest
    # item in a profile of a 12,000-op compile
    for a in arg:
        if isinstance(a, Ref):
            found.append(a.id)
        elif isinstance(a, tuple):
            _collect(a, found)


def map_refs(arg, fn):
    """`arg` with each Ref `r` replaced by `fn(r)`: tuples are walked (fused bodies included) and
    every other leaf is kept, as torch.fx's `map_arg` does for nodes."""
    if isinstance(arg, Ref):
        return fn(arg)
    if isinstance(arg, tuple):
        return tuple([map_refs(a, fn) for a in arg])  # a list first: faster than a generator here
    return arg


def renumber(values, ops, inputs, outputs) -> Graph:
    """The graph of `values` and `ops` (kept from a graph whose ids they still carry, each list in
    its order) with dense ids: every Ref, producer, alias, output, write and ordering edge follows.
    Whatever they point at must be kept."""
    vmap = {v.id: i for i, v in enumerate(values)}
    omap = {op.id: i for i, op in enumerate(ops)}
    if all(k == i for k, i in vmap.items()) and all(k == i for k, i in omap.items()) \
            and len(vmap) == len(values) and len(omap) == len(ops):  # dense already
        return Graph(tuple(values), tuple(ops), tuple(inputs), tuple(outputs))

    def ref(r: Ref) -> Ref:
        return Ref(vmap[r.id])

    # the constructors rather than `replace`, which looks up the fields of every object it copies
    new_values = tuple(Value(vmap[v.id], v.kind, v.spec, v.name, None if v.producer is None else omap[v.producer],
                             None if v.alias_of is None else vmap[v.alias_of]) for v in values)
    new_ops = tuple(Op(omap[op.id], op.target, map_refs(op.args, ref),
                       tuple([(k, map_refs(a, ref)) for k, a in op.kwargs]),
                       tuple([vmap[o] for o in op.outputs]), tuple([vmap[m] for m in op.mutates]),
                       tuple([omap[a] for a in op.after]), op.source) for op in ops)
    return Graph(new_values, new_ops, tuple(vmap[i] for i in inputs), tuple(vmap[o] for o in outputs))


def with_ordering_edges(graph: "Graph") -> "Graph":
    """`graph` with every op's ordering edges worked out again from its writes: in-place writes and
    reads through aliases need edges that data flow alone does not give. A write waits for earlier
    readers of the same storage, and later readers wait for the write."""
    last_write: dict[int, int] = {}
    readers: dict[int, list[int]] = {}
    ops = []
    for op in graph.ops:
        data = {graph.values[r].producer for r in op.refs()}
        after: set[int] = set()
        for r in op.refs():
            storage = graph.root(r)
            if storage in last_write:
                after.add(last_write[storage])
            readers.setdefault(storage, []).append(op.id)
        for m in op.mutates:
            storage = graph.root(m)
            after.update(x for x in readers.get(storage, []) if x != op.id)
            readers[storage] = []
            last_write[storage] = op.id
        after -= data | {op.id}
        edges = tuple(sorted(after))
        ops.append(op if edges == op.after else replace(op, after=edges))  # most ops keep theirs
    return replace(graph, ops=tuple(ops))


@dataclass(frozen=True)
class Graph:
    values: tuple[Value, ...]  # values[i].id == i
    ops: tuple[Op, ...]  # ops[i].id == i, in a valid program order
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]

    @property
    def weights(self) -> tuple[int, ...]:
        return tuple(v.id for v in self.values if v.kind == WEIGHT)

    def root(self, value: int) -> int:
        """The value that owns `value`'s storage: itself, or the base it is a view or alias of."""
        alias = self.values[value].alias_of
        return value if alias is None else alias

    def readers(self) -> dict[int, set[int]]:
        """root value -> the ops that read it or a view of it."""
        readers: dict[int, set[int]] = {}
        for op in self.ops:
            for r in op.refs():
                readers.setdefault(self.root(r), set()).add(op.id)
        return readers

    def describe(self, ids) -> str:
        """`name: dtype[shape]` of each value in `ids`, for a repr or a message."""
        return ", ".join(f"{self.values[i].name}: {self.values[i].spec.dtype}{list(self.values[i].spec.shape)}"
                         for i in ids)

    def deps(self, op: Op) -> tuple[int, ...]:
        """Ops that must finish before `op` starts: producers of its inputs plus ordering edges."""
        producers = {self.values[r].producer for r in op.refs()}
        producers.discard(None)
        return tuple(sorted(producers | set(op.after)))

    def lint(self) -> None:
        """Check the invariants every stage relies on; raise GraphError naming the first breach.
        These are `if`s, not asserts: graphs come from files too, and `python -O` strips asserts.
        (A breach's words are made only once one is found: this runs after every pass.)"""
        n_values, n_ops = len(self.values), len(self.ops)
        kinds = (INPUT, WEIGHT, ACTIVATION)
        for i, v in enumerate(self.values):
            if not (v.id == i and v.kind in kinds and (v.producer is None) == (v.kind != ACTIVATION)
                    and (v.producer is None or 0 <= v.producer < n_ops)
                    and (v.alias_of is None or (0 <= v.alias_of < n_values and v.alias_of != i
                                                and self.values[v.alias_of].alias_of is None))):
                _require(v.id == i, f"value {i} has id {v.id}")
                _require(v.kind in kinds, f"value {i} has kind {v.kind!r}")
                _require((v.producer is None) == (v.kind != ACTIVATION), f"value {i}: producer/kind mismatch")
                _require(v.producer is None or 0 <= v.producer < n_ops, f"value {i} has no producer op {v.producer}")
                _require(False, f"value {i} aliases {v.alias_of}, which is not a root")
        _require(len(set(self.inputs)) == len(self.inputs), "a graph input is listed twice")
        _require(sorted(self.inputs) == [v.id for v in self.values if v.kind == INPUT],
                 "the graph inputs are not exactly the input values")
        seen: set[int] = {*self.inputs, *self.weights}
        values = self.values
        for i, op in enumerate(self.ops):
            _require(op.id == i, f"op {i} has id {op.id}")
            for r in op.refs():
                if r not in seen:
                    _require(False, f"op {i} ({op.target}) reads value {r} before it is written")
            for a in op.after:
                if not 0 <= a < i:
                    _require(False, f"op {i} has an ordering edge from a later op")
            for o in op.outputs:
                if not (0 <= o < n_values and values[o].producer == i and o not in seen):
                    _require(False, f"value {o} is not produced by op {i} alone")
                seen.add(o)
            for m in op.mutates:
                if m not in seen:
                    _require(False, f"op {i} writes value {m}, which does not exist yet")
        _require(all(v.producer is None or v.id in seen for v in self.values),
                 "a value names a producer that does not output it")
        for o in self.outputs:
            _require(o in seen, f"graph output {o} is never written")


def _require(condition: bool, breach: str) -> None:
    if not condition:
        raise GraphError(breach)
