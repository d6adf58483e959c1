"""Batch norm in training with its activation (`ops/norm_act.py`), on CUDA, into a training step's
planned buffers: `forward_into` and `backward_into` are the out= writers of `nimble::batch_norm_act`
and its backward.

The map is seen as M rows of C channels (N*H*W by C): a 4-D map laid out channels_last, or a 2-D
(N, C) one, dense. Each way is two passes over the map with a small kernel between them:

- forward: STATISTICS reduces each split of the rows to each channel's mean and sum of squared
  deviations (Welford's, merged by Chan's formula tile by tile, in float32); FINISH merges the
  splits, writes the saved mean and inverse deviation and the new running statistics; NORMALISE
  writes act((x - mean) * rstd * w + b), plus a residual map before the activation at a residual
  join (ResNet's block end: its add and relu are then this kernel's).
- backward: GRADIENT_SUMS reduces each split to the sums of the activation's input gradient and of
  it times (x - mean), the activation's input computed again from x; FINISH_GRADIENTS merges the
  splits into the weight's and bias's gradients and three coefficients per channel; INPUT_GRADIENT
  writes dx = w * rstd * (dz - sum(dz) / M - (x - mean) * rstd^2 * sum(dz * (x - mean)) / M).

So the map is read or written 8 times a step: 3 forward, 5 backward. aten takes two kernels each
way for the norm and one more each way for a relu, which read or write the map 13 times (5
forward; its backward's relu reads the saved result). Anything else (another layout, a buffer of
other strides, a norm over one row) is computed by aten's ops (`norm_act.forward`, `backward`)
and copied into the buffers.
"""

from __future__ import annotations

import functools

import torch

from ...ops import norm_act
from . import generated

_ACTIVATE = '''
    if ACT == 1:
        z = tl.where(z < 0.0, 0.0, z)
    elif ACT == 2:
        z = tl.where(z < low, low, tl.where(z > high, high, z))
    elif ACT == 3:
        z = z * tl.sigmoid(z)
'''

_GRADIENT = '''
    if ACT == 0:
        dz = g
    else:
        z = xc * scale + bias
        if ACT == 1:
            dz = tl.where(z <= 0.0, 0.0, g)
        elif ACT == 2:
            dz = tl.where((z <= low) | (z >= high), 0.0, g)
        else:
            s = tl.sigmoid(z)
            dz = g * s * (1.0 + z * (1.0 - s))
'''

_CHANNELS = '''
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < C
    mean = tl.load(mean_ptr + c, mask=cm, other=0.0)
    rstd = tl.load(rstd_ptr + c, mask=cm, other=0.0)
    scale = rstd * tl.load(w_ptr + c, mask=cm, other=0.0).to(tl.float32)
    bias = tl.load(b_ptr + c, mask=cm, other=0.0).to(tl.float32)
'''

_HEAD = "import triton\nimport triton.language as tl\n\n\n@triton.jit\n"

STATISTICS = _HEAD + '''def bn_statistics(x_ptr, part_ptr, M, ROWS, C: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_C: tl.constexpr):
    split = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < C
    start = split * ROWS
    end = tl.minimum(start + ROWS, M)
    mean = tl.zeros((BLOCK_C,), tl.float32)
    m2 = tl.zeros((BLOCK_C,), tl.float32)
    for r0 in range(start, end, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)
        mask = (rows < end)[:, None] & cm[None, :]
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * C + c[None, :], mask=mask, other=0.0).to(tl.float32)
        k = tl.minimum(end - r0, BLOCK_M).to(tl.float32)
        n = (r0 - start).to(tl.float32)
        tile_mean = tl.sum(x, axis=0) / k
        d = tl.where(mask, x - tile_mean[None, :], 0.0)
        delta = tile_mean - mean
        mean = mean + delta * (k / (n + k))
        m2 = m2 + tl.sum(d * d, axis=0) + delta * delta * (n * k / (n + k))
    tl.store(part_ptr + split * 2 * C + c, mean, mask=cm)
    tl.store(part_ptr + (split * 2 + 1) * C + c, m2, mask=cm)


kernel = bn_statistics  # the name `generated.define` looks up; profiles show bn_statistics
'''

