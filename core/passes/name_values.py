"""Every graph: name each activation after the op that makes it, once the rewrites are done."""

from __future__ import annotations

import dataclasses

from ..ir import WEIGHT, Graph


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


def name_io(graph: Graph, inputs: list[str] | None,
            outputs: list[str] | None) -> tuple[Graph, list[tuple[str, str]]]:
    """The graph's inputs and outputs given the names a client sees (the model's own, or those a
    user asked for), in their order; None leaves that side as it is. An activation that held a
    name wanted takes another (`<name>_`). A name another input, output or weight holds, or an
    output that is an input or repeats an earlier output, keeps the graph's name: those are
    returned as (side, line saying why), side "inputs" or "outputs" (the caller refuses them where
    the user chose that side's names)."""
    values = list(graph.values)
    holder = {v.name: v.id for v in values}
    fixed = set(graph.inputs) | {v.id for v in values if v.kind == WEIGHT}
    problems: list[tuple[str, str]] = []

    def rename(vid: int, name: str, what: str, side: str) -> None:
        current = values[vid].name
        if name == current:
            fixed.add(vid)
            return
        other = holder.get(name)
        if other is not None and other in fixed:
            problems.append((side, f"{what} cannot be named {name!r}: {_kind(values[other], graph)} has that name"))
            return
        if other is not None:  # an activation: it takes another name
            free = name + "_"
            while free in holder:
                free += "_"
            values[other] = dataclasses.replace(values[other], name=free)
            holder[free] = other
        del holder[current]
        holder[name] = vid
        values[vid] = dataclasses.replace(values[vid], name=name)
        fixed.add(vid)

    for k, name in enumerate(inputs or []):
        rename(graph.inputs[k], name, f"input {k}", "inputs")
    done: set[int] = set()
    for k, name in enumerate(outputs or []):
        vid = graph.outputs[k]
        if vid in done or vid in graph.inputs:
            if values[vid].name != name:
                problems.append(("outputs", f"output {k} is {'input' if vid in graph.inputs else 'an earlier output'} "
                                            f"{values[vid].name!r} itself, so it cannot be named {name!r}"))
            continue
        done.add(vid)
        rename(vid, name, f"output {k}", "outputs")
    return dataclasses.replace(graph, values=tuple(values)), problems


def _kind(value, graph: Graph) -> str:
    if value.id in graph.inputs:
        return "an input"
    return "a weight" if value.kind == WEIGHT else "an output"
