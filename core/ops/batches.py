"""The graphs of a multi-batch artifact are one program at several batch sizes, each keeping the
rows of its batch apart (`rows.batch_rows`).

`same_program(top, graph, ...)` checks that a member graph is the top graph with the batch
dimension substituted: the same ops with the same arguments (a size argument of a reshape, an
expand or a new_* factory aside, which the preflight ties to the declared shapes), the same values,
shapes equal but along the rows. `check_batches` runs both checks on every member; compile and
every read of an artifact call it. `distinct_rows` makes inputs whose rows differ, for the numeric
checks beside the proof.
"""

from __future__ import annotations

from ..ir import Graph, Op, Ref
from . import fusion
from .targets import named_arguments as arguments
from .rows import Rows, RowsError, batch_rows, name_of

# size arguments that follow from the result's declared shape (the preflight checks that they give it)
SIZE_ARGUMENTS = {"view": "size", "reshape": "shape", "_unsafe_view": "size", "expand": "size",
                  "new_zeros": "size", "new_ones": "size", "new_full": "size", "unflatten": "sizes"}


def same_program(top: Graph, graph: Graph, rows: dict[int, Rows | None], top_batch: int) -> None:
    """RowsError unless `graph` (its `rows` from `batch_rows`) is `top` (batch `top_batch`) with
    the batch substituted: the same values but for the size of the dimension
    that holds the rows, and the same ops with the same arguments (a size argument that the
    result's shape fixes aside)."""
    if (len(top.values), len(top.ops), top.inputs, top.outputs) != \
            (len(graph.values), len(graph.ops), graph.inputs, graph.outputs):
        raise RowsError(f"its graph has other values, ops, inputs or outputs than batch {top_batch}'s")
    # a reshape may be a view at one batch size and a copy at another; that matters only to writes
    writes = any(op.mutates for g in (top, graph) for op in g.ops)
    for mine, theirs in zip(graph.values, top.values):
        r, want = rows[mine.id], list(mine.spec.shape)
        if r is not None:
            want[r.axis] = top_batch * r.inner
        if (mine.kind, mine.name, mine.producer, mine.spec.dtype, tuple(want)) != \
                (theirs.kind, theirs.name, theirs.producer, theirs.spec.dtype, theirs.spec.shape) or \
                (writes and mine.alias_of != theirs.alias_of):
            raise RowsError(f"value {mine.id} ('{mine.name[:60]}') is not batch {top_batch}'s with the batch "
                            "substituted")
    for mine, theirs in zip(graph.ops, top.ops):
        if (mine.outputs, mine.mutates, mine.after) != (theirs.outputs, theirs.mutates, theirs.after) or \
                _fixed(mine, graph, rows) != _fixed(theirs, top, rows):
            raise RowsError(f"op {mine.id} {mine.target} is not batch {top_batch}'s op with the batch substituted")


def _fixed(op: Op, graph: Graph, rows: dict[int, Rows | None]):
    """The op's target and the arguments that must be the same at every batch size. A fused body
    of one node is that node's op (a pass may fuse a lone broadcast op at one batch size only)."""
    if op.target == fusion.FUSED:
        body = op.args[0]
        if len(body) != 1:
            return op.target, op.args, op.kwargs
        op = Op(op.id, body[0][0], body[0][1], body[0][2], op.outputs)
    name, a = name_of(op.target), arguments(op)
    a.pop(SIZE_ARGUMENTS.get(name), None)
    x = a.get("self")
    if name == "slice" and isinstance(x, Ref) and rows[x.id] is not None:
        size = graph.values[x.id].spec.shape[rows[x.id].axis]
        if a["dim"] % len(graph.values[x.id].spec.shape) == rows[x.id].axis and a["end"] is not None \
                and a["end"] >= size:
            a["end"] = None  # x[:] along the rows, whatever the end said
    return op.target, a


def check_batches(members: dict[int, Graph]) -> None:
    """RowsError unless every graph of a multi-batch artifact (`members`: batch -> graph) keeps the
    rows of its batch apart, by one function for every row, and each is the top graph (the
    smallest batch's) with the batch substituted."""
    sizes = sorted(members)
    top = members[sizes[0]]
    for b in sizes[1:] if sizes[0] == 1 else sizes:
        try:
            same_program(top, members[b], batch_rows(members[b], b), sizes[0])
        except RowsError as e:
            raise RowsError(f"batch {b}: {e}") from None


def distinct_rows(samples: list, batch: int) -> list:
    """Inputs of `batch` rows that differ from one another, made of the rows of `samples` (whose
    values, and so whose index ranges, they keep): row r is sample row r mod n, rolled r places
    along its last dimension. A check on them sees a graph that moves or mixes rows."""
    import torch

    out = []
    for x in samples:
        picked = [x[r % x.shape[0]] for r in range(batch)]
        out.append(torch.stack([p.roll(r, -1) if p.dim() else p for r, p in enumerate(picked)]))
    return out


def each_row_alone(run, xs: list, small: int) -> list:
    """The outputs that `run` (a batch of `small` rows in, a list of outputs out) gives each row of
    `xs` by itself, that row repeated to `small` rows; stacked, one tensor an output."""
    import torch

    alone = [run(*[x[[r] * small] for x in xs]) for r in range(xs[0].shape[0])]
    return [torch.stack([one[k][0] for one in alone]) for k in range(len(alone[0]))]
