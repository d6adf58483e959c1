"""Structural checks of a schedule and a memory plan against their graph, for plans read from
disk: a plan that passes cannot race. Each check raises ValueError naming the first breach."""

from __future__ import annotations

from ..ir import ACTIVATION, Graph
from .memory import MemoryPlan, buffer_uses, happens_before
from .schedule import Schedule


def check_schedule(graph: Graph, schedule: Schedule) -> list[int]:
    """Every dependency is issued first and enforced by stream order or waits. Returns the
    happens-before bitsets, which check_memory reuses."""
    for v in range(len(graph.ops)):
        for u in schedule.waits[v]:
            if schedule.position[u] >= schedule.position[v]:
                raise ValueError(f"op {v} waits on op {u}, which is issued after it")
    before = happens_before(graph, schedule)
    for op in graph.ops:
        for u in graph.deps(op):
            if not before[op.id] >> u & 1:
                raise ValueError(f"op {op.id} may start before op {u}, which it depends on")
    return before


def check_memory(graph: Graph, schedule: Schedule, memory: MemoryPlan, before: list[int]) -> None:
    """Every activation buffer is placed, large enough, and overlaps only buffers it is ordered
    with (every use of one happens-before the other's producer); graph outputs overlap nothing."""
    roots = [v.id for v in graph.values if v.kind == ACTIVATION and v.alias_of is None]
    uses = buffer_uses(graph, roots)
    outputs = {graph.root(o) for o in graph.outputs}
    for r in roots:
        if memory.offset[r] is None or memory.size[r] < graph.values[r].spec.storage_nbytes:
            raise ValueError(f"activation {r} has no buffer or too small a one")
    spans = sorted((memory.offset[r], memory.offset[r] + memory.size[r], r) for r in roots)
    for i, (start, end, a) in enumerate(spans):
        for start_b, _, b in spans[i + 1:]:
            if start_b >= end:
                break
            pa, pb = graph.values[a].producer, graph.values[b].producer
            ordered = (uses[a] & before[pb] == uses[a]) or (uses[b] & before[pa] == uses[b])
            if a in outputs or b in outputs or not ordered:
                raise ValueError(f"buffers of values {a} and {b} overlap but may be live at once")
