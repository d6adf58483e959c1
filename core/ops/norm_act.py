"""Batch norm in training mode with the activation after it, as one op each way: what a training
step's joint graph holds after `passes/fuse_batch_norm_activation.py`, and what those two ops
compute (`forward`, `backward`: aten's ops composed, on any device; `runtime/kernels/batch_norm.py`
computes them on CUDA in six kernels that pass over the map 8 times, where aten's pass 13 times
with a relu).

    y, mean, rstd, new_running_mean, new_running_var = batch_norm_act(x, weight, bias, running_mean,
        running_var, momentum, eps, activation, low, high[, residual])
    dx, dweight, dbias = batch_norm_act_backward(grad_y, x, weight, bias, mean, rstd, eps, activation,
        low, high)

`forward` is `_native_batch_norm_legit_functional` (training) and then the activation. The
pre-activation map is never kept: `backward` computes it again from `x` and the saved statistics,
takes the activation's gradient of it, then batch norm's. So the step saves one map fewer per
layer, and the backward reads no activation's result.

The activations: "relu", "hardtanh" (`low`, `high`: relu6 is 0 and 6), "silu", and "none".

With `residual` (a map of x's shape and dtype) the forward is a residual join as well:
act(batch_norm(x) + residual), the activation "relu" or "none". The backward of such a norm has no
activation: the join's relu keeps its own backward, which reads the join's result.
"""

from __future__ import annotations

import torch

NORM_ACT = "nimble::batch_norm_act"
NORM_ACT_BACKWARD = "nimble::batch_norm_act_backward"
TARGETS = frozenset({NORM_ACT, NORM_ACT_BACKWARD})

# activation's forward target -> (its name here, its backward's target)
ACTIVATIONS = {
    "aten::relu.default": ("relu", "aten::threshold_backward.default"),
    "aten::hardtanh.default": ("hardtanh", "aten::hardtanh_backward.default"),
    "aten::silu.default": ("silu", "aten::silu_backward.default"),
}
NAMES = ("none", "relu", "hardtanh", "silu")  # a kernel's ACT constant is the index


def _channel(t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A per-channel vector shaped to broadcast over `x` (N, C, ...)."""
    return t.reshape(1, -1, *([1] * (x.dim() - 2)))


def activate(z: torch.Tensor, activation: str, low: float, high: float) -> torch.Tensor:
    if activation == "relu":
        return torch.relu(z)
    if activation == "hardtanh":
        return torch.nn.functional.hardtanh(z, low, high)
    if activation == "silu":
        return torch.nn.functional.silu(z)
    return z


def activation_grad(grad: torch.Tensor, z: torch.Tensor, activation: str, low: float, high: float) -> torch.Tensor:
    """The gradient at the activation's input `z`, from the gradient at its result, as aten's
    backward ops give it (relu's `threshold_backward` masks where its result is at most 0, which
    is where `z` is)."""
    if activation == "relu":
        return torch.where(z <= 0, torch.zeros_like(grad), grad)
    if activation == "hardtanh":
        return torch.where((z <= low) | (z >= high), torch.zeros_like(grad), grad)
    if activation == "silu":
        s = torch.sigmoid(z)
        return grad * s * (1 + z * (1 - s))
    return grad


def forward(x, weight, bias, running_mean, running_var, momentum: float, eps: float, activation: str,
            low: float, high: float, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    z, mean, rstd, new_mean, new_var = torch.ops.aten._native_batch_norm_legit_functional(
        x, weight, bias, running_mean, running_var, True, momentum, eps)
    if residual is not None:
        z = z + residual
    return activate(z, activation, low, high), mean, rstd, new_mean, new_var


def preactivation(x, weight, bias, mean, rstd) -> torch.Tensor:
    """Batch norm's result computed again from its input and saved statistics, in float32."""
    z = (x.float() - _channel(mean, x)) * _channel(rstd, x)
    if weight is not None:
        z = z * _channel(weight.float(), x)
    if bias is not None:
        z = z + _channel(bias.float(), x)
    return z


def backward(grad, x, weight, bias, mean, rstd, eps: float, activation: str, low: float,
             high: float) -> tuple[torch.Tensor, ...]:
    if activation != "none":
        z = preactivation(x, weight, bias, mean, rstd)
        grad = activation_grad(grad.float(), z, activation, low, high).to(grad.dtype)
    dx, dweight, dbias = torch.ops.aten.native_batch_norm_backward(
        grad, x, weight, None, None, mean, rstd, True, eps, [True, weight is not None, weight is not None])
    return dx, dweight, dbias
