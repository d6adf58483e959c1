"""TorchScript's host-side scalar and list ops, evaluated in Python at compile time.

For static shapes, this work (sizes, index arithmetic, list packing) has one answer, so the
frontend computes it once and the op list holds only device tasks. Generic ops such as
`aten::len(t[])` cannot be called through torch.ops from Python, hence this table.
"""

from __future__ import annotations

import math
import operator

import torch


def _int(x):
    return int(x.item()) if isinstance(x, torch.Tensor) else int(x)


def _float(x):
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def _bool(x):
    return bool(x.item()) if isinstance(x, torch.Tensor) else bool(x)


def _scalar(x):
    return x.item() if isinstance(x, torch.Tensor) else x


def _slice(seq, start=None, end=None, step=1):
    return seq[start:end:step]


def _append(seq, x):
    seq.append(x)
    return seq


HOST_OPS = {
    "aten::len": len,
    "aten::__getitem__": lambda seq, i: seq[i],
    "aten::slice": _slice,
    "aten::append": _append,
    "aten::list": list,
    "aten::__contains__": lambda seq, x: x in seq,
    "aten::add": operator.add,
    "aten::sub": operator.sub,
    "aten::mul": operator.mul,
    "aten::div": operator.truediv,
    "aten::floordiv": operator.floordiv,
    "aten::remainder": operator.mod,
    "aten::pow": operator.pow,
    "aten::neg": operator.neg,
    "aten::abs": abs,
    "aten::sqrt": math.sqrt,
    "aten::ceil": math.ceil,
    "aten::floor": math.floor,
    "aten::eq": operator.eq,
    "aten::ne": operator.ne,
    "aten::lt": operator.lt,
    "aten::le": operator.le,
    "aten::gt": operator.gt,
    "aten::ge": operator.ge,
    "aten::__and__": operator.and_,
    "aten::__or__": operator.or_,
    "aten::__not__": operator.not_,
    "aten::__is__": operator.is_,
    "aten::__isnot__": operator.is_not,
    "aten::Int": _int,
    "aten::Float": _float,
    "aten::Bool": _bool,
    "aten::ScalarImplicit": _scalar,
    "prim::min": lambda *a: min(*a),
    "prim::max": lambda *a: max(*a),
    "aten::format": lambda fmt, *a: fmt.replace("{}", "%s") % a if a else fmt,
    "aten::str": str,
}


def host_op(name: str):
    """The Python implementation of host op `name` (e.g. 'aten::len'), or None."""
    return HOST_OPS.get(name)
