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
"""

from __future__ import annotations

import torch

ADD_LAYER_NORM = "nimble::add_layer_norm"
LAYER_NORM_BACKWARD_ADD = "nimble::layer_norm_backward_add"
EVERY_GRADIENT = [True, True, True]


def add_layer_norm(x, r, normalized_shape, weight, bias, eps: float) -> tuple[torch.Tensor, ...]:
    s = torch.ops.aten.add.Tensor(x, r)
    return (s, *torch.ops.aten.native_layer_norm.default(s, normalized_shape, weight, bias, eps))


def layer_norm_backward_add(grad_y, x, normalized_shape, mean, rstd, weight, bias,
                            residual) -> tuple[torch.Tensor, ...]:
    dx, dweight, dbias = torch.ops.aten.native_layer_norm_backward.default(grad_y, x, normalized_shape, mean, rstd,
                                                                           weight, bias, EVERY_GRADIENT)
    return torch.ops.aten.add.Tensor(dx, residual), dweight, dbias


# each op's target -> what it computes, as aten's ops
FUNCTIONS = {ADD_LAYER_NORM: add_layer_norm, LAYER_NORM_BACKWARD_ADD: layer_norm_backward_add}
