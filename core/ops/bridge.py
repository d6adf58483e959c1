"""The bridge between IR constants and torch objects: dtypes, enums, op targets, argument values.

The frontend and every executor build torch arguments through `to_torch`, so they agree by
construction on what an op is called with.
"""

from __future__ import annotations

import functools

import torch

from .. import dtypes
from ..dtypes import STORABLE
from ..errors import UnsupportedError
from ..ir import Local, Ref, Special
from . import fusion, shapes
from .allowlist import SUPPORTED_ATEN, TRAINING_ONLY

DTYPES: dict[str, torch.dtype] = {d.name: getattr(torch, d.name) for d in STORABLE}  # from dtypes.py
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

# TorchScript passes these enums as plain ints; c10's numbering.
SCALAR_TYPES = {d.scalar_type: d.name for d in STORABLE}
LAYOUTS = {0: torch.strided}
MEMORY_FORMATS = {0: torch.contiguous_format, 1: torch.preserve_format,
                  2: torch.channels_last, 3: torch.channels_last_3d}
_ENUMS = {
    "layout": {str(v): v for v in LAYOUTS.values()},
    "memory_format": {str(v): v for v in MEMORY_FORMATS.values()},
}


def resolve_device(device: str) -> tuple[torch.device, str | None]:
    """(device, notice) for --device: auto picks CUDA when present, else the CPU with a notice."""
    from ..errors import UsageError

    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda"), None
        return torch.device("cpu"), "no CUDA device here: running the op list serially on the CPU"
    if device not in ("cpu", "cuda"):
        raise UsageError(f"--device {device!r}: use auto, cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: this machine has no CUDA device; use --device cpu or auto")
    return torch.device(device), None


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return DTYPE_NAMES[dtype]
    except KeyError:
        raise UnsupportedError(dtypes.refusal(str(dtype).removeprefix("torch."))) from None


def resolve(target: str, training: bool = False) -> torch._ops.OpOverload:
    """`aten::add.Tensor` -> torch.ops.aten.add.Tensor, looked up in the table of allowlisted
    overloads (never through getattr on the string): UnsupportedError for anything else."""
    if target == fusion.FUSED:
        return run_fused
    op = device_ops(training).get(target)
    if op is None:
        if target in device_ops(True):
            raise UnsupportedError(f"op {target} is allowed only in training graphs")
        raise UnsupportedError(f"op {target} is not an allowlisted overload of torch {torch.__version__}")
    return op


def is_allowed(target: str, training: bool = False) -> bool:
    """True for an exact allowlisted overload, as `aten::name.overload`."""
    return target in device_ops(training)


def run_fused(body) -> torch.Tensor:
    """A fused op's body (`ops/fusion.py`), interpreted node by node with its aten overloads.
    `body` is as `to_torch` gives it: its Refs are tensors already, its Locals still Locals. On
    the meta device, nodes with a shape rule are typed by it."""
    results: list[torch.Tensor] = []

    def local(a):
        if isinstance(a, Local):
            return results[a.index]
        return [local(x) for x in a] if isinstance(a, list) else a

    for target, args, kwargs in body:
        args, kwargs = [local(a) for a in args], {k: local(v) for k, v in kwargs}
        found = None
        if any(isinstance(a, torch.Tensor) and a.is_meta for a in args):
            found = shapes.infer(target, args, kwargs)
        results.append(found[0] if found is not None else resolve(target)(*args, **kwargs))
    return results[-1]


@functools.cache
def device_ops(training: bool = False) -> dict[str, torch._ops.OpOverload]:
    """Target -> overload for every overload of the allowlisted aten names that this torch has,
    except `out=` overloads (which write into a tensor they are handed)."""
    names = SUPPORTED_ATEN | (frozenset(TRAINING_ONLY) if training else frozenset())
    table = {}
    for name in sorted(names):
        try:
            packet = getattr(torch.ops.aten, name)  # names from nimble's own list, not from a file
        except (AttributeError, RuntimeError):
            continue  # an op this torch lacks: artifacts naming it are refused
        for overload in packet.overloads():
            op = getattr(packet, overload)
            if not any(a.kwarg_only and a.alias_info is not None and a.alias_info.is_write
                       for a in op._schema.arguments):
                table[f"aten::{name}.{overload}"] = op
    return table


def schema_op(target: str) -> torch._ops.OpOverload:
    """Any operator by its TorchScript schema name, for the frontend's host-side folding. The name
    comes from the model's own code, which loading TorchScript runs anyway; an artifact's targets
    go through `resolve` instead."""
    qualified, _, overload = target.partition(".")
    namespace, _, name = qualified.partition("::")
    try:
        return getattr(getattr(getattr(torch.ops, namespace), name), overload or "default")
    except (AttributeError, RuntimeError):
        raise UnsupportedError(f"op {target} does not exist in torch {torch.__version__}") from None


def target_of(schema: torch._C.FunctionSchema) -> str:
    return f"{schema.name}.{schema.overload_name or 'default'}"


def to_torch(arg, tensors, device: torch.device):
    """An IR argument as torch expects it. `tensors` maps value ids to tensors; every device
    argument becomes `device`, since a static graph runs wholly on one device."""
    if isinstance(arg, Ref):
        return tensors[arg.id]
    if isinstance(arg, Special):
        if arg.kind == "dtype":
            return DTYPES[arg.name]
        if arg.kind == "device":
            return device
        return _ENUMS[arg.kind][arg.name]
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
        return Special("dtype", dtype_name(value))
    if base == "ScalarType" and isinstance(value, int):
        if value not in SCALAR_TYPES:
            raise UnsupportedError(f"dtype number {value} (c10 ScalarType) is not one an artifact can store; use one "
                                   f"of {', '.join(DTYPES)}")
        return Special("dtype", SCALAR_TYPES[value])
    if isinstance(value, torch.device):
        return Special("device", value.type)
    if base == "Device" and isinstance(value, str):
        return Special("device", torch.device(value).type)
    if base == "Layout" and isinstance(value, int):
        return Special("layout", str(LAYOUTS[value]))
    if isinstance(value, torch.layout):
        return Special("layout", str(value))
    if base == "MemoryFormat" and isinstance(value, int):
        return Special("memory_format", str(MEMORY_FORMATS[value]))
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
