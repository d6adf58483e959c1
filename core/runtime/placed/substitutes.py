"""The substitutes that write one op's result into its planned buffer with a real out= kernel,
where the op's own out= overload would compute, then copy (`placement.py` says which op gets
which): cuDNN convolution plus an in-place bias add, clamp_min for relu, generated kernels for
layer norm, max and average pooling and the mean over height and width (global average pooling;
`kernels/reductions.py`) and roll (`kernels/movement.py`), one copy for a reshape or `contiguous`
that must copy, a float32 GEMM then its bias where tuning chose that (`BiasedGemm`), and a linear
layer of few rows as a generated kernel (`small_product`, `kernels/pooled_conv.SmallLinear`).
Each takes (args, out) and returns the tensor holding the result, or None to compute and copy."""

from __future__ import annotations

from typing import Callable

import torch

from ...ir import Graph, Op, Ref
from ...ops import fusion
from ..base import settings
from ..kernels.convolution import conv_into
from ..kernels.movement import roll
from ..kernels.norms import layer_norm
from ..kernels.reductions import avg_pool2d, max_pool2d, spatial_mean

RESHAPES = frozenset({"aten::view.default", "aten::reshape.default", "aten::_unsafe_view.default"})


def _conv(args: list, out: torch.Tensor) -> torch.Tensor | None:
    """aten::convolution into `out` as eager PyTorch computes it (`kernels.conv_into`): through
    cuDNN's out= kernel (bias added in place) or the CUDA depthwise kernel's, else computed and
    copied. None for a transposed convolution or one off CUDA: the caller computes and copies."""
    p = fusion.conv_params("aten::convolution.default", args)  # None: transposed
    if p is None or not p["input"].is_cuda or p["input"].dim() != 4:
        return None
    return conv_into(p, out, with_bias=True)


def _global_avg_pool(args: list, out: torch.Tensor) -> torch.Tensor | None:
    """adaptive_avg_pool2d to 1x1: a mean over H and W, by the generated kernel where it applies
    (`reductions.spatial_mean`), else as eager computes it; its out= overload would run the
    generic pooling kernel, which is far slower on large maps."""
    if len(args) < 2 or not isinstance(args[1], (list, tuple)) or list(args[1]) != [1, 1]:
        return None
    if spatial_mean(args[0], out) is None:
        torch.ops.aten.mean.out(args[0], [-1, -2], True, out=out)
    return out


def height_and_width(dims) -> bool:
    """Whether `dims` (a mean's dimensions) are the last two of a 4-D tensor, in any order."""
    return isinstance(dims, (list, tuple)) and len(dims) == 2 \
        and all(type(d) is int and -4 <= d < 4 for d in dims) and {d % 4 for d in dims} == {2, 3}


def _mean(args: list, out: torch.Tensor) -> torch.Tensor | None:
    """mean.dim over the last two dimensions of a 4-D tensor, without a dtype: the generated
    kernel (`reductions.spatial_mean`); None for any other mean, which runs its out= overload."""
    x, dims = (list(args) + [None, None])[:2]
    if not (isinstance(x, torch.Tensor) and x.dim() == 4 and height_and_width(dims)) \
            or (len(args) > 3 and args[3] is not None):
        return None
    return spatial_mean(x, out)


def copy(args: list, out: torch.Tensor) -> torch.Tensor | None:
    """contiguous, _to_copy or to(dtype): one copy into the planned buffer, converting to its dtype
    (the cast's). The op itself would copy, then be copied in; a cast's generated out= overload
    converts into a temporary, then copies that in. None where the device or the shape changes."""
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or x.device != out.device or tuple(x.shape) != tuple(out.shape):
        return None
    out.copy_(x)
    return out


def _linear(args: list, out: torch.Tensor) -> torch.Tensor | None:
    """linear(x, w, bias) on CUDA as one GEMM with cuBLASLt's bias epilogue, into the planned
    buffer: addmm over x and the buffer seen as matrices, as PyTorch's functional linear runs a
    contiguous input. Its out= overload runs a 3-D input as a GEMM, then a kernel that adds the
    bias. None where x or the buffer is not contiguous, or there is no 1-D bias."""
    if len(args) != 3 or not out.is_cuda:
        return None
    x, w, bias = args
    if not (isinstance(bias, torch.Tensor) and bias.dim() == 1 and isinstance(x, torch.Tensor) and x.dim() >= 2
            and w.dim() == 2 and x.is_contiguous() and out.is_contiguous() and bias.numel() == w.shape[0]
            and out.shape[-1] == w.shape[0] and x.dtype == w.dtype == bias.dtype == out.dtype):
        return None
    torch.addmm(bias, x.view(-1, x.shape[-1]), w.t(), out=out.view(-1, out.shape[-1]))
    return out


