"""IR arguments <-> torch arguments. The frontend and every executor build an op's torch arguments
through `to_torch`, so they agree by construction on what an op is called with; the frontend's
builder and the passes that emit ops build IR arguments through `by_schema` and type results on
meta tensors from `meta_tensor`, so they agree on what an op looks like."""

from __future__ import annotations

import torch

from ..errors import UnsupportedError
from ..ir import Ref, Special, TensorSpec, contiguous_strides
from . import targets, types


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


def flatten_result(result, keep_none: bool = False) -> list:
    """An op's or a model's return value as a flat list of tensors (tuples, Tensor[] lists and
    dicts flattened; a dict by its values, in order). A result left out (None, as
    `convolution_backward` gives for a gradient it was not asked for) is dropped, or kept as None
    with `keep_none`."""
    if isinstance(result, torch.Tensor):
        return [result]
    if result is None:
        return [None] if keep_none else []
    if isinstance(result, dict):
        result = list(result.values())
    out = []
    for r in result:
        out.extend(flatten_result(r, keep_none))
    return out


def by_schema(schema, ins: list) -> tuple[list, list]:
    """IR (args, kwargs) for values given in schema order (Refs or host constants): kwarg-only
    arguments go by name, as torch.ops requires."""
    args, kwargs = [], []
    for spec, obj in zip(schema.arguments, ins):
        ir = from_ivalue(obj, str(spec.type))
        (kwargs.append((spec.name, ir)) if spec.kwarg_only else args.append(ir))
    return args, kwargs


def meta_tensor(spec: TensorSpec, storage: torch.Tensor | None = None) -> torch.Tensor:
    """A meta tensor of `spec`'s geometry, a view of `storage` (by default a fresh storage the
    spec's size; its `_base`)."""
    dtype = types.DTYPES[spec.dtype]
    if storage is None:
        storage = torch.empty(spec.storage_nbytes // dtype.itemsize, dtype=dtype, device="meta")
    return storage.as_strided(spec.shape, spec.strides or contiguous_strides(spec.shape), spec.offset)


def same_view(schema, args, results, used) -> int | None:
    """The input's value id where a view op (its result aliases its first argument) returns a
    tensor of the very same shape, strides, offset and dtype as that input (`x[:, :]`), so that
    there is nothing to run; else None. `used`: value id -> the stand-in tensor it was called with."""
    ret = schema.returns[0].alias_info if len(schema.returns) == 1 else None
    if ret is None or ret.is_write or len(results) != 1 or not args or not isinstance(args[0], Ref):
        return None
    x, y = used.get(args[0].id), results[0]
    if x is None or not isinstance(y, torch.Tensor) or not y._is_view():  # a copy (`.to(copy=True)`) is no view
        return None
    if (x.shape, x.stride(), x.storage_offset(), x.dtype) == (y.shape, y.stride(), y.storage_offset(), y.dtype):
        return args[0].id
    return None


def masked(schema, ins: list, results: list) -> list:
    """`results` with None for each one that the op's `output_mask` (a backward op's: which
    gradients to compute) leaves out. The kernels give None there, but a meta kernel may give a
    tensor (`native_batch_norm_backward`'s did)."""
    mask = output_mask(schema, ins)
    if mask is None or len(mask) != len(results):
        return results
    return [r if keep else None for r, keep in zip(results, mask)]


def output_mask(schema, ins: list) -> list | tuple | None:
    """The op's `output_mask` argument (which results a backward op computes), where it has one."""
    names = [a.name for a in schema.arguments]
    k = names.index("output_mask") if "output_mask" in names else len(ins)
    mask = ins[k] if k < len(ins) else None
    return mask if isinstance(mask, (list, tuple)) else None


def call_schema(schema, target: str, ins: list):
    """Run an op on the host with the node's inputs, which come in schema order: kwarg-only
    arguments (sub.Tensor's alpha, say) are passed by name, as torch.ops requires."""
    args, kwargs = [], {}
    for spec, value in zip(schema.arguments, ins):
        if spec.kwarg_only:
            kwargs[spec.name] = value
        else:
            args.append(value)
    return targets.schema_op(target)(*args, **kwargs)
