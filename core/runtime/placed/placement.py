"""Running ops so that their results land at their planned arena offsets.

Each op whose output is a planned buffer writes straight into its arena view through the op's
`out=` overload. Where that overload would only compute and then copy (convolution, relu), a
substitute with a real out= kernel is used: cuDNN convolution plus an in-place bias add,
clamp_min for relu, generated kernels for layer norm, max and average pooling and the mean over height and
width (global average pooling; `reductions.py`) and roll (`movement.py`), one copy
for a reshape or `contiguous` that must copy, a float32 GEMM then its bias where tuning chose
that (`BiasedGemm`), and a linear layer of few rows as a generated kernel (`small_product`,
`pooled_conv.SmallLinear`). An op with no out=
overload computes, then copies into its view. Views and in-place results are whatever the op
returns: views of the arena, of inputs or of weights.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from ...errors import ExecutionError, first_line
from ...ops import arguments, fusion, interpret, targets, types
from ...ops.attention import ATTENTION
from ...ops.execute import Executor
from ...ir import ACTIVATION, Graph, Op, Ref, contiguous_strides, refs_of
from ...plan.memory import MemoryPlan
from ..base import settings
from ..kernels import fused_mean, gemm
from .indices import clamped
from ..kernels.fused import FusedKernel, conv_into
from ..kernels.generated import NormAfter
from ..kernels.movement import roll
from ..kernels.pooled_conv import SmallLinear
from ..kernels.reductions import avg_pool2d, layer_norm, max_pool2d, spatial_mean
from ..kernels.small_attention import Attention


@functools.lru_cache(maxsize=None)
def out_overload(target: str):
    """The `out=` overload that matches a functional overload argument for argument, or None.
    Returns (overload, names of its out arguments). Cached: a graph repeats few targets."""
    fn = targets.resolve(target)
    functional = [(a.name, str(a.type)) for a in fn._schema.arguments]
    packet = fn.overloadpacket
    for name in sorted(packet.overloads()):
        if "out" not in name:
            continue
        schema = getattr(packet, name)._schema
        outs = [a for a in schema.arguments if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write]
        rest = [(a.name, str(a.type)) for a in schema.arguments if a not in outs]
        if rest == functional and len(outs) == len(fn._schema.returns):
            return getattr(packet, name), tuple(a.name for a in outs)
    return None


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


def _copy(args: list, out: torch.Tensor) -> torch.Tensor | None:
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


def _reshape_copy(args: list, out: torch.Tensor) -> torch.Tensor | None:
    """A reshape or flatten that must copy (its input's strides allow no view; the plan gave it a
    buffer): the input's elements, in its row-major order, copied once into the contiguous buffer
    seen in the input's shape. None where the buffer is not contiguous (a channels_last choice)."""
    x = args[0]
    if not out.is_contiguous() or out.numel() != x.numel():
        return None
    out.view(x.shape).copy_(x)
    return out


def _relu(args: list, out: torch.Tensor) -> torch.Tensor:
    torch.ops.aten.clamp_min.out(args[0], 0, out=out)
    return out


