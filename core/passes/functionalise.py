"""Inference graphs: an in-place op becomes its out-of-place twin where that is safe (`x.relu_()`
becomes `relu(x)`), as TorchScript's remove_mutation pass does, so that later passes see pure ops:
common subexpressions merge, and fusion takes them."""

from __future__ import annotations

import dataclasses
import functools

import torch

from ..ir import ACTIVATION, Graph, Ref, TensorSpec, Value
from ..ops import arguments, targets, types
from .substitute import rebuild, substitute

_META = torch.device("meta")


def functionalise(graph: Graph) -> Graph:
    """Replace each in-place op (`aten::relu_`) whose written value is an activation that owns its
    storage and has no views yet, by its twin (`aten::relu`) writing a fresh value; every later
    read of the written storage reads that value instead."""
    latest: dict[int, int] = {}  # value -> the fresh value that holds its storage's contents now
    viewed: set[int] = set()  # values some view made so far shares storage with

    def current(v: int) -> int:
        while v in latest:
            v = latest[v]
        return v

    values, ops = list(graph.values), []
    for op in graph.ops:
        op = substitute(op, current) if latest else op
        for o in op.outputs:  # a view made after a write made functional views the fresh value
            alias = values[o].alias_of
            if alias is not None and current(alias) != alias:
                values[o] = dataclasses.replace(values[o], alias_of=current(alias))
        twin = _twin(op.target)
        written = op.args[0].id if twin and op.args and isinstance(op.args[0], Ref) else None
        if written is not None and op.mutates == (written,) and len(op.outputs) == 1 \
                and values[written].kind == ACTIVATION and values[written].alias_of is None \
                and written not in viewed:
            out = op.outputs[0]
            values[out] = dataclasses.replace(values[out], alias_of=None, spec=_result_spec(twin, op, values))
            op = dataclasses.replace(op, target=twin, mutates=())
            latest[written] = out
        viewed.update(values[o].alias_of for o in op.outputs if values[o].alias_of is not None)
        ops.append(op)
    if not latest:
        return graph
    return rebuild(dataclasses.replace(graph, outputs=tuple(current(o) for o in graph.outputs)), ops, values=values)


@functools.cache
def _twin(target: str) -> str | None:
    """The out-of-place twin of an in-place overload ('aten::relu_.default' -> 'aten::relu.default')
    with the same arguments, if nimble runs it; else None."""
    try:
        schema = targets.schema_op(target)._schema
    except Exception:
        return None
    name = schema.name
    if not name.endswith("_") or name.endswith("__") or not schema.arguments \
            or schema.arguments[0].alias_info is None or not schema.arguments[0].alias_info.is_write:
        return None
    twin = target.replace(name, name[:-1], 1)
    try:
        fn = targets.schema_op(twin)
    except Exception:
        return None
    same = [(a.name, str(a.type)) for a in fn._schema.arguments] == [(a.name, str(a.type)) for a in schema.arguments]
    return twin if same and targets.is_allowed(twin) else None


def _result_spec(twin: str, op, values: list[Value]) -> TensorSpec:
    """The twin's result, typed on the meta device."""
    tensors = {r: arguments.meta_tensor(values[r].spec) for r in op.refs()}
    args, kwargs = arguments.op_arguments(op, tensors, _META)
    result = targets.schema_op(twin)(*args, **kwargs)
    return TensorSpec(tuple(result.shape), types.dtype_name(result.dtype), tuple(result.stride()),
                      result.storage_offset())