FINISH = _HEAD + '''def bn_finish(part_ptr, rm_ptr, rv_ptr, mean_ptr, rstd_ptr, new_mean_ptr, new_var_ptr, M, ROWS,
              SPLITS, momentum, eps, C: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < C
    total = tl.zeros((BLOCK_C,), tl.float32)
    for s0 in range(0, SPLITS, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        mask = (s < SPLITS)[:, None] & cm[None, :]
        k = tl.minimum(M - s * ROWS, ROWS).to(tl.float32)[:, None]
        total += tl.sum(tl.load(part_ptr + s[:, None] * 2 * C + c[None, :], mask=mask, other=0.0) * k, axis=0)
    mean = total / M
    m2 = tl.zeros((BLOCK_C,), tl.float32)
    for s0 in range(0, SPLITS, BLOCK_S):  # each split's squares about the mean of all: Chan's sum
        s = s0 + tl.arange(0, BLOCK_S)
        mask = (s < SPLITS)[:, None] & cm[None, :]
        k = tl.minimum(M - s * ROWS, ROWS).to(tl.float32)[:, None]
        d = tl.load(part_ptr + s[:, None] * 2 * C + c[None, :], mask=mask, other=0.0) - mean[None, :]
        squares = tl.load(part_ptr + (s[:, None] * 2 + 1) * C + c[None, :], mask=mask, other=0.0)
        m2 += tl.sum(tl.where(mask, squares + k * d * d, 0.0), axis=0)
    tl.store(mean_ptr + c, mean, mask=cm)
    tl.store(rstd_ptr + c, 1.0 / tl.sqrt(m2 / M + eps), mask=cm)
    rm = tl.load(rm_ptr + c, mask=cm, other=0.0).to(tl.float32)
    rv = tl.load(rv_ptr + c, mask=cm, other=0.0).to(tl.float32)
    tl.store(new_mean_ptr + c, momentum * mean + (1.0 - momentum) * rm, mask=cm)
    tl.store(new_var_ptr + c, momentum * (m2 / (M - 1)) + (1.0 - momentum) * rv, mask=cm)


kernel = bn_finish  # the name `generated.define` looks up; profiles show bn_finish
'''

NORMALISE = _HEAD + '''def bn_normalise(x_ptr, y_ptr, mean_ptr, rstd_ptr, w_ptr, b_ptr, r_ptr, M, low, high,
                 C: tl.constexpr, ACT: tl.constexpr, HAS_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
''' + _CHANNELS + '''
    mask = (rows < M)[:, None] & cm[None, :]
    at = rows.to(tl.int64)[:, None] * C + c[None, :]
    x = tl.load(x_ptr + at, mask=mask, other=0.0).to(tl.float32)
    z = (x - mean[None, :]) * scale[None, :] + bias[None, :]
    if HAS_R:
        z += tl.load(r_ptr + at, mask=mask, other=0.0).to(tl.float32)
''' + _ACTIVATE + '''
    tl.store(y_ptr + at, z, mask=mask)


kernel = bn_normalise  # the name `generated.define` looks up; profiles show bn_normalise
'''

GRADIENT_SUMS = _HEAD + '''def bn_gradient_sums(g_ptr, x_ptr, mean_ptr, rstd_ptr, w_ptr, b_ptr, part_ptr, M, ROWS, low,
                     high, C: tl.constexpr, ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    split = tl.program_id(0)
''' + _CHANNELS + '''
    mean = mean[None, :]
    scale = scale[None, :]
    bias = bias[None, :]
    start = split * ROWS
    end = tl.minimum(start + ROWS, M)
    total = tl.zeros((BLOCK_C,), tl.float32)
    total_x = tl.zeros((BLOCK_C,), tl.float32)
    for r0 in range(start, end, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)
        mask = (rows < end)[:, None] & cm[None, :]
        at = rows.to(tl.int64)[:, None] * C + c[None, :]
        g = tl.load(g_ptr + at, mask=mask, other=0.0).to(tl.float32)
        xc = tl.where(mask, tl.load(x_ptr + at, mask=mask, other=0.0).to(tl.float32) - mean, 0.0)
''' + _GRADIENT.replace("\n    ", "\n        ") + '''
        total += tl.sum(dz, axis=0)
        total_x += tl.sum(dz * xc, axis=0)
    tl.store(part_ptr + split * 2 * C + c, total, mask=cm)
    tl.store(part_ptr + (split * 2 + 1) * C + c, total_x, mask=cm)


kernel = bn_gradient_sums  # the name `generated.define` looks up; profiles show bn_gradient_sums
'''

