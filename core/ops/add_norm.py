"""Layer norm with the residual add beside it, one op each way: what a training step's joint graph
holds after `passes/fuse_layer_norm_adds.py`, and what those ops compute (aten's ops composed, on
any device; `runtime/kernels/step_norms` computes each in one kernel on CUDA).

    s, y, mean, rstd = add_layer_norm(x, r, normalized_shape, weight, bias, eps)
    total, dweight, dbias = layer_norm_backward_add(grad_y, x, normalized_shape, mean, rstd, weight,
        bias, residual)

`add_layer_norm` is a residual join and the layer norm that reads it (a pre-norm transformer's
`x + attention(...)` and the norm of the next block): s = x + r, then `native_layer_norm(s)`. The
join's result is still written (the next join and the norm's backward read it); the norm no longer
reads it back.

`layer_norm_backward_add` is the layer norm's backward with all three gradients and the add that
alone reads its input gradient (the residual stream's gradient gathering a branch's):
total = dx + residual.

In a mixed-precision step the norm's result is cast down for the product after it, and the
product's gradient cast up for the norm's backward (`passes/fold_norm_casts.py`): the forward ops
then take `dtype=`, the dtype their normalised result is written in (rounded from float32, as the
cast rounded it), and each backward takes a gradient of a reduced dtype, widened (exactly) to its
input's. `layer_norm` and `layer_norm_backward` are aten's norm and backward with these two
freedoms, for a norm with no add beside it:

    y, mean, rstd = layer_norm(x, normalized_shape, weight, bias, eps, dtype=None)
    dx, dweight, dbias = layer_norm_backward(grad_y, x, normalized_shape, mean, rstd, weight, bias, mask)
"""

from __future__ import annotations

import torch

ADD_LAYER_NORM = "nimble::add_layer_norm"
LAYER_NORM_BACKWARD_ADD = "nimble::layer_norm_backward_add"
LAYER_NORM = "nimble::layer_norm"
LAYER_NORM_BACKWARD = "nimble::layer_norm_backward"
EVERY_GRADIENT = [True, True, True]


def add_layer_norm(x, r, normalized_shape, weight, bias, eps: float, dtype=None) -> tuple[torch.Tensor, ...]:
    s = torch.ops.aten.add.Tensor(x, r)
    return (s, *layer_norm(s, normalized_shape, weight, bias, eps, dtype))


def layer_norm(x, normalized_shape, weight, bias, eps: float, dtype=None) -> tuple[torch.Tensor, ...]:
    y, mean, rstd = torch.ops.aten.native_layer_norm.default(x, normalized_shape, weight, bias, eps)
    return (y if dtype is None else y.to(dtype)), mean, rstd


def layer_norm_backward(grad_y, x, normalized_shape, mean, rstd, weight, bias, mask) -> tuple[torch.Tensor, ...]:
    return torch.ops.aten.native_layer_norm_backward.default(widened(grad_y, x), x, normalized_shape, mean, rstd,
                                                             weight, bias, mask)


def layer_norm_backward_add(grad_y, x, normalized_shape, mean, rstd, weight, bias,
                            residual) -> tuple[torch.Tensor, ...]:
    dx, dweight, dbias = layer_norm_backward(grad_y, x, normalized_shape, mean, rstd, weight, bias, EVERY_GRADIENT)
    return torch.ops.aten.add.Tensor(dx, residual), dweight, dbias


def widened(grad_y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A gradient in its input's dtype (a cast up, which loses nothing)."""
    return grad_y if grad_y.dtype == x.dtype else grad_y.to(x.dtype)


# each op's target -> what it computes, as aten's ops
FUNCTIONS = {ADD_LAYER_NORM: add_layer_norm, LAYER_NORM_BACKWARD_ADD: layer_norm_backward_add,
             LAYER_NORM: layer_norm, LAYER_NORM_BACKWARD: layer_norm_backward}
