"""The plan document: one JSON object describing a compiled model, its ops and their outputs.

`nimble compile --json` prints it; outside tools check schedules and memory plans against it.
docs/plan-document.md documents every field. Bump SCHEMA_VERSION on any incompatible change.
"""

from __future__ import annotations

from ..ir import Graph
from . import capped

SCHEMA_VERSION = 1


def plan_document(graph: Graph, *, model: str, schedule=None, memory=None, passes=None, batches=None) -> dict:
    """The plan document for `graph`. `schedule` and `memory` fill the per-op stream, order and
    waits and the per-output offsets; where they are None, those fields are null. `passes` lists
    (name, ops after it) in the order they ran, the lowered graph first; null where unknown (an
    artifact written before nimble recorded them). `batches` maps each batch size after the first
    of a multi-batch artifact to its (graph, schedule, memory plan): the document describes the
    first in full and sums up the others."""
    batches = dict(sorted((batches or {}).items()))
    vals = graph.values
    ops = []
    for op in graph.ops:
        ops.append({
            "id": op.id,
            "target": op.target,
            "inputs": list(dict.fromkeys(op.refs())),
            "deps": list(graph.deps(op)),
            "stream": None if schedule is None else schedule.stream[op.id],
            "order": None if schedule is None else schedule.position[op.id],
            "waits": None if schedule is None else list(schedule.waits[op.id]),
            "source": op.source,
            "outputs": [{
                "value": o,
                "shape": list(vals[o].spec.shape),
                "dtype": vals[o].spec.dtype,
                "nbytes": vals[o].spec.nbytes,
                "offset": None if memory is None else memory.offset_of(graph, o),
                "alias_of": vals[o].alias_of,
            } for o in op.outputs],
        })
    weights = [v for v in vals if v.kind == "weight"]
    return {
        "schema_version": SCHEMA_VERSION,
        "model": model,
        "passes": None if passes is None else [{"pass": name, "ops": n} for name, n in passes],
        "inputs": list(graph.inputs),
        "outputs": list(graph.outputs),
        "values": [{"id": v.id, "name": v.name, "kind": v.kind, "shape": list(v.spec.shape),
                    "dtype": v.spec.dtype} for v in vals if v.kind != "activation"],
        "weight_bytes": sum(v.spec.nbytes for v in weights),
        "streams": None if schedule is None else schedule.num_streams,
        "syncs": None if schedule is None else schedule.num_waits,
        "schedule": None if schedule is None else {
            "requested": schedule.requested,
            "reduction_edges": schedule.reduction_edges,
            "matching": schedule.matching,
            "critical_path": schedule.critical_path,
            "max_width": schedule.max_width,
            "capped": [{"cap": cap, "streams": len(set(cuda)), "syncs": capped.as_schedule(schedule, cuda).num_waits,
                        "stream": list(cuda)} for cap, cuda in schedule.capped],
        },
        "arena_bytes": None if memory is None else memory.arena_bytes,
        "lower_bound_bytes": None if memory is None else memory.lower_bound_bytes,
        "lower_bound": None if memory is None else memory.lower_bound,
        "no_reuse_bytes": None if memory is None else memory.no_reuse_bytes,
        "ops": ops,
        "batch_sizes": [graph.values[graph.inputs[0]].spec.shape[0], *batches] if batches else [],
        "batches": [{"batch": b, "ops": len(g.ops), "streams": sch.num_streams, "syncs": sch.num_waits,
                     "arena_bytes": mem.arena_bytes} for b, (g, sch, mem) in batches.items()],
    }