class BiasedGemm:
    """addmm(bias, x, w) or linear(x, w, bias) in float32, as the GEMM alone then an in-place add of
    the bias, where load-time tuning found that faster (`tuning.GEMM_BIAS`). In full float32,
    cuBLASLt's bias epilogue can cost 1.2 to 2.6 times the plain GEMM at transformer shapes with
    few rows (H100, `benchmarks/gemm_bias.py`); in half precision it is the faster one. Until
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
    "aten::relu.default": _relu,
    "aten::adaptive_avg_pool2d.default": _global_avg_pool,
    "aten::mean.dim": _mean,
    "aten::layer_norm.default": layer_norm,
    "aten::max_pool2d.default": max_pool2d,
    "aten::avg_pool2d.default": avg_pool2d,
    "aten::contiguous.default": _copy,
    "aten::linear.default": _linear,
    "aten::_to_copy.default": _copy,
    "aten::to.dtype": _copy,
    "aten::reshape.default": _reshape_copy,
    "aten::flatten.using_ints": _reshape_copy,
    "aten::roll.default": roll,
}
# Generated out= overloads that allocate a result and copy it: no better than computing then copying.
COPYING_OUT = frozenset({"aten::convolution.default", "aten::_convolution.default", "aten::relu.default",
                         "aten::native_layer_norm.default"})


@dataclass
class PlacedOp:
    op: Op
    fn: Callable
    out_fn: Callable | None  # the op's out= overload, used when every output is a planned buffer
    out_names: list[str]
    substitute: Callable | None
    clamps: tuple = ()  # index arguments read clamped into range on CUDA (`indices.py`)
    # writes the op's result into any tensor of its shape and dtype, whatever its strides, or
    # declines (False): generated attention (`small_attention.Attention`)
    writer: Callable | None = None


def prepare(graph: Graph) -> list[PlacedOp]:
    """Resolve every op once: its function, out= overload and substitute."""
    placed = []
    for op in graph.ops:
        if op.target == fusion.FUSED:
            placed.append(PlacedOp(op, interpret.run_fused, None, [], FusedKernel(op)))
            continue
        found = None if op.target in COPYING_OUT else out_overload(op.target)
        substitute = BiasedGemm(op.target == "aten::linear.default") if BiasedGemm.applies(graph, op) \
            else SUBSTITUTES.get(op.target)
        if gemm.applies(graph, op):
            substitute = gemm.Gemm(op.id, op.target, substitute)
        product = small_product(graph, op)
        if product:
            substitute = SmallLinear(op.id, substitute, product)
        writer = None
        if op.target == ATTENTION and not list(refs_of(tuple(v for _, v in op.kwargs))):
            writer = Attention(op.id, dict(op.kwargs))
        placed.append(PlacedOp(op, targets.resolve(op.target), found[0] if found else None,
                               found[1] if found else [], substitute, writer=writer))
    return placed


def arena_views(graph: Graph, memory: MemoryPlan, arena: torch.Tensor, channels_last=()) -> dict[int, torch.Tensor]:
    """Value id -> a tensor over its planned bytes, for every planned (root) activation. The values
    in `channels_last` (dense 4-D buffers) get channels_last strides over the same bytes."""
    views = {}
    for v in graph.values:
        off = memory.offset[v.id]
        if v.kind != ACTIVATION or off is None:
            continue
        dtype = types.DTYPES[v.spec.dtype]
        flat = arena[off: off + memory.size[v.id]].view(dtype)
        if v.id in channels_last:
            n, c, h, w = v.spec.shape
            strides = (h * w * c, 1, w * c, c)
        else:
            strides = v.spec.strides or contiguous_strides(v.spec.shape)
        views[v.id] = flat.as_strided(v.spec.shape, strides, flat.storage_offset() + v.spec.offset)  # absolute
    return views


class PlacedRun(Executor):
    """Each op with its outputs written into their planned views (`arena_views`): an op's
    substitute where it has one, else its out= overload, else computed and copied in. Views and
    in-place results are bound as returned. With `name_failures`, an op that fails is named with
    its source line."""

    def __init__(self, env: dict[int, torch.Tensor], views: dict[int, torch.Tensor], device,
                 name_failures: bool = True, release: dict[int, list[int]] | None = None,
                 kept: frozenset[int] = frozenset(), pairs=None):
        """`release` (op -> values) drops each listed value once that op is issued, where its tensor
        lies outside the storages in `kept` (the arena, weights and inputs), so its memory goes
        back to the allocator. `pairs` (`pairs.Pairs`) runs each elementwise op and the layer norm
        after it as one kernel where it can, and each fused op and the spatial mean after it, and
        copies a computed result through its view into the buffer of the copy that reads it."""
        self.env, self.views, self.device, self.name_failures = env, views, device, name_failures
        self.release, self.kept = release or {}, kept
        self.norms = pairs.norms if pairs is not None else {}
        self.means = pairs.means if pairs is not None else {}
        self.copies = pairs.copies if pairs is not None else {}
        self.products = pairs.products if pairs is not None else {}
        self.scatters = pairs.scatters if pairs is not None else {}
        self.written: set[int] = set()

    def arguments(self, p: PlacedOp):
        args, kwargs = arguments.op_arguments(p.op, self.env, self.device)
        if p.clamps and self.device.type == "cuda":  # computed indices: out of range would trip a device-side assert
            args = clamped(args, p.clamps)
        return args, kwargs

    def call(self, p: PlacedOp, args, kwargs) -> list[torch.Tensor]:
        planned = [self.views.get(o) for o in p.op.outputs]
        if p.op.id in self.written:  # a layer norm its producer's kernel has written
            self.written.discard(p.op.id)
            return planned
        if planned and all(t is not None for t in planned):
            if p.op.id in self.norms and self._with_norm(p, args, kwargs, planned[0]):
                return planned
            if p.op.id in self.means:
                got = self._with_mean(p, args, planned[0])
                if got is not None:
                    return [got]
            if p.op.id in self.products and self._with_epilogue(p, args, planned[0]):
                return planned
            if p.op.id in self.scatters and self._through_views(p, args, planned[0]):
                return planned
            got = p.substitute(args, planned[0]) if p.substitute is not None and len(planned) == 1 else None
            if got is not None:
                return [got]
            if p.out_fn is not None:
                p.out_fn(*args, **kwargs, **dict(zip(p.out_names, planned)))
                return planned
        if p.writer is not None and len(planned) == 1 and planned[0] is not None \
                and self._by_writer(p, args, planned[0]):
            return planned
        results = arguments.flatten_result(p.fn(*args, **kwargs))
        if p.op.id in self.copies and len(results) == 1 and planned and planned[0] is not None \
                and self._copy_through_view(p, results[0]):
            return planned
        for t, view in zip(results, planned):
            if view is not None:
                view.copy_(t)
        # a view or in-place result, or an output outside the arena, is bound as returned
        return [t if view is None else view for t, view in zip(results, planned)]

    def _with_norm(self, p: PlacedOp, args, kwargs, out: torch.Tensor) -> bool:
        """The elementwise op `p` and the layer norm after it in one kernel; False where it cannot."""
        norm, store, kernel = self.norms[p.op.id]
        norm_out = self.views.get(norm.op.outputs[0])
        if norm_out is None:
            return False
        body = _body(p.op, args, kwargs)
        self.env[p.op.outputs[0]] = out  # the norm's input, bound before its producer returns
        (_, shape, weight, bias, eps, *_), _ = arguments.op_arguments(norm.op, self.env, self.device)
        if not kernel.with_norm(body, out, NormAfter(tuple(shape), weight, bias, eps, norm_out, store)):
            return False
        self.written.add(norm.op.id)
        return True

    def _with_epilogue(self, p: PlacedOp, args, out: torch.Tensor) -> bool:
        """The product `p` and the elementwise op after it as one kernel (`pairs.product_pairs`);
        False, with nothing run, where it cannot."""
        second, kernel, through = self.products[p.op.id]
        into = self.views.get(second.op.outputs[0])
        if into is None:
            return False
        self.env[p.op.outputs[0]] = held = out  # the second op's operand, bound before its producer returns
        if through is not None:  # read through a reshape (issued between the two; it binds the same view)
            seen, shape = through
            self.env[seen] = held = out.view(shape)
        body = _body(second.op, *arguments.op_arguments(second.op, self.env, self.device))
        operands, _ = kernel.operands(body)
        if not p.substitute.with_epilogue(args, out, body, operands, into, held):  # a gemm.Gemm
            return False
        self.written.add(second.op.id)
        return True

    def _through_views(self, p: PlacedOp, args, out: torch.Tensor) -> bool:
        """The product `p` stored straight where the copy that reads it through views puts each
        element (`pairs.scatter_pairs`); False, with nothing run, where it cannot. `out`, the
        product's own buffer, is never written: only the views, then the copy, read it."""
        chain, copy = self.scatters[p.op.id]
        target = self.views.get(copy.op.outputs[0])
        into = _seen_back([v.op for v in chain], target, out) if target is not None else None
        if into is None or not p.substitute.through(args, out, into):  # a gemm.Gemm
            return False
        self.written.add(copy.op.id)
        return True

    def _with_mean(self, p: PlacedOp, args, out: torch.Tensor) -> torch.Tensor | None:
        """The fused op `p` and, where one kernel can run both, the spatial mean after it
        (`fused_mean.run`): the tensor holding `p`'s result, or None with nothing run."""
        mean, store, kernel = self.means[p.op.id]
        mean_out = self.views.get(mean.op.outputs[0])
        if mean_out is None:
            return None
        after = fused_mean.MeanAfter(mean_out, store)
        got = fused_mean.run(kernel, args[0], out, after)
        if after.done:
            self.written.add(mean.op.id)
        return got

    def _by_writer(self, p: PlacedOp, args, out: torch.Tensor) -> bool:
        """Whether `p`'s writer wrote its result: where `p` is paired with a view and a copy
        (`pairs.copy_pairs`), into the copy's buffer seen back through the view (`_unviewed`), so
        the copy has nothing left to do; else into `out`."""
        if p.op.id in self.copies:
            view, copy = self.copies[p.op.id]
            target = self.views.get(copy.op.outputs[0])
            into = _unviewed(view.op, target, out) if target is not None else None
            if into is None:
                return p.writer(args, out)
            if not p.writer(args, into):
                return False
            self.written.add(copy.op.id)
            return True
        return p.writer(args, out)

    def _copy_through_view(self, p: PlacedOp, result: torch.Tensor) -> bool:
        """`result` seen through the view after `p`, copied into the buffer of the copy after
        that (`pairs.copy_pairs`); False, with nothing written, where that buffer does not fit."""
        view, copy = self.copies[p.op.id]
        target = self.views.get(copy.op.outputs[0])
        if target is None or target.dtype != result.dtype:
            return False
        self.env[p.op.outputs[0]] = result
        args, kwargs = arguments.op_arguments(view.op, self.env, self.device)
        seen = view.fn(*args, **kwargs)
        if not isinstance(seen, torch.Tensor) or _reshape_copy([seen], target) is None:
            return False
        self.written.add(copy.op.id)
        return True

    def bind(self, p: PlacedOp, results) -> None:
        self.env.update(zip(p.op.outputs, results))
        for v in self.release.get(p.op.id, ()):
            t = self.env.get(v)
            if t is not None and t.untyped_storage().data_ptr() not in self.kept:
                del self.env[v]

    def failed(self, p: PlacedOp, error):
        if not self.name_failures:
            return None
        return ExecutionError(f"op {p.op.id} ({p.op.target}, from {p.op.source}) fails on {self.device}: "
                              f"{first_line(error)}")


