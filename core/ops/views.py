"""A value's views, replayed: which ops make the views of a graph value (`view_trees`), and what
they give when the value has other strides than the trace gave it (`replay`, on the meta device).
A training step asks both before it lays a value out otherwise: a result bound as computed in the
strides it came in (`runtime/joint`), a GEMM operand with padded rows (`passes/pad_gemm_rows`)."""

from __future__ import annotations

import torch

from ..ir import Graph
from . import targets
from .arguments import flatten_result, op_arguments

# ops whose result can share its input's storage though their schema does not say so (a training
# step's `_unsafe_view`: the graph gives its result no alias, but it runs as a view)
UNMARKED_VIEWS = frozenset({"aten::_unsafe_view.default"})

# views whose result is a function of their input's elements alone, not of its strides: where each
# view of a value is one of these and takes its strides, they need not be the trace's (as_strided,
# say, reads the strides themselves: its input keeps the trace's)
LOGICAL_VIEWS = frozenset(f"aten::{name}" for name in (
    "view.default", "_unsafe_view.default", "permute.default", "transpose.int", "t.default",
    "select.int", "slice.Tensor", "narrow.default", "unsqueeze.default", "squeeze.dim", "squeeze.dims",
    "squeeze.default", "expand.default", "detach.default", "alias.default", "unflatten.int", "flatten.using_ints",
    "split.Tensor", "split_with_sizes.default", "unbind.int", "chunk.default", "diagonal.default"))


def view_trees(graph: Graph) -> dict[int, tuple]:
    """Root value -> the ops, in graph order, that make its views (and views of those), and the
    views by an op of UNMARKED_VIEWS of it or of them."""
    trees: dict[int, list] = {}
    for op in graph.ops:
        roots = {graph.root(r) for r in op.refs()}
        made = [graph.values[o].alias_of for o in op.outputs if graph.values[o].alias_of is not None]
        for root in set(made) | (roots if op.target in UNMARKED_VIEWS else set()):
            trees.setdefault(root, []).append(op)
    return {root: tuple(ops) for root, ops in trees.items()}


def replay(shape, strides, dtype: torch.dtype, value: int, views: tuple) -> dict[int, torch.Tensor] | None:
    """Value id -> a meta tensor, for `value` laid out with `strides` and for every result of
    `views` (`view_trees`' for it), or None where one of them is not a view of LOGICAL_VIEWS or
    does not take its input as laid out."""
    meta = torch.device("meta")
    env = {value: torch.empty_strided(shape, strides, dtype=dtype, device=meta)}
    for op in views:
        if op.target not in LOGICAL_VIEWS:
            return None
        try:
            args, kwargs = op_arguments(op, env, meta)
            env.update(zip(op.outputs, flatten_result(targets.resolve(op.target, training=True)(*args, **kwargs))))
        except Exception:  # noqa: BLE001 (a view these strides do not take, or a tensor from outside the tree)
            return None
    return env
