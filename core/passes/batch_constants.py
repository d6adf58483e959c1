"""A multi-batch artifact's members: a constant shaped by the batch becomes one row, expanded.

A model may compute a value from its weights and the batch size alone. BERT looks its token-type
embedding up for a buffer of zeros expanded to [batch, seq]; nimble folds that on the host into a
constant of [batch, seq, hidden], one row repeated. Each batch size would then hold a copy of its
own, and an artifact's batch sizes must share their weights (a server swaps between them). Here a
weight whose first dimension is the batch and whose rows all equal the first becomes that row, a
weight of [1, ...] that every batch size shares, read through an `expand` to the batch: a view,
with no copy and no kernel. `multibatch.compile_batches` finds which weights those are, by
comparing two batch sizes' weights, and compiles every batch size again with them named.
"""

from __future__ import annotations

import dataclasses

import torch

from ..ir import ACTIVATION, WEIGHT, Graph, Ref, TensorSpec, Value
from .edit import Edit

EXPAND = "aten::expand.default"


def batch_constants(graph: Graph, weights: dict[str, torch.Tensor], batch: int,
                    names: frozenset[str]) -> tuple[Graph, dict[str, torch.Tensor]]:
    """Each weight of `names` that holds `batch` identical rows as one row expanded to the batch
    (at batch 1 too, so that every batch size has the same ops)."""
    first_reader: dict[int, int] = {}
    for op in graph.ops:
        for r in op.refs():
            first_reader.setdefault(r, op.id)
    weights = dict(weights)
    edit = Edit(graph)
    for v in graph.values:
        if v.name not in names or not _repeated_rows(v, weights, batch) or v.id not in first_reader \
                or v.id in graph.outputs:
            continue
        t = weights[v.name]
        weights[v.name] = t[:1].contiguous()
        row = edit.value(WEIGHT, TensorSpec((1, *v.spec.shape[1:]), v.spec.dtype, tuple(weights[v.name].stride())),
                         v.name, before=v.id)
        expand = edit.op(EXPAND, (Ref(row.id), tuple(v.spec.shape)), (), (v.id,))
        edit.insert_before(first_reader[v.id], expand)
        expanded = TensorSpec(v.spec.shape, v.spec.dtype, (0, *row.spec.strides[1:]), 0)
        edit.change(dataclasses.replace(v, kind=ACTIVATION, spec=expanded, name=f"{v.name}_rows",
                                        producer=expand.id, alias_of=row.id))
    return edit.finish(), weights


def _repeated_rows(v: Value, weights: dict[str, torch.Tensor], batch: int) -> bool:
    if v.kind != WEIGHT or len(v.spec.shape) < 1 or v.spec.shape[0] != batch or v.name not in weights:
        return False
    t = weights[v.name]
    return tuple(t.shape) == tuple(v.spec.shape) and torch.equal(t, t[:1].expand_as(t))