FINISH_GRADIENTS = _HEAD + '''def bn_finish_gradients(part_ptr, rstd_ptr, w_ptr, dw_ptr, db_ptr, coef_ptr, M, SPLITS,
                        C: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr):
    c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < C
    total = tl.zeros((BLOCK_C,), tl.float32)
    total_x = tl.zeros((BLOCK_C,), tl.float32)
    for s0 in range(0, SPLITS, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        mask = (s < SPLITS)[:, None] & cm[None, :]
        total += tl.sum(tl.load(part_ptr + s[:, None] * 2 * C + c[None, :], mask=mask, other=0.0), axis=0)
        total_x += tl.sum(tl.load(part_ptr + (s[:, None] * 2 + 1) * C + c[None, :], mask=mask, other=0.0), axis=0)
    rstd = tl.load(rstd_ptr + c, mask=cm, other=0.0)
    tl.store(db_ptr + c, total, mask=cm)
    tl.store(dw_ptr + c, total_x * rstd, mask=cm)
    tl.store(coef_ptr + c, rstd * tl.load(w_ptr + c, mask=cm, other=0.0).to(tl.float32), mask=cm)
    tl.store(coef_ptr + C + c, total / M, mask=cm)
    tl.store(coef_ptr + 2 * C + c, total_x * rstd * rstd / M, mask=cm)


kernel = bn_finish_gradients  # the name `generated.define` looks up; profiles show bn_finish_gradients
'''

INPUT_GRADIENT = _HEAD + '''def bn_input_gradient(g_ptr, x_ptr, dx_ptr, mean_ptr, rstd_ptr, w_ptr, b_ptr, coef_ptr, M, low,
                      high, C: tl.constexpr, ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
''' + _CHANNELS + '''
    mean = mean[None, :]
    scale = scale[None, :]
    bias = bias[None, :]
    mask = (rows < M)[:, None] & cm[None, :]
    at = rows.to(tl.int64)[:, None] * C + c[None, :]
    g = tl.load(g_ptr + at, mask=mask, other=0.0).to(tl.float32)
    xc = tl.load(x_ptr + at, mask=mask, other=0.0).to(tl.float32) - mean
''' + _GRADIENT + '''
    k1 = tl.load(coef_ptr + c, mask=cm, other=0.0)[None, :]
    c1 = tl.load(coef_ptr + C + c, mask=cm, other=0.0)[None, :]
    c2 = tl.load(coef_ptr + 2 * C + c, mask=cm, other=0.0)[None, :]
    tl.store(dx_ptr + at, k1 * (dz - c1 - xc * c2), mask=mask)


kernel = bn_input_gradient  # the name `generated.define` looks up; profiles show bn_input_gradient
'''

_KERNELS = {name: generated.FixedKernel(source, f"batch norm {name}") for name, source in (
    ("statistics", STATISTICS), ("finish", FINISH), ("normalise", NORMALISE), ("gradient sums", GRADIENT_SUMS),
    ("finish gradients", FINISH_GRADIENTS), ("input gradient", INPUT_GRADIENT))}
TILE = 4096  # elements of one program's tile of the map
PROGRAMS_PER_SM = 4  # programs of a reduction over the rows, per multiprocessor
FINISH_S, FINISH_C = 128, 32  # a finishing kernel's tile: splits by channels


def _multiprocessors(device: torch.device) -> int:
    return _count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def rows_of(x: torch.Tensor) -> int | None:
    """M, where `x` is a dense map of M rows of its channels (dim 1) laid out channels-last: a 4-D
    channels_last map or a 2-D (N, C) one; else None."""
    if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous():
        return x.numel() // x.shape[1]
    if x.dim() == 2 and x.is_contiguous():
        return x.shape[0]
    return None


def _fits(x: torch.Tensor, maps: list[torch.Tensor], vectors: list[torch.Tensor]) -> int | None:
    """M where the kernels take `x` with these maps (its shape, strides and dtype) and per-channel
    vectors (dense, float), else None."""
    m = rows_of(x) if x.is_cuda and x.dtype in generated.FLOAT_KINDS else None
    if m is None or m < 2 or x.numel() == 0:
        return None
    c = x.shape[1]
    if any(t.shape != x.shape or t.stride() != x.stride() or t.dtype != x.dtype or t.device != x.device for t in maps):
        return None
    if any(t.shape != (c,) or not t.is_contiguous() or t.dtype not in generated.FLOAT_KINDS or t.device != x.device
           for t in vectors):
        return None
    return m


