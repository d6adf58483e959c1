"""What the builder reuses instead of emitting again, as ops arrive (two of nimble's rewrites):

- common subexpressions: the same pure op on the same values, with no in-place write between,
  is one op (`pure_key`); a value that stands for two ops and is later written in place makes
  the frontend lower the model again without this (`SharedWrite`);
- repeated views: the same view of the same value is one op (`view_key`), and a view with its
  input's exact geometry is its input (`same_view`).
"""

from __future__ import annotations

import torch

from ..errors import NimbleError
from ..ir import Ref
from ..ops.allowlist import NONDETERMINISTIC


def view_key(schema, target: str, args, kwargs) -> tuple | None:
    """A key for a view op (every result aliases its input, nothing is written): two views of one
    value with the same arguments are the same tensor, whatever ran between them."""
    if not schema.returns or any(r.alias_info is None or r.alias_info.is_write for r in schema.returns) \
            or any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
        return None
    try:
        key = (target, tuple(args), tuple(kwargs))
        hash(key)
    except TypeError:  # a list argument: no key
        return None
    return key


class SharedWrite(NimbleError):
    """An op writes in place a value that common-subexpression elimination gave to two ops: the
    frontend lowers again without it (so this never reaches a user)."""


def pure_key(schema, target: str, args, kwargs) -> tuple | None:
    """A key for an op that neither writes nor aliases anything and draws no random numbers: two
    such ops on the same values, with no write between them, compute the same (as TorchScript's
    CSE pass finds; the frontend folds host arithmetic first, so it finds more: NASNet cells apply
    one ReLU or one padding to a value in several branches)."""
    if any(a.alias_info is not None for a in schema.arguments) or any(r.alias_info is not None for r in schema.returns) \
            or target.split("::")[1].split(".")[0] in NONDETERMINISTIC:
        return None
    try:
        key = (target, _frozen(args), _frozen(kwargs))
        hash(key)
    except TypeError:
        return None
    return key


def _frozen(obj):
    """`obj` as a hashable key that tells 1, 1.0 and True apart."""
    if isinstance(obj, (list, tuple)):
        return (type(obj).__name__, *(_frozen(o) for o in obj))
    if isinstance(obj, dict):
        return ("dict", *((k, _frozen(v)) for k, v in sorted(obj.items())))
    return obj if isinstance(obj, Ref) else (type(obj).__name__, obj)


def same_view(schema, args, results, used) -> int | None:
    """The input's value id where a view op (its result aliases its first argument) returns a
    tensor of the very same shape, strides, offset and dtype as that input; else None."""
    ret = schema.returns[0].alias_info if len(schema.returns) == 1 else None
    if ret is None or ret.is_write or len(results) != 1 or not args or not isinstance(args[0], Ref):
        return None
    x, y = used.get(args[0].id), results[0]
    if x is None or not isinstance(y, torch.Tensor) or not y._is_view():  # a copy (`.to(copy=True)`) is no view
        return None
    if (x.shape, x.stride(), x.storage_offset(), x.dtype) == (y.shape, y.stride(), y.storage_offset(), y.dtype):
        return args[0].id
    return None
