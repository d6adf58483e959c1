"""Convolutions into a given buffer, as eager PyTorch runs them, and the shapes they compute."""

from __future__ import annotations

import torch


def conv_shape(p: dict) -> tuple[int, ...]:
    """The shape a 2-D convolution with these arguments computes."""
    x, w = p["input"], p["weight"]
    dims = []
    for d in range(2):
        k = (w.shape[2 + d] - 1) * p["dilation"][d] + 1
        dims.append((x.shape[2 + d] + 2 * p["padding"][d] - k) // p["stride"][d] + 1)
    return (x.shape[0], w.shape[0], *dims)


def writes(conv: dict, out: torch.Tensor) -> bool:
    """Whether the convolution computes `out`'s shape and dtype (a body may broadcast past it)."""
    return conv_shape(conv) == tuple(out.shape) and conv["input"].dtype == out.dtype


def scratch_like(out: torch.Tensor) -> torch.Tensor:
    """A buffer of `out`'s shape, strides and dtype, for a reference result to be compared with it."""
    return torch.empty_strided(out.shape, out.stride(), dtype=out.dtype, device=out.device)


def on_cudnn(p: dict) -> bool:
    x, w = p["input"], p["weight"]
    backend = torch._C._select_conv_backend(x, w, p["bias"], list(p["stride"]), list(p["padding"]),
                                            list(p["dilation"]), False, [0, 0], p["groups"], None)
    return backend == torch._C._ConvBackend.Cudnn


def conv_into(p: dict, out: torch.Tensor, with_bias: bool = False) -> torch.Tensor:
    """The convolution (`fusion.conv_params`), with its bias or without, written into `out` with
    the kernel eager PyTorch would pick, through that kernel's out= overload: cuDNN's (the bias
    then added in place, as eager does) or the depthwise kernel (the bias in it); else computed
    and copied. Only a dense `out` (contiguous or channels_last) goes to an out= overload:
    `cudnn_convolution.out` into a channel slice of a larger buffer writes wrong values
    (H100, torch 2.11), so any other `out` gets the result copied in. Returns `out`."""
    x, w = p["input"], p["weight"]
    bias = p["bias"] if with_bias else None
    stride, padding, dilation = list(p["stride"]), list(p["padding"]), list(p["dilation"])
    backend = torch._C._select_conv_backend(x, w, p["bias"], stride, padding, dilation, False, [0, 0],
                                            p["groups"], None)
    if not (out.is_contiguous() or out.is_contiguous(memory_format=torch.channels_last)):
        backend = None  # computed and copied
    if backend == torch._C._ConvBackend.Cudnn:
        torch.ops.aten.cudnn_convolution.out(x, w, padding, stride, dilation, p["groups"],
                                             torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic,
                                             torch.backends.cudnn.allow_tf32, out=out)
        if bias is not None:
            out.add_(bias.reshape(1, -1, 1, 1))
    elif backend == torch._C._ConvBackend.CudaDepthwise2d:
        torch.ops.aten._conv_depthwise2d.out(x, w, list(w.shape[2:]), bias, stride, padding, dilation, out=out)
    else:
        out.copy_(torch.ops.aten.convolution(x, w, bias, stride, padding, dilation, False, [0, 0], p["groups"]))
    return out
