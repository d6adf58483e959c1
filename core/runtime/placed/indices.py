"""Index values never reach a GPU kernel out of range.

An out-of-range id in `embedding`, `index_select`, `gather` or `index` trips a device-side assert
on CUDA, and that poisons the process's CUDA context: every later CUDA call fails. A server would
lose a replica to one bad request. So every index tensor an op reads is traced back through ops
that keep its values (views, copies, slices, integer casts) to where it comes from:

- a graph input: its values are range-checked on the host before each call copies them in (and
  the stored sample inputs before the warm-up), with one clear error;
- a weight: its values are range-checked once, at load;
- anything computed on the device (an argmax feeding a gather, say): the op reads the indices
  clamped into range (CUDA only; on the CPU torch raises an error instead of asserting).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...errors import ArtifactError, ShapeError
from ...ir import INPUT, WEIGHT, Graph, Ref

# target -> (position of the indexed tensor, position of its dim argument or None for dim 0,
# position of the index argument, negative indices allowed)
INDEXING = {
    "aten::embedding.default": (0, None, 1, False),
    "aten::index_select.default": (0, 1, 2, False),
    "aten::gather.default": (0, 1, 2, False),
    "aten::index.Tensor": (0, None, 1, True),  # a list of indices, the k-th for dim k
}
# Ops whose result holds only values of their first argument.
_KEEPS_VALUES = frozenset({
    "view", "reshape", "_unsafe_view", "flatten", "unflatten", "squeeze", "unsqueeze", "permute", "transpose", "t",
    "expand", "expand_as", "contiguous", "clone", "detach", "alias", "slice", "select", "narrow", "repeat",
    "movedim", "moveaxis", "swapaxes", "swapdims", "to", "_to_copy", "type_as",
})


@dataclass(frozen=True)
class Bound:
    """Index values must lie in [low, high)."""
    low: int
    high: int
    what: str  # "op 3 (aten::embedding.default at model.py:12) indexing 30522 rows"


@dataclass
class IndexPlan:
    inputs: dict[int, list[Bound]] = field(default_factory=dict)  # input position -> bounds
    weights: dict[int, list[Bound]] = field(default_factory=dict)  # weight value id -> bounds
    clamps: dict[int, list[tuple[int, int | None, int, int]]] = field(default_factory=dict)
    # op id -> (arg position, item of a list argument or None, low, high) to clamp on CUDA


def plan_indices(graph: Graph) -> IndexPlan:
    plan = IndexPlan()
    producer = {o: op for op in graph.ops for o in op.outputs}
    position = {vid: k for k, vid in enumerate(graph.inputs)}
    for op in graph.ops:
        if op.target not in INDEXING:
            continue
        table, dim_at, index_at, negative = INDEXING[op.target]
        shape = graph.values[op.args[table].id].spec.shape if isinstance(op.args[table], Ref) else None
        if shape is None or len(op.args) <= index_at:
            continue
        index = op.args[index_at]
        items = list(enumerate(index)) if isinstance(index, tuple) else [(None, index)]
        for k, ref in items:
            if not isinstance(ref, Ref):
                continue
            dim = k if k is not None else (op.args[dim_at] if dim_at is not None else 0)
            if not isinstance(dim, int) or not -len(shape) <= dim < len(shape):
                continue
            n = shape[dim]
            bound = Bound(-n if negative else 0, n, f"op {op.id} ({op.target} at {op.source or 'an unknown line'}) "
                                                    f"indexing {n} entries")
            kind, vid = _origin(graph, producer, ref.id)
            if kind == INPUT:
                plan.inputs.setdefault(position[vid], []).append(bound)
            elif kind == WEIGHT:
                plan.weights.setdefault(vid, []).append(bound)
            else:
                plan.clamps.setdefault(op.id, []).append((index_at, k, bound.low, bound.high - 1))
    return plan


def _origin(graph: Graph, producer: dict, vid: int) -> tuple[str, int]:
    """(INPUT or WEIGHT, value id) where `vid`'s values come from through value-keeping ops, or
    ("computed", vid)."""
    while True:
        kind = graph.values[vid].kind
        if kind in (INPUT, WEIGHT):
            return kind, vid
        op = producer.get(vid)
        if op is None or op.target.split("::")[-1].split(".")[0] not in _KEEPS_VALUES or not op.args \
                or not isinstance(op.args[0], Ref):
            return "computed", vid
        vid = op.args[0].id


def _outside(t: torch.Tensor, bounds: list[Bound]) -> tuple[float, Bound] | None:
    """The first value of `t` outside a bound, with that bound, or None (one host sync at most)."""
    if t.numel() == 0 or not bounds:
        return None
    low, high = (int(v) if float(v).is_integer() else v
                 for v in torch.stack(list(torch.aminmax(t.detach().reshape(-1)))).tolist())
    for b in bounds:
        if not (low >= b.low and high < b.high):  # NaN fails too
            return (low if not low >= b.low else high), b
    return None


def check_input(t: torch.Tensor, bounds: list[Bound], name: str) -> None:
    bad = _outside(t, bounds)
    if bad is not None:
        value, b = bad
        raise ShapeError(f"input '{name}' holds the index {value}, but {b.what} takes indices from {b.low} to "
                         f"{b.high - 1}; pass ids within the model's vocabulary or table")


def check_weights(weights: dict[int, torch.Tensor], plan: IndexPlan, names: dict[int, str], artifact: str) -> None:
    for vid, bounds in plan.weights.items():
        bad = _outside(weights[vid], bounds)
        if bad is not None:
            value, b = bad
            raise ArtifactError(f"{artifact}: weight '{names[vid]}' holds the index {value}, but {b.what} takes "
                                f"indices from {b.low} to {b.high - 1}; the artifact is corrupt or crafted")


def clamped(args: list, clamps) -> list:
    """`args` with the listed index arguments clamped into range (new tensors; args unchanged)."""
    args = list(args)
    for pos, k, low, high in clamps:
        if k is None:
            args[pos] = args[pos].clamp(low, high)
        else:
            items = list(args[pos])
            items[k] = items[k].clamp(low, high)
            args[pos] = items
    return args