def _body(op: Op, args, kwargs) -> tuple:
    """The body a generated kernel computes for `op` called with these arguments: a fused op's
    own, or the lone elementwise op as a body of one node."""
    return args[0] if op.target == fusion.FUSED else ((op.target, tuple(args), tuple(kwargs.items())),)


RESHAPES = frozenset({"aten::view.default", "aten::reshape.default", "aten::_unsafe_view.default"})


def _viewed(view: Op, t: torch.Tensor) -> torch.Tensor | None:
    """`t` through `view` (a reshape, permutation or transpose, as `pairs.VIEWS`), None for another op."""
    if view.target == "aten::permute.default" and len(view.args) == 2:
        return t.permute([d % t.dim() for d in view.args[1]])
    if view.target == "aten::transpose.int" and len(view.args) == 3:
        return t.transpose(view.args[1], view.args[2])
    if view.target in RESHAPES and len(view.args) == 2:
        return t.reshape(view.args[1])
    return None


def _seen_back(chain: list[Op], target: torch.Tensor, out: torch.Tensor) -> torch.Tensor | None:
    """`target` (the dense buffer of a copy of `out` seen through the views `chain`) seen back
    through them, as far as strides can: a tensor whose elements, in row-major order, are where
    the copy puts `out`'s elements in row-major order. Walking back, a permutation is undone; a
    reshape keeps row-major order, so where strides cannot undo one, every view before it must
    be a reshape too, and the walk stops there. None where the views or buffers do not fit."""
    if target.dtype != out.dtype or target.device != out.device or target.numel() != out.numel():
        return None
    shapes = [torch.empty(out.shape, device="meta")]
    for view in chain:
        seen = _viewed(view, shapes[-1])
        if seen is None:
            return None
        shapes.append(seen)
    seen = target
    if tuple(seen.shape) != tuple(shapes[-1].shape):
        if not seen.is_contiguous():
            return None
        seen = seen.view(shapes[-1].shape)
    for k in range(len(chain) - 1, -1, -1):
        view = chain[k]
        if view.target == "aten::permute.default":
            dims = [d % seen.dim() for d in view.args[1]]
            seen = seen.permute(sorted(range(len(dims)), key=dims.__getitem__))
        elif view.target == "aten::transpose.int":
            seen = seen.transpose(view.args[1], view.args[2])
        else:
            try:
                seen = seen.view(shapes[k].shape)
            except RuntimeError:
                return seen if all(v.target in RESHAPES for v in chain[:k]) else None
    return seen


def _unviewed(view: Op, target: torch.Tensor, out: torch.Tensor) -> torch.Tensor | None:
    """`target` (the buffer of a copy of `view`'s result) seen in `out`'s shape, where `view` is
    a transpose or permutation of `out`: what writing `out` through the view into `target` writes.
    None where the view is another op, or the shapes or dtypes do not match."""
    if target.dtype != out.dtype or target.device != out.device:
        return None
    if view.target == "aten::transpose.int" and len(view.args) == 3:
        d0, d1 = view.args[1], view.args[2]
        seen, back = out.transpose(d0, d1), (lambda t: t.transpose(d0, d1))
    elif view.target == "aten::permute.default" and len(view.args) == 2:
        dims = [d % out.dim() for d in view.args[1]]
        seen, back = out.permute(dims), (lambda t: t.permute(sorted(range(len(dims)), key=dims.__getitem__)))
    else:
        return None
    if tuple(target.shape) != tuple(seen.shape):
        if not target.is_contiguous() or target.numel() != out.numel():
            return None
        target = target.view(seen.shape)
    into = back(target)
    return into if tuple(into.shape) == tuple(out.shape) else None