def reshape_copy(args: list, out: torch.Tensor) -> torch.Tensor | None:
    """A reshape or flatten that must copy (its input's strides allow no view; the plan gave it a
    buffer): the input's elements, in its row-major order, copied once into the contiguous buffer
    seen in the input's shape. None where the buffer is not contiguous (a channels_last choice)."""
    x = args[0]
    if not out.is_contiguous() or out.numel() != x.numel():
        return None
    out.view(x.shape).copy_(x)
    return out


def relu(args: list, out: torch.Tensor) -> torch.Tensor:
    torch.ops.aten.clamp_min.out(args[0], 0, out=out)
    return out


class BiasedGemm:
    """addmm(bias, x, w) or linear(x, w, bias) in float32, as the GEMM alone then an in-place add of
    the bias, where load-time tuning found that faster (`tuning.GEMM_BIAS`). In full float32,
    cuBLASLt's bias epilogue can cost 1.2 to 2.6 times the plain GEMM at transformer shapes with
    few rows (H100, `benchmarks/results/gemm_bias.md`); in half precision it is the faster one. Until
    `separate` is set, a linear runs as one GEMM with the bias epilogue (`_linear`) and an addmm
    as its own out= overload."""

    def __init__(self, linear: bool):
        self.linear, self.separate = linear, False

    @staticmethod
    def applies(graph: Graph, op: Op) -> bool:
        """A float32 addmm with beta and alpha 1, or linear, whose bias is a 1-D graph value."""
        if len(op.outputs) != 1 or graph.values[op.outputs[0]].spec.dtype != "float32":
            return False
        if op.target == "aten::addmm.default":
            bias = op.args[0] if op.args else None
            if any(a != 1 for a in op.args[3:]) or any(k not in ("beta", "alpha") or v != 1 for k, v in op.kwargs):
                return False
        elif op.target == "aten::linear.default":
            bias = op.args[2] if len(op.args) == 3 and not op.kwargs else None
        else:
            return False
        return isinstance(bias, Ref) and len(graph.values[bias.id].spec.shape) == 1

    def __call__(self, args: list, out: torch.Tensor) -> torch.Tensor | None:
        if not out.is_cuda:
            return None
        if not self.separate:
            return _linear(args, out) if self.linear else None
        if self.linear:
            x, w, bias = args
            torch.ops.aten.linear.out(x, w, None, out=out)
        else:  # addmm(bias, x, w)
            bias, x, w = args[:3]
            torch.mm(x, w, out=out)
        out.add_(bias)
        return out


def small_product(graph: Graph, op: Op) -> int:
    """M x N x K of a floating linear of a 2-D input where that is at most the `max_pooled_products` setting
    (it then runs as a generated kernel, `SmallLinear`), else 0."""
    if not settings.current().pooled_kernel \
            or op.target != "aten::linear.default" or op.kwargs or len(op.outputs) != 1 or len(op.args) not in (2, 3) \
            or not all(isinstance(a, Ref) for a in op.args[:2]):
        return 0
    x, w = (graph.values[a.id].spec for a in op.args[:2])
    out = graph.values[op.outputs[0]].spec
    if len(x.shape) != 2 or len(w.shape) != 2 or out.dtype not in fusion.FLOATS:
        return 0
    product = x.shape[0] * w.shape[0] * x.shape[1]
    return product if 0 < product <= settings.current().max_pooled_products else 0


# target -> writer(args, out) that computes the op with a real out= kernel and returns the tensor
# holding the result (`out`, or one a fused cuDNN kernel allocated), or None to compute and copy
SUBSTITUTES: dict[str, Callable[[list, torch.Tensor], torch.Tensor | None]] = {
    "aten::convolution.default": _conv,
    "aten::relu.default": relu,
    "aten::adaptive_avg_pool2d.default": _global_avg_pool,
    "aten::mean.dim": _mean,
    "aten::layer_norm.default": layer_norm,
    "aten::max_pool2d.default": max_pool2d,
    "aten::avg_pool2d.default": avg_pool2d,
    "aten::contiguous.default": copy,
    "aten::linear.default": _linear,
    "aten::_to_copy.default": copy,
    "aten::to.dtype": copy,
    "aten::reshape.default": reshape_copy,
    "aten::flatten.using_ints": reshape_copy,
    "aten::roll.default": roll,
}
# Generated out= overloads that allocate a result and copy it: no better than computing then copying.
