"""Shape rules: the result of common ops on the meta device, computed here instead of by their
meta kernels, most of which are Python (torch._refs) and cost a millisecond or more an op, plus a
second or more to import sympy and torch._dynamo the first time.

`infer(target, args, kwargs)` returns the op's results as meta tensors, or None where no rule
applies (an op without one, or inputs outside what a rule covers: non-contiguous or mixed-dtype
tensors, integer inputs to ops that promote). The caller then runs the meta kernel. Each rule is
checked against the meta kernel in tests/frontend/test_shapes.py; the elementwise rules are in
`elementwise.py`. `without_dynamo_import` makes the meta kernels that remain cheaper on their
first call.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import sys
import types
from typing import Callable

import torch

from .arguments import flatten_result
from .elementwise import RULES as ELEMENTWISE, broadcast, empty, floats, plain
from .strides import suggested_format
from .targets import resolve

_META = torch.device("meta")


@contextlib.contextmanager
def without_dynamo_import():
    """While the body runs, torch-internal functions marked `_disable_dynamo` (many Python meta
    kernels) find a stand-in `torch._dynamo` whose `disable` returns the function itself, instead
    of importing the real one. Outside compilation that is all `disable` means. Afterwards the
    stand-in is gone and the functions it touched forget it, so a later torch.compile in the
    same process imports and applies the real one. Where torch._dynamo is already imported, the
    body runs as it is."""
    if "torch._dynamo" in sys.modules or "_dynamo" in vars(torch):
        yield
        return
    touched = []

    def disable(fn=None, *args, **kwargs):
        if fn is None:  # used as @disable(...)
            return disable
        touched.append(fn)
        return fn

    def anything_else(name: str):
        """Any other attribute: give way to the real torch._dynamo, imported now."""
        if sys.modules.get("torch._dynamo") is stand_in:
            del sys.modules["torch._dynamo"]
        vars(torch).pop("_dynamo", None)
        return getattr(importlib.import_module("torch._dynamo"), name)

    stand_in = types.ModuleType("torch._dynamo")
    stand_in.disable = disable
    stand_in.__getattr__ = anything_else
    sys.modules["torch._dynamo"] = stand_in
    torch._dynamo = stand_in
    try:
        yield
    finally:
        if sys.modules.get("torch._dynamo") is stand_in:
            del sys.modules["torch._dynamo"]
        if vars(torch).get("_dynamo") is stand_in:
            del torch._dynamo
        for fn in touched:
            vars(fn).pop("__dynamo_disable", None)


def infer(target: str, args: list, kwargs: dict) -> list[torch.Tensor] | None:
    rule = RULES.get(target)
    if rule is None:
        return None
    out = rule(*args, **kwargs)
    return None if out is None else [out] if isinstance(out, torch.Tensor) else list(out)


def results(target: str, args: list, kwargs: dict) -> list[torch.Tensor]:
    """The op's results on meta tensors: by its rule (`infer`), else by its meta kernel, run
    without importing torch._dynamo (`without_dynamo_import`)."""
    found = infer(target, args, kwargs)
    if found is not None:
        return found
    with without_dynamo_import():
        return flatten_result(resolve(target)(*args, **kwargs))


def _linear(x, w, b=None):
    if not floats(x, w, *([b] if b is not None else [])) or x.dim() < 1 or w.dim() != 2:
        return None
    if x.shape[-1] != w.shape[1] or (b is not None and tuple(b.shape) not in ((w.shape[0],), ())):
        raise ValueError(f"linear of {list(x.shape)} with a weight of {list(w.shape)}")
    return empty((*x.shape[:-1], w.shape[0]), x.dtype)


def _addmm(b, m1, m2, beta=1, alpha=1):
    if not plain(b, m1, m2) or m1.dim() != 2 or m2.dim() != 2 or m1.shape[1] != m2.shape[0]:
        return None
    broadcast(tuple(b.shape), (m1.shape[0], m2.shape[1]))
    return empty((m1.shape[0], m2.shape[1]), m1.dtype)


def _mm(m1, m2):
    """mm and bmm: a fresh contiguous product, in any layout of their operands."""
    if not floats(m1, m2) or m1.dim() != m2.dim() or m1.dim() not in (2, 3):
        return None
    if m1.shape[-1] != m2.shape[-2] or m1.shape[:-2] != m2.shape[:-2]:
        raise ValueError(f"mm of {list(m1.shape)} and {list(m2.shape)}")
    return empty((*m1.shape[:-1], m2.shape[-1]), m1.dtype)


def _matmul(a, b):
    if not floats(a, b) or a.dim() < 2 or b.dim() < 2:
        return None
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"matmul of {list(a.shape)} and {list(b.shape)}")
    batch = broadcast(tuple(a.shape[:-2]), tuple(b.shape[:-2]))
    return empty((*batch, a.shape[-2], b.shape[-1]), a.dtype)


def _pool_size(n, k, s, p, d, ceil_mode):
    if k < 1 or s < 1 or d < 1 or p < 0 or p > k // 2:
        raise ValueError("pooling window, stride or padding out of range")
    span = n + 2 * p - d * (k - 1) - 1
    out = (-(-span // s) if ceil_mode else span // s) + 1
    if ceil_mode and (out - 1) * s >= n + p:
        out -= 1
    if out < 1:
        raise ValueError("pooling output would be empty")
    return out


def _pool2d(x, kernel, stride=(), padding=0, dilation=1, ceil_mode=False):
    if not plain(x) or x.dim() not in (3, 4):
        return None

    def pair(a, default=None):
        a = list(a) if isinstance(a, (list, tuple)) else [a]
        a = a or default
        return a * 2 if len(a) == 1 else a

    kernel, stride = pair(kernel), pair(stride, kernel)
    padding, dilation = pair(padding), pair(dilation)
    spatial = [_pool_size(n, k, s, p, d, ceil_mode)
               for n, k, s, p, d in zip(x.shape[-2:], kernel, stride, padding, dilation)]
    return empty((*x.shape[:-2], *spatial), x.dtype)


def _max_pool2d(x, kernel, stride=(), padding=0, dilation=1, ceil_mode=False):
    return _pool2d(x, kernel, stride, padding, dilation, ceil_mode)


def _avg_pool2d(x, kernel, stride=(), padding=0, ceil_mode=False, count_include_pad=True, divisor=None):
    return _pool2d(x, kernel, stride, padding, 1, ceil_mode)


def _adaptive_avg_pool2d(x, output_size):
    size = list(output_size) if isinstance(output_size, (list, tuple)) else [output_size]
    size = size * 2 if len(size) == 1 else size
    if not floats(x) or x.dim() not in (3, 4) or len(size) != 2 or min(size) < 1 or min(x.shape[-2:]) < 1:
        return None
    if x.is_contiguous():
        return empty((*x.shape[:-2], *size), x.dtype)
    if suggested_format(x) == torch.channels_last:  # swin_t's permuted map: the result follows it
        return empty((*x.shape[:-2], *size), x.dtype, torch.channels_last)
    return None


def _mean_dim(x, dims, keepdim=False, dtype=None):
    if not plain(x) or dtype is not None or dims is None or x.dim() == 0:
        return None
    listed = [dims] if isinstance(dims, int) else list(dims)
    axes = {d % x.dim() for d in listed}
    if not axes:
        return None
    if len(axes) != len(listed) or any(not -x.dim() <= d < x.dim() for d in listed):
        raise ValueError(f"mean over dimensions {listed} of a {x.dim()}-d tensor")
    shape = [1 if i in axes else n for i, n in enumerate(x.shape) if keepdim or i not in axes]
    return empty(shape, x.dtype)


def _norm_dim(x, p, dims, keepdim=False, dtype=None):
    """aten::norm over dimensions (F.normalize): shaped as mean over them. Its meta kernel would
    import sympy through torch._refs.linalg."""
    if not (p is None or type(p) in (int, float)) or dims is None or x.dim() == 0:
        return None
    listed = [dims] if isinstance(dims, int) else list(dims)
    if any(not -x.dim() <= d < x.dim() for d in listed) or len({d % x.dim() for d in listed}) != len(listed):
        return None  # the meta kernel decides (it takes some repeated dimensions, not others)
    return _mean_dim(x, listed, keepdim, dtype)


def _vector_norm(x, ord=2, dim=None, keepdim=False, dtype=None):
    if type(ord) not in (int, float):
        return None
    return _mean_dim(x, list(range(x.dim())) if dim is None else dim, keepdim, dtype)


def _attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """scaled_dot_product_attention: (..., L, E) x (..., S, E) x (..., S, Ev) -> a fresh contiguous
    (..., L, Ev), with or without a mask (boolean, or of the query's dtype) that broadcasts to the
    scores (..., L, S). Anything else (a mask with is_causal, broadcast batch dims, grouped heads,
    mismatches) goes to the meta kernel, whose first call imports torch._dynamo (a second)."""
    q, k, v = query, key, value
    if enable_gqa or dropout_p or not floats(q, k, v) or q.dim() < 3 \
            or not (q.dim() == k.dim() == v.dim()) or q.shape[:-2] != k.shape[:-2] or k.shape[:-2] != v.shape[:-2] \
            or q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]:
        return None
    if attn_mask is not None:
        scores = (*q.shape[:-1], k.shape[-2])
        if is_causal or not isinstance(attn_mask, torch.Tensor) or attn_mask.dtype not in (torch.bool, q.dtype) \
                or attn_mask.dim() > len(scores):
            return None
        try:
            if broadcast(tuple(attn_mask.shape), scores) != scores:
                return None
        except ValueError:
            return None
    return empty((*q.shape[:-1], v.shape[-1]), q.dtype)


def _embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    if weight.dim() != 2 or indices.dtype not in (torch.int64, torch.int32) or not weight.is_floating_point():
        return None
    return empty((*indices.shape, weight.shape[1]), weight.dtype)


def _like(x, *args, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    """zeros_like, ones_like, full_like of a contiguous tensor: the same shape, contiguous."""
    if layout not in (None, torch.strided) or memory_format not in (None, torch.preserve_format) \
            or not x.is_contiguous():
        return None
    return empty(x.shape, dtype or x.dtype)


def _cat(tensors, dim=0):
    tensors = list(tensors)
    if not tensors or not floats(*tensors) or any(t.dim() != tensors[0].dim() for t in tensors) \
            or tensors[0].dim() == 0:
        return None
    form = torch.contiguous_format  # below 4-D, or where any part suggests it
    if tensors[0].dim() in (4, 5) and not all(t.is_contiguous() for t in tensors):
        formats = {suggested_format(t) for t in tensors}  # the result follows its parts into channels_last
        form = formats.pop() if len(formats) == 1 else form
    d = dim % tensors[0].dim()
    first = tensors[0].shape
    if any(t.shape[:d] != first[:d] or t.shape[d + 1:] != first[d + 1:] for t in tensors):
        raise ValueError("cat of tensors whose other dimensions differ")
    return empty((*first[:d], sum(t.shape[d] for t in tensors), *first[d + 1:]), tensors[0].dtype, form)


def _softmax(x, dim, dtype=None):
    return empty(x.shape, x.dtype) if dtype is None and plain(x) else None


def _internal_softmax(x, dim, half_to_float):
    return empty(x.shape, x.dtype) if not half_to_float and plain(x) else None


def _layer_norm(x, shape, weight=None, bias=None, eps=1e-5, cudnn=True):
    shape = list(shape)
    if not floats(x) or not shape or list(x.shape[-len(shape):]) != shape:
        return None
    for t in (weight, bias):
        if t is not None and (not plain(t) or not floats(x, t) or list(t.shape) != shape):
            return None
    return empty(x.shape, x.dtype)


def _batch_norm(x, weight, bias, mean, var, training, momentum, eps, cudnn=True):
    """Inference-mode batch norm (frozen models keep it where no convolution precedes it)."""
    params = [t for t in (weight, bias, mean, var) if t is not None]
    if training or not plain(x, *params) or x.dim() < 2 or any(tuple(t.shape) != (x.shape[1],) for t in params):
        return None
    return empty(x.shape, x.dtype)


def _conv(x, w, bias=None, stride=1, padding=0, dilation=1, transposed=False, output_padding=0, groups=1,
          unbatched=False):
    """Convolution by its shape rule; None for string padding ('same', 'valid'). The rule covers
    batched inputs, and for conv1d, conv2d and conv3d unbatched ones too."""
    if isinstance(padding, str) or not plain(x, w, *([bias] if bias is not None else [])):
        return None
    dims = w.dim() - 2
    if not unbatched and x.dim() != dims + 2:
        return None  # aten::convolution's own rules for other ranks: left to its meta kernel
    if dims < 1 or x.dim() not in (dims + 1, dims + 2) or groups < 1:
        raise ValueError(f"convolution of a {x.dim()}-d input with a {w.dim()}-d weight")
    batched = x.dim() == dims + 2
    shape = list(x.shape) if batched else [1, *x.shape]

    def per_dim(a):
        a = list(a) if isinstance(a, (list, tuple)) else [a]
        return a * dims if len(a) == 1 else a

    stride, padding, dilation, output_padding = map(per_dim, (stride, padding, dilation, output_padding))
    if not all(len(a) == dims for a in (stride, padding, dilation, output_padding)):
        raise ValueError("convolution parameters do not match its dimensions")
    if min(stride) < 1 or min(dilation) < 1 or min(padding) < 0:
        raise ValueError("convolution with a stride or dilation below 1, or negative padding")
    k = list(w.shape[2:])
    if transposed:
        if shape[1] != w.shape[0] or w.shape[0] % groups:
            raise ValueError(f"transposed convolution of {shape[1]} channels with a weight for {w.shape[0]}")
        channels = w.shape[1] * groups
        spatial = [(n - 1) * s - 2 * p + d * (kk - 1) + op + 1
                   for n, s, p, d, kk, op in zip(shape[2:], stride, padding, dilation, k, output_padding)]
    else:
        if shape[1] != w.shape[1] * groups or w.shape[0] % groups:
            raise ValueError(f"convolution of {shape[1]} channels with a weight for {w.shape[1] * groups}")
        channels = w.shape[0]
        spatial = [(n + 2 * p - d * (kk - 1) - 1) // s + 1
                   for n, s, p, d, kk in zip(shape[2:], stride, padding, dilation, k)]
    if min(spatial, default=1) < 1 or math.prod(shape) == 0:
        return None  # an empty result: torch versions differ on it, so the meta kernel decides
    if bias is not None and tuple(bias.shape) != (channels,):
        raise ValueError(f"convolution bias of shape {list(bias.shape)} for {channels} channels")
    result = empty([shape[0], channels, *spatial], x.dtype)
    return result if batched else result.squeeze(0)


def _conv_nd(x, w, bias=None, stride=1, padding=0, dilation=1, groups=1):
    return _conv(x, w, bias, stride, padding, dilation, False, 0, groups, unbatched=True)


RULES: dict[str, Callable] = {
    **ELEMENTWISE,
    "aten::linear.default": _linear,
    "aten::addmm.default": _addmm,
    "aten::mm.default": _mm,
    "aten::bmm.default": _mm,
    "aten::matmul.default": _matmul,
    "aten::max_pool2d.default": _max_pool2d,
    "aten::avg_pool2d.default": _avg_pool2d,
    "aten::adaptive_avg_pool2d.default": _adaptive_avg_pool2d,
    "aten::mean.dim": _mean_dim,
    "aten::norm.ScalarOpt_dim": _norm_dim,
    "aten::linalg_vector_norm.default": _vector_norm,
    "aten::cat.default": _cat,
    "aten::scaled_dot_product_attention.default": _attention,
    "aten::embedding.default": _embedding,
    "aten::zeros_like.default": _like,
    "aten::ones_like.default": _like,
    "aten::full_like.default": _like,
    "aten::softmax.int": _softmax,
    "aten::_softmax.default": _internal_softmax,
    "aten::layer_norm.default": _layer_norm,
    "aten::batch_norm.default": _batch_norm,
    "aten::convolution.default": _conv,
    "aten::conv1d.default": _conv_nd,
    "aten::conv2d.default": _conv_nd,
    "aten::conv3d.default": _conv_nd,
}
