"""Op targets: `aten::name.overload` strings <-> torch operators, looked up in the table of
allowlisted overloads (`allowlist.py`), never through getattr on a string from a file."""

from __future__ import annotations

import functools

import torch

from ..errors import UnsupportedError
from .allowlist import SUPPORTED_ATEN, TRAINING_ONLY


def resolve(target: str, training: bool = False) -> torch._ops.OpOverload:
    """`aten::add.Tensor` -> torch.ops.aten.add.Tensor, looked up in the table of allowlisted
    overloads (never through getattr on the string): UnsupportedError for anything else, a fused
    op included (`interpret.function_of` gives its interpreter)."""
    op = device_ops(training).get(target)
    if op is None:
        if target in device_ops(True):
            raise UnsupportedError(f"op {target} is allowed only in training graphs")
        raise UnsupportedError(f"op {target} is not an allowlisted overload of torch {torch.__version__}")
    return op


def is_allowed(target: str, training: bool = False) -> bool:
    """True for an exact allowlisted overload, as `aten::name.overload`."""
    return target in device_ops(training)


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


def named_arguments(op) -> dict:
    """An IR op's arguments by its schema's names, defaults filled in."""
    positional, defaults = _signature(op.target)
    return defaults | dict(zip(positional, op.args)) | dict(op.kwargs)


@functools.cache
def _signature(target: str) -> tuple[tuple[str, ...], dict]:
    """A target's positional argument names, and every argument's default (None where it has none)."""
    arguments = resolve(target)._schema.arguments
    return (tuple(a.name for a in arguments if not a.kwarg_only),
            {a.name: a.default_value if a.has_default_value() else None for a in arguments})
