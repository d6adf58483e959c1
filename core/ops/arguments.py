"""IR arguments <-> torch arguments. The frontend and every executor build an op's torch arguments
through `to_torch`, so they agree by construction on what an op is called with."""

from __future__ import annotations

import torch

from ..errors import UnsupportedError
from ..ir import Ref, Special
from . import types


def to_torch(arg, tensors, device: torch.device):
    """An IR argument as torch expects it. `tensors` maps value ids to tensors; every device
    argument becomes `device`, since a static graph runs wholly on one device."""
    if isinstance(arg, Ref):
        return tensors[arg.id]
    if isinstance(arg, Special):
        if arg.kind == "dtype":
            return types.DTYPES[arg.name]
        if arg.kind == "device":
            return device
        return types.ENUMS[arg.kind][arg.name]
    if isinstance(arg, tuple):
        return [to_torch(a, tensors, device) for a in arg]
    return arg


def op_arguments(op, tensors, device: torch.device) -> tuple[list, dict]:
    """An IR op's (args, kwargs) as its aten overload takes them, tensors looked up in `tensors`."""
    return ([to_torch(a, tensors, device) for a in op.args],
            {k: to_torch(v, tensors, device) for k, v in op.kwargs})


def from_ivalue(value, type_str: str):
    """A host constant as an IR argument, given the schema type it is passed as."""
    base = type_str.rstrip("?")
    if value is None:
        return None
    if isinstance(value, torch.dtype):
        return Special("dtype", types.dtype_name(value))
    if base == "ScalarType" and isinstance(value, int):
        if value not in types.SCALAR_TYPES:
            raise UnsupportedError(f"dtype number {value} (c10 ScalarType) is not one an artifact can store; use one "
                                   f"of {', '.join(types.DTYPES)}")
        return Special("dtype", types.SCALAR_TYPES[value])
    if isinstance(value, torch.device):
        return Special("device", value.type)
    if base == "Device" and isinstance(value, str):
        return Special("device", torch.device(value).type)
    if base == "Layout" and isinstance(value, int):
        return Special("layout", str(types.LAYOUTS[value]))
    if isinstance(value, torch.layout):
        return Special("layout", str(value))
    if base == "MemoryFormat" and isinstance(value, int):
        return Special("memory_format", str(types.MEMORY_FORMATS[value]))
    if isinstance(value, torch.memory_format):
        return Special("memory_format", str(value))
    if isinstance(value, (list, tuple)):
        inner = base[:-2] if base.endswith("[]") else base
        return tuple(from_ivalue(v, inner) for v in value)
    if isinstance(value, (bool, int, float, str, Ref)):
        return value
    raise UnsupportedError(f"constant of type {type(value).__name__} ({type_str}) is not supported")


def flatten_result(result) -> list:
    """An op's or a model's return value as a flat list of tensors (tuples, Tensor[] lists and
    dicts flattened; a dict by its values, in order)."""
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, dict):
        result = list(result.values())
    out = []
    for r in result:
        out.extend(flatten_result(r))
    return out
