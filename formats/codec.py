"""JSON encoding of nimble's plain objects: Graph, Schedule, MemoryPlan.

Encoders return plain dicts with a fixed key order. Decoders check every field's type and range
and raise ArtifactError naming the first bad field, so nothing malformed reaches a constructor.
"""

from __future__ import annotations

import math
from typing import Any

from nimble.errors import ArtifactError, GraphError
from nimble.ir import INPUT, ITEMSIZE, WEIGHT, ACTIVATION, Graph, Local, Op, Ref, Special, TensorSpec, Value
from nimble.ops.fusion import FUSED, MAX_NODES as MAX_BODY
from nimble.plan.memory import ALIGNMENT, EXACT, LIVE_SET, MemoryPlan
from nimble.plan.capped import CAPS
from nimble.plan.schedule import Schedule

from .spec import MAX_DIMS, MAX_STRING, limit

_SPECIAL_KINDS = ("dtype", "device", "layout", "memory_format")


# ---------------------------------------------------------------------------------- encoding
def encode_arg(a: Any) -> Any:
    if isinstance(a, Ref):
        return {"ref": a.id}
    if isinstance(a, Special):
        return {a.kind: a.name}
    if isinstance(a, Local):
        return {"local": a.index}
    if isinstance(a, tuple):
        return [encode_arg(x) for x in a]
    if isinstance(a, float) and not math.isfinite(a):
        return {"float": repr(a)}  # 'inf', '-inf' or 'nan'
    return a


def encode_spec(spec: TensorSpec) -> dict:
    return {"shape": list(spec.shape), "dtype": spec.dtype, "strides": list(spec.strides), "offset": spec.offset}


def encode_graph(graph: Graph) -> dict:
    return {
        "inputs": list(graph.inputs),
        "outputs": list(graph.outputs),
        "values": [{"id": v.id, "kind": v.kind, "name": v.name, **encode_spec(v.spec),
                    "producer": v.producer, "alias_of": v.alias_of} for v in graph.values],
        "ops": [{"id": op.id, "target": op.target, "args": encode_arg(op.args),
                 "kwargs": [[k, encode_arg(a)] for k, a in op.kwargs], "outputs": list(op.outputs),
                 "mutates": list(op.mutates), "after": list(op.after), "source": op.source}
                for op in graph.ops],
    }


def encode_schedule(s: Schedule) -> dict:
    capped = {"capped": [{"cap": cap, "stream": list(cuda)} for cap, cuda in s.capped]} if s.capped else {}
    return {"requested": s.requested, "stream": list(s.stream), "order": list(s.order),
            "waits": [list(w) for w in s.waits], "reduction_edges": s.reduction_edges,
            "matching": s.matching, "critical_path": s.critical_path, "max_width": s.max_width, **capped}


def encode_memory(m: MemoryPlan) -> dict:
    return {"alignment": m.alignment, "arena_bytes": m.arena_bytes, "lower_bound_bytes": m.lower_bound_bytes,
            "lower_bound": m.lower_bound, "no_reuse_bytes": m.no_reuse_bytes,
            "buffers": [[v, off, m.size[v]] for v, off in enumerate(m.offset) if off is not None]}


# ---------------------------------------------------------------------------------- decoding
class _At:
    """'graph.values[12]', formatted only when an error names it."""

    __slots__ = ("base", "index")

    def __init__(self, base: str, index: int):
        self.base, self.index = base, index

    def __str__(self) -> str:
        return f"{self.base}[{self.index}]"


def _get(obj: dict, key: str, kind, where: str):
    try:
        value = obj[key]
    except (KeyError, TypeError):
        raise ArtifactError(f"{where}: missing field '{key}'") from None
    if type(value) is not kind:  # exact: a bool is not an int here
        if kind is int or not isinstance(value, kind):
            raise ArtifactError(f"{where}.{key} has the wrong type ({type(value).__name__})")
    if kind is str and len(value) > MAX_STRING:
        raise ArtifactError(f"{where}.{key} is longer than {MAX_STRING} characters")
    return value


def _ints(values, where, lo: int = 0, hi: int | None = None, key: str = "") -> tuple[int, ...]:
    """A list of ints in [lo, hi). `where` and `key` name it in an error; they are formatted only
    then, since a large graph has hundreds of thousands of these lists."""
    if type(values) is not list:
        raise ArtifactError(f"{where}{key} must be a list")
    if not values:
        return ()
    if not (all(type(x) is int for x in values) and min(values) >= lo
                       and (hi is None or max(values) < hi)):
        bad = next(x for x in values if type(x) is not int or x < lo or (hi is not None and x >= hi))
        raise ArtifactError(f"{where}{key} holds {bad!r}, outside [{lo}, {hi if hi is not None else 'inf'})")
    return tuple(values)


def _optional_id(value, where, hi: int, key: str = "") -> int | None:
    return None if value is None else _ints([value], where, 0, hi, key)[0]


