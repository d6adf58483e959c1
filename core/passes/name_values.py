"""Every graph: name each activation after the op that makes it, once the rewrites are done."""

from __future__ import annotations

import dataclasses

from ..ir import Graph


def name_values(graph: Graph) -> Graph:
    """`relu_12`: the result of op 12, a relu. Ops are numbered in the canonical order the rewrites
    leave, before fusion, so a name does not move when a later pass fuses ops, and the same model
    gets the same names from either frontend."""
    values = list(graph.values)
    for op in graph.ops:
        name = f"{op.target.split('::')[-1].split('.')[0]}_{op.id}"
        for o in op.outputs:
            values[o] = dataclasses.replace(values[o], name=name)
    return dataclasses.replace(graph, values=tuple(values))
