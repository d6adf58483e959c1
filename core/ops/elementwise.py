"""Shape rules of elementwise ops (`shapes.py` holds the rest and looks them up in `RULES` here):
each op's result on the meta device from torch's own promotion (`torch.result_type`, C++) and
stride rule (`strides.elementwise_strides`), not from its Python meta kernel, whose first call
imports sympy (1.8 s of a BERT, GPT-2 or Swin load's preflight on the GPU machine). Also the
helpers every shape rule uses.

A rule answers None outside what it covers (mixed or unusual dtypes, Python scalars other than
int and float); the caller then runs the meta kernel. tests/frontend/test_shapes.py holds each
rule to the meta kernel."""

from __future__ import annotations

from typing import Callable

import torch

from .strides import elementwise_strides

_META = torch.device("meta")
_NUMBER = (int, float)


def empty(shape, dtype, memory_format=torch.contiguous_format) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=_META, memory_format=memory_format)


def plain(*tensors) -> bool:
    """All contiguous, of one floating dtype."""
    return floats(*tensors) and all(t.is_contiguous() for t in tensors)


def floats(*tensors) -> bool:
    """All of one floating dtype, in any layout (products write a fresh contiguous result)."""
    return all(t.is_floating_point() and t.dtype == tensors[0].dtype for t in tensors)


def broadcast(*shapes) -> tuple[int, ...]:
    """torch.broadcast_shapes without its import of sympy."""
    first = shapes[0]
    if all(s == first for s in shapes[1:]):
        return tuple(first)
    ndim = max(len(s) for s in shapes)
    out = [1] * ndim
    for s in shapes:
        skip = ndim - len(s)
        for i, n in enumerate(s, skip):
            if n != 1 and out[i] != n:
                if out[i] != 1:
                    raise ValueError(f"shapes {[list(s) for s in shapes]} do not broadcast")
                out[i] = n
    return tuple(out)


def _result(tensors: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The result of an elementwise op over `tensors` (broadcast together), of `dtype`."""
    shape = broadcast(*(tuple(t.shape) for t in tensors))
    return torch.empty_strided(shape, elementwise_strides([t.expand(shape) for t in tensors], shape), dtype=dtype,
                               device=_META)


def _unary(x, *args, **kwargs):
    return empty(x.shape, x.dtype) if plain(x) else None


def _binary(x, y, *args, **kwargs):
    if not isinstance(x, torch.Tensor):
        return None
    if not isinstance(y, torch.Tensor):
        if type(y) not in _NUMBER or not plain(x):
            return None  # a complex or bool scalar can change the dtype
        return empty(x.shape, x.dtype)
    if not (x.is_floating_point() and y.is_floating_point()):
        return None
    if x.dtype != y.dtype and (x.dim() == 0) != (y.dim() == 0):  # a 0-d tensor (a traced Python number)
        dtype = x.dtype if y.dim() == 0 else y.dtype  # defers to a dimensioned one
    else:
        dtype = torch.promote_types(x.dtype, y.dtype)
    return _result([x, y], dtype)


def _power(x, exponent):
    """pow(tensor, number) of a floating tensor keeps its dtype."""
    return empty(x.shape, x.dtype) if plain(x) and type(exponent) in _NUMBER else None


def _same_kind(x, y) -> bool:
    """Two tensors of one boolean or integer dtype (masks and their combinations)."""
    return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == y.dtype \
        and not x.is_floating_point() and not x.is_complex()


def _bitwise(x, y):
    return _result([x, y], x.dtype) if _same_kind(x, y) else None


def _logical(x, y):
    return _result([x, y], torch.bool) if _same_kind(x, y) else None


def _not(x):
    return _result([x], x.dtype) if isinstance(x, torch.Tensor) and x.dtype == torch.bool else None


def _compare(x, y):
    """eq, ne, lt...: a boolean result over a tensor and a tensor of its dtype, or a number."""
    if not isinstance(x, torch.Tensor) or x.is_complex():
        return None
    if isinstance(y, torch.Tensor):
        return _result([x, y], torch.bool) if y.dtype == x.dtype else None
    return _result([x], torch.bool) if type(y) in _NUMBER else None


def _where(condition, x, y):
    """where(condition, x, y), each of x and y a tensor or an int or float."""
    if not isinstance(condition, torch.Tensor) or condition.dtype != torch.bool:
        return None
    if not all(isinstance(v, torch.Tensor) or type(v) in _NUMBER for v in (x, y)):
        return None
    tensors = [v for v in (x, y) if isinstance(v, torch.Tensor)]
    if any(t.is_complex() for t in tensors):
        return None
    if len(tensors) == 2:
        dtype = torch.result_type(x, y)
    elif tensors:
        dtype = torch.result_type(tensors[0], y if tensors[0] is x else x)
    else:  # two numbers: int64 for two ints, else the default float
        dtype = torch.int64 if type(x) is int and type(y) is int else torch.get_default_dtype()
    return _result([condition, *tensors], dtype)


def _roll(x, shifts, dims=()):
    """roll writes a fresh contiguous tensor of its input's shape."""
    shifts, dims = list(shifts), list(dims)
    if len(shifts) != max(len(dims), 1) or any(not -x.dim() <= d < max(x.dim(), 1) for d in dims):
        raise ValueError(f"roll of a {x.dim()}-d tensor by shifts {shifts} over dims {dims}")
    return empty(x.shape, x.dtype)


UNARY = ("relu", "relu6", "hardtanh", "sigmoid", "tanh", "silu", "gelu", "hardswish", "hardsigmoid",
         "leaky_relu", "elu", "selu", "mish", "softplus", "clamp", "clamp_min", "clamp_max", "neg", "abs",
         "exp", "log", "sqrt", "rsqrt", "erf", "reciprocal")
COMPARISONS = ("eq", "ne", "lt", "le", "gt", "ge")
RULES: dict[str, Callable] = {
    **{f"aten::{name}.default": _unary for name in UNARY},
    **{f"aten::{name}.{kind}": _binary for name in ("add", "sub", "mul", "div") for kind in ("Tensor", "Scalar")},
    "aten::rsub.Scalar": _binary,
    "aten::maximum.default": _binary,
    "aten::minimum.default": _binary,
    "aten::pow.Tensor_Scalar": _power,
    **{f"aten::{name}.Tensor": _bitwise for name in ("__and__", "__or__", "bitwise_and", "bitwise_or")},
    **{f"aten::{name}.default": _logical for name in ("logical_and", "logical_or")},
    "aten::logical_not.default": _not,
    "aten::bitwise_not.default": _not,
    **{f"aten::{name}.{kind}": _compare for name in COMPARISONS for kind in ("Tensor", "Scalar")},
    **{f"aten::where.{kind}": _where for kind in ("self", "Scalar", "ScalarSelf", "ScalarOther")},
    "aten::roll.default": _roll,
}