def decode_arg(a: Any, n_values: int, where: str) -> Any:
    kind = type(a)
    if kind is int or kind is bool or a is None:
        return a
    if kind is list:
        return tuple([decode_arg(x, n_values, where) for x in a])
    if kind is dict:
        if len(a) != 1:
            raise ArtifactError(f"{where}: malformed argument {a!r}")
        (kind, value), = a.items()
        if kind == "ref":
            if type(value) is not int or not 0 <= value < n_values:
                raise ArtifactError(f"{where}: ref {value!r} is not a value id")
            return Ref(value)
        if kind == "local":  # a fused body's own result; _check_ops checks where it may appear
            if type(value) is not int or not 0 <= value < MAX_BODY:
                raise ArtifactError(f"{where}: local {value!r} is not a body node")
            return Local(value)
        if kind == "float" and value in ("inf", "-inf", "nan"):
            return float(value)
        if kind in _SPECIAL_KINDS and isinstance(value, str) and len(value) <= MAX_STRING:
            return Special(kind, value)
        raise ArtifactError(f"{where}: malformed argument {a!r}")
    if isinstance(a, float) and not math.isfinite(a):
        raise ArtifactError(f"{where}: a bare non-finite number")
    if isinstance(a, str) and len(a) > MAX_STRING:
        raise ArtifactError(f"{where}: a string argument longer than {MAX_STRING} characters")
    if a is None or isinstance(a, (bool, int, float, str)):
        return a
    raise ArtifactError(f"{where}: malformed argument {a!r}")


def decode_spec(obj: dict, where: str, cap: int | None = None) -> TensorSpec:
    shape = _get(obj, "shape", list, where)
    if len(shape) > MAX_DIMS:
        raise ArtifactError(f"{where}.shape has more than {MAX_DIMS} dimensions")
    shape = _ints(shape, where, key=".shape")
    dtype = _get(obj, "dtype", str, where)
    if dtype not in ITEMSIZE:
        raise ArtifactError(f"{where}.dtype {dtype!r} is not a known dtype")
    strides = _ints(_get(obj, "strides", list, where), where, key=".strides")
    if strides and len(strides) != len(shape):
        raise ArtifactError(f"{where}: {len(strides)} strides for {len(shape)} dimensions")
    spec = TensorSpec(shape, dtype, strides, _get(obj, "offset", int, where))
    cap = limit("MAX_TENSOR_BYTES") if cap is None else cap
    if spec.offset < 0 or spec.storage_nbytes > cap:
        raise ArtifactError(f"{where} spans {spec.storage_nbytes} bytes, over the cap of {cap} "
                            "(raise it with NIMBLE_MAX_TENSOR_BYTES if the model really needs it)")
    return spec


def _check_body_nodes(raw_ops: list) -> None:
    """Bounded work before any op is decoded: fused bodies hold MAX_BODY_NODES nodes at most in
    all (20,000 fused ops of 64 nodes took 21 s and 1.6 GB to validate)."""
    cap, total = limit("MAX_BODY_NODES"), 0
    for op in raw_ops:
        if isinstance(op, dict) and op.get("target") == FUSED and isinstance(op.get("args"), list) and op["args"] \
                and isinstance(op["args"][0], list):
            total += len(op["args"][0])
            if total > cap:
                raise ArtifactError(f"graph: its fused ops hold more than {cap} body nodes in all (raise the cap with "
                                    "NIMBLE_MAX_BODY_NODES if the model really needs it)")


def decode_graph(doc: dict) -> Graph:
    raw_values = _get(doc, "values", list, "graph")
    raw_ops = _get(doc, "ops", list, "graph")
    nv, no = len(raw_values), len(raw_ops)
    _check_body_nodes(raw_ops)
    cap = limit("MAX_TENSOR_BYTES")
    values = []
    for i, v in enumerate(raw_values):
        where = _At("graph.values", i)
        if _get(v, "id", int, where) != i:
            raise ArtifactError(f"{where}.id is not {i}")
        kind = _get(v, "kind", str, where)
        if kind not in (INPUT, WEIGHT, ACTIVATION):
            raise ArtifactError(f"{where}.kind {kind!r} is not input, weight or activation")
        values.append(Value(i, kind, decode_spec(v, where, cap), _get(v, "name", str, where),
                            _optional_id(v.get("producer"), where, no, ".producer"),
                            _optional_id(v.get("alias_of"), where, nv, ".alias_of")))
    ops = []
    for i, op in enumerate(raw_ops):
        where = _At("graph.ops", i)
        if _get(op, "id", int, where) != i:
            raise ArtifactError(f"{where}.id is not {i}")
        kwargs = []
        for pair in _get(op, "kwargs", list, where):
            if not (isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], str)):
                raise ArtifactError(f"{where}.kwargs holds a malformed entry")
            kwargs.append((pair[0], decode_arg(pair[1], nv, where)))
        ops.append(Op(i, _get(op, "target", str, where), decode_arg(_get(op, "args", list, where), nv, where),
                      tuple(kwargs), _ints(_get(op, "outputs", list, where), where, 0, nv, key=".outputs"),
                      _ints(_get(op, "mutates", list, where), where, 0, nv, key=".mutates"),
                      _ints(_get(op, "after", list, where), where, 0, no, key=".after"),
                      _get(op, "source", str, where)))
    graph = Graph(tuple(values), tuple(ops), _ints(_get(doc, "inputs", list, "graph"), "graph.inputs", 0, nv),
                  _ints(_get(doc, "outputs", list, "graph"), "graph.outputs", 0, nv))
    try:
        graph.lint()
    except GraphError as e:
        raise ArtifactError(f"graph is inconsistent: {e}") from None
    return graph