def _geometry(m: int, c: int, multiprocessors: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_C, rows per split, splits) for a map of m rows of c channels on a GPU of
    that many multiprocessors."""
    block_c = min(64, generated.triton_block(c))
    block_m = TILE // block_c
    blocks = -(-c // block_c)
    target = PROGRAMS_PER_SM * multiprocessors
    splits = max(1, min(-(-m // block_m), -(-target // blocks)))
    rows = -(-(-(-m // splits)) // block_m) * block_m
    return block_m, block_c, rows, -(-m // rows)


def _code(activation: str) -> int:
    return norm_act.NAMES.index(activation)


def forward_into(x, weight, bias, running_mean, running_var, momentum, eps, activation, low, high, residual=None,
                 *, y, mean, rstd, new_mean, new_var) -> None:
    """`norm_act.forward` into the five buffers: the kernels where they fit, else aten's ops and copies."""
    m = _fits(x, [y] + ([residual] if residual is not None else []),
              [weight, bias, running_mean, running_var, mean, rstd, new_mean, new_var])
    if m is not None and all(t.dtype == torch.float32 for t in (mean, rstd)) \
            and _forward(x, weight, bias, running_mean, running_var, float(momentum), float(eps), _code(activation),
                         float(low), float(high), y, mean, rstd, new_mean, new_var, m, residual):
        return
    for out, t in zip((y, mean, rstd, new_mean, new_var),
                      norm_act.forward(x, weight, bias, running_mean, running_var, momentum, eps, activation, low,
                                       high, residual)):
        out.copy_(t)


def _forward(x, weight, bias, running_mean, running_var, momentum, eps, act, low, high, y, mean, rstd, new_mean,
             new_var, m, residual=None) -> bool:
    c = x.shape[1]
    block_m, block_c, rows, splits = _geometry(m, c, _multiprocessors(x.device))
    blocks = -(-c // block_c)
    part = torch.empty((splits, 2, c), dtype=torch.float32, device=x.device)
    k = _KERNELS
    return (k["statistics"].launch((splits, blocks), x, part, m, rows, C=c, BLOCK_M=block_m, BLOCK_C=block_c)
            and k["finish"].launch((-(-c // FINISH_C),), part, running_mean, running_var, mean, rstd, new_mean, new_var,
                                   m, rows, splits, momentum, eps, C=c, BLOCK_S=FINISH_S, BLOCK_C=FINISH_C)
            and k["normalise"].launch((-(-m // block_m), blocks), x, y, mean, rstd, weight, bias,
                                      x if residual is None else residual, m, low, high, C=c, ACT=act,
                                      HAS_R=residual is not None, BLOCK_M=block_m, BLOCK_C=block_c))


def backward_into(grad, x, weight, bias, mean, rstd, eps, activation, low, high, *, dx, dweight, dbias) -> None:
    """`norm_act.backward` into the three buffers: the kernels where they fit, else aten's ops and copies."""
    m = _fits(x, [grad, dx], [weight, bias, mean, rstd, dweight, dbias])
    if m is not None and all(t.dtype == torch.float32 for t in (mean, rstd)) \
            and _backward(grad, x, weight, bias, mean, rstd, _code(activation), float(low), float(high), dx, dweight,
                          dbias, m):
        return
    for out, t in zip((dx, dweight, dbias), norm_act.backward(grad, x, weight, bias, mean, rstd, eps, activation,
                                                              low, high)):
        out.copy_(t)


def _backward(grad, x, weight, bias, mean, rstd, act, low, high, dx, dweight, dbias, m) -> bool:
    c = x.shape[1]
    block_m, block_c, rows, splits = _geometry(m, c, _multiprocessors(x.device))
    blocks = -(-c // block_c)
    part = torch.empty((splits, 2, c), dtype=torch.float32, device=x.device)
    coef = torch.empty((3, c), dtype=torch.float32, device=x.device)
    k = _KERNELS
    return (k["gradient sums"].launch((splits, blocks), grad, x, mean, rstd, weight, bias, part, m, rows, low, high,
                                      C=c, ACT=act, BLOCK_M=block_m, BLOCK_C=block_c)
            and k["finish gradients"].launch((-(-c // FINISH_C),), part, rstd, weight, dweight, dbias, coef, m, splits,
                                             C=c, BLOCK_S=FINISH_S, BLOCK_C=FINISH_C)
            and k["input gradient"].launch((-(-m // block_m), blocks), grad, x, dx, mean, rstd, weight, bias, coef, m,
                                           low, high, C=c, ACT=act, BLOCK_M=block_m, BLOCK_C=block_c))
