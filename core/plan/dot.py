"""Graphviz picture of a schedule: ops coloured by stream, waits as dashed edges."""

from __future__ import annotations

from ..ir import Graph
from .schedule import Schedule, transitive_reduction


def quoted(text: str) -> str:
    """`text` as the inside of a DOT string: quotes and backslashes escaped and control characters
    dropped, so a name from an artifact cannot close the string and add attributes (a URL, say)."""
    return "".join(c for c in text if c.isprintable()).replace("\\", "\\\\").replace('"', '\\"')


def to_dot(graph: Graph, schedule: Schedule, title: str = "nimble") -> str:
    """Reduction edges inside a stream are solid; waits are dashed red; cross-stream edges that
    earlier waits already imply (under a stream cap) are dotted grey."""
    title = quoted(title)
    lines = [f'digraph "{title}" {{', "  rankdir=TB;", '  node [shape=box, style="filled,rounded", fontsize=10];',
             f'  label="{title}: {len(graph.ops)} ops, {schedule.num_streams} streams, {schedule.num_waits} waits";']
    for op in graph.ops:
        s = schedule.stream[op.id]
        hue = (s * 0.618033988749895) % 1.0
        name = quoted(op.target.split("::")[-1].split(".")[0])
        lines.append(f'  op{op.id} [label="{op.id}: {name}\\ns{s} #{schedule.position[op.id]}", '
                     f'fillcolor="{hue:.3f} 0.35 0.95"];')
    reduced = transitive_reduction([graph.deps(op) for op in graph.ops])
    for v, preds in enumerate(reduced):
        waits = set(schedule.waits[v])
        for u in preds:
            if u in waits:
                style = ' [style=dashed, color="#cc0000"]'
            elif schedule.stream[u] != schedule.stream[v]:  # implied by stream order and other waits
                style = ' [style=dotted, color="#888888"]'
            else:
                style = ""
            lines.append(f"  op{u} -> op{v}{style};")
    lines.append("}")
    return "\n".join(lines) + "\n"