def decode_schedule(doc: dict, n_ops: int) -> Schedule:
    stream = _ints(_get(doc, "stream", list, "schedule"), "schedule.stream", 0, max(n_ops, 1))
    order = _ints(_get(doc, "order", list, "schedule"), "schedule.order", 0, max(n_ops, 1))
    raw_waits = _get(doc, "waits", list, "schedule")
    if len(stream) != n_ops or len(raw_waits) != n_ops or sorted(order) != list(range(n_ops)):
        raise ArtifactError(f"schedule does not cover the graph's {n_ops} ops exactly once")
    waits = tuple(_ints(w, "schedule.waits", 0, n_ops) for w in raw_waits)
    position = [0] * n_ops
    for i, v in enumerate(order):
        position[v] = i
    return Schedule(stream, order, tuple(position), waits,
                    *(_get(doc, k, int, "schedule") for k in ("reduction_edges", "matching", "critical_path",
                                                               "max_width")),
                    _get(doc, "requested", str, "schedule"), _decode_capped(doc, n_ops))


def _decode_capped(doc: dict, n_ops: int) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """The capped candidates (optional: artifacts before 2026-11-28 have none), typed and bounded
    here; `plan.capped.check` and the plan checker judge them."""
    raw = doc.get("capped", [])
    if type(raw) is not list or len(raw) > len(CAPS):
        raise ArtifactError(f"schedule.capped must be a list of at most {len(CAPS)} candidate"
                            f"{'s' if len(CAPS) > 1 else ''}, one per cap")
    out = []
    for k, entry in enumerate(raw):
        where = f"schedule.capped[{k}]"
        cap = _get(entry, "cap", int, where)
        if cap not in CAPS:
            raise ArtifactError(f"{where}.cap is {cap}; this nimble stores candidates capped at "
                                f"{', '.join(map(str, CAPS))} streams: recompile the model with this nimble")
        cuda = _ints(_get(entry, "stream", list, where), where, 0, cap, ".stream")
        if len(cuda) != n_ops:
            raise ArtifactError(f"{where}.stream does not cover the graph's {n_ops} ops exactly once")
        out.append((cap, cuda))
    return tuple(out)


def decode_memory(doc: dict, n_values: int) -> MemoryPlan:
    """The arena plan; its arena must be exactly the end of its furthest buffer, under the cap."""
    if _get(doc, "alignment", int, "memory") != ALIGNMENT:
        raise ArtifactError(f"memory.alignment is not {ALIGNMENT}")
    offsets: list[int | None] = [None] * n_values
    sizes = [0] * n_values
    cap = limit("MAX_ARENA_BYTES")
    for entry in _get(doc, "buffers", list, "memory"):
        value, off, size = _ints(entry, "memory.buffers entry", 0) if isinstance(entry, list) and len(entry) == 3 \
            else (None, 0, 0)
        if value is None or value >= n_values or offsets[value] is not None or off + size > cap:
            raise ArtifactError(f"memory.buffers entry {str(entry)[:80]} is malformed, out of range or repeated")
        if off % ALIGNMENT or size % ALIGNMENT or size == 0:
            raise ArtifactError(f"memory: the buffer of value {value} is not {ALIGNMENT}-byte aligned")
        offsets[value], sizes[value] = off, size
    arena = _get(doc, "arena_bytes", int, "memory")
    end = max((o + z for o, z in zip(offsets, sizes) if o is not None), default=0)
    if arena != end:
        raise ArtifactError(f"memory.arena_bytes is {arena}, but its buffers end at {end}")
    lower, no_reuse = (_get(doc, k, int, "memory") for k in ("lower_bound_bytes", "no_reuse_bytes"))
    if not 0 <= lower <= arena or no_reuse != sum(sizes):
        raise ArtifactError("memory: lower_bound_bytes or no_reuse_bytes is inconsistent with the buffers")
    kind = doc.get("lower_bound", EXACT)  # absent in artifacts written before it was recorded
    if kind not in (EXACT, LIVE_SET):
        raise ArtifactError(f"memory.lower_bound is {str(kind)[:40]!r}, not {EXACT!r} or {LIVE_SET!r}")
    return MemoryPlan(tuple(offsets), tuple(sizes), arena, lower, no_reuse, ALIGNMENT, kind)
