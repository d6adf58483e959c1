"""Fused ops on CUDA: cuDNN's fused convolutions and generated Triton kernels.

`FusedKernel(op)` is what the runtime calls for a fused op (`ops/fusion.py`) that has a planned
buffer. Given the op's arguments (its body, tensors in place of Refs) and the buffer, it returns
the tensor that holds the result:

- a body that is conv -> relu or conv -> add -> relu, where PyTorch would run the convolution on
  cuDNN, runs as one cuDNN kernel, bias included: a cuDNN graph that writes the planned buffer
  where `cudnn_graph` found a plan at most `cudnn_slower_outside` slower, else `cudnn_convolution_relu` or
  `cudnn_convolution_add_relu`, whose result cuDNN allocates (no out= form), so it is bound in
  place of the planned buffer;
- any other body that leads with a convolution runs as one cuDNN graph that writes the planned
  buffer, where `cudnn_graph` found a correct plan at least as fast as the two kernels below;
- any other body runs as one generated Triton kernel that writes the planned buffer. A
  convolution leading such a body first writes the buffer without its bias, as a cuDNN graph of
  the convolution alone where `cudnn_graph` chose one (no workspace of its own in the captured
  graph's pool), else through cuDNN's out= kernel; the kernel then adds the bias and applies the
  rest of the body in place;
- a body led by a 1x1 convolution of a 1x1 map (squeeze-and-excitation's, `pooled_conv.fits`)
  or by a depthwise convolution with a channels_last result (`depthwise_conv.fits`) runs as one
  generated kernel that computes the convolution too; a depthwise filter of more than 25 taps
  only where that was measured faster than cuDNN's convolution (`depthwise_conv.Wide`);
- a body led by a 1x1 convolution whose input an elementwise op deferred (`pairs.input_pairs`)
  runs as one generated kernel that computes that op's body as it loads the input
  (`pointwise_conv`), where it fits and was measured faster; else the deferred op runs first;
- any other body led by a 1x1 convolution with a channels_last result, except conv -> relu (one
  cuDNN kernel already) and conv -> add -> relu (the same, unless cuDNN splits its sum on a small
  map: the `fused_candidate_rows` setting), may run as that kernel reading its input as it lies
  (`_pointwise`, the `standalone_pointwise` setting), where it was measured faster than the ways above;
- such measured choices are kept in the cache folder (`recall.py`) for later loads;
- a convolution alone (`passes/fuse_lone_convolutions.py`) runs as a cuDNN graph of the
  convolution and its bias where one was chosen, else as eager PyTorch runs it, into the buffer:
  cuDNN's out= kernel and the bias added in place, or the depthwise kernel with its bias;
- a body led by a cat (`passes/fuse_concats.py`) runs as one generated kernel that reads each
  part where it lies (`codegen.concat_source`), where the parts and the buffer are dense in one
  order of dims; else it is interpreted (the cat, then the rest);
- an elementwise body and the layer norm issued right after it (`pairs.norm_pairs`) run as
  one row kernel, `with_norm`: the body over a row, stored where others read it, then that row
  normalised into the norm's buffer.

A kernel is specialised to its call: the body, the shapes, the strides of every operand (so the
layout) and the dtypes. It is compiled from the source text `codegen.py` generates, never
imported from disk; a copy is kept in the cache folder under the hash of that source (which
names all of these and the torch and Triton versions) for reading, and Triton keeps the compiled
binary in its own cache, keyed by the GPU's compute capability too. A later process launches that binary without
importing Triton (`binaries.py`). If Triton is missing or a kernel cannot be built, the body is
interpreted op by op instead, and `STATS` counts it. Index arithmetic is 64-bit wherever an
offset can pass 2**31 - 1 (`codegen.needs_wide`).
"""

from __future__ import annotations

import copy

import torch

from ...errors import first_line
from ...ir import Local
from ...ops import fusion
from ..base import settings, timing
from . import cudnn_graph, depthwise_conv, generated, pointwise_conv, pooled_conv
from .codegen import (ConcatTiles, body_signature, concat_source, elementwise_source, layouts, norm_source,
                      overlaps, pointwise_operands)
from .convolution import conv_into, conv_shape, on_cudnn, scratch_like, writes
from .generated import FLOAT_KINDS, NormAfter
from .on_load import OnLoad

# a 1x1 convolution whose body cuDNN does not fuse whole may run as one generated matrix product
# (`FusedKernel._pointwise`), chosen per call by measurement
# conv -> add -> relu is one cuDNN kernel, except where cuDNN's plan splits the sum over the input
# channels and adds a reduction kernel (small maps: resnet50's 14x14 stage at batch 1); such a
# body whose product has at most this many rows (images x height x width) is a candidate too
# where its cuDNN way was counted launching more than one kernel (0: never). conv -> relu is
# never one: inception_v3's 8x8 convolutions are split sums too, and their candidates all lost
# while doubling its cold load (`benchmarks/results/small_map_candidates_2026-11-27.md`)


class FusedKernel(OnLoad):
    """The CUDA lowering of one fused op; see the module docstring."""

    def __init__(self, op):
        self.op = op
        self.body = fusion.body_of(op)
        self.pattern = fusion.convolution_pattern(self.body)
        self.cudnn_fusion = True  # False: a cuDNN-fusible body runs as convolution plus generated epilogue
        self.workspaces = cudnn_graph.Workspaces()  # the executable gives all its kernels one
        self._built: dict[tuple, object] = {}  # call signature -> launcher, or None to interpret
        # a depthwise convolution's producer and the producer's epilogue applied by it on load
        # (`pairs.prologue_pairs`): the executable sets them per tuning candidate
        self.bare = False  # this op writes its convolution alone; its depthwise reader does the rest
        self.after_bare: FusedKernel | None = None  # this depthwise op's producer, when it is bare
        self.wrote_bare: list | None = None  # the body of this op's last call, where it wrote it bare
        self.bare_out: torch.Tensor | None = None  # the buffer it wrote it into
        self._prologue_chosen: dict[tuple, bool] = {}  # call signature -> whether the pair ran faster than apart
        self._noted: set[str] = set()  # what STATS has counted once for this op (shared by its lowered kernels)
        # an elementwise op whose 1x1 convolution reader computes it as it loads (`pairs.input_pairs`),
        # set per tuning candidate by the executable
        self.deferred = False  # this op writes nothing; its reader runs its body
        self.deferred_call: tuple | None = None  # (body, buffer) of this op's last call, where it deferred it
        self.reads_deferred: FusedKernel | None = None  # this 1x1 convolution's input's producer, deferred
        self._tiles = pointwise_conv.Choices()
        self._wide = depthwise_conv.Wide()  # call signature -> whether a wide depthwise filter runs generated
        self._split_counts: dict[tuple, int] = {}  # call signature -> kernels its cuDNN way launched

    def __call__(self, args: list, out: torch.Tensor) -> torch.Tensor | None:
        body = args[0]
        if not out.is_cuda:
            return None
        if self.deferred:
            self.deferred_call = (body, out)
            return out
        if self.reads_deferred is not None and self.reads_deferred.deferred_call is not None:
            return self._with_input(body, out, self.reads_deferred)
        if self.bare:
            self.wrote_bare = self._bare(body, out)
            if self.wrote_bare is not None:
                self.bare_out = out
                return out
        if self.after_bare is not None and self.after_bare.wrote_bare is not None:
            return self._after_bare(body, out, self.after_bare)
        return self._run(body, out)

    def lowered(self, cudnn_fusion: bool, workspaces) -> FusedKernel:
        """A fresh kernel for one tuning candidate (`assemble/lower.py`): this op's, with the candidate's
        convolution fusion and the load's cuDNN workspaces (`cudnn_graph.Workspaces`), in no pair
        yet. It shares what this kernel's calls measured and built."""
        made = copy.copy(self)
        made.cudnn_fusion, made.workspaces = cudnn_fusion, workspaces
        made.bare, made.after_bare, made.deferred, made.reads_deferred = False, None, False, None
        made.forget_calls()
        return made

    def forget_calls(self) -> None:
        """Drop the last call's body and buffer that a bare or deferred op keeps for its reader:
        views of the arena and weights, which would keep them allocated after the executable closes."""
        self.wrote_bare = self.bare_out = self.deferred_call = None

    def _run(self, body, out: torch.Tensor) -> torch.Tensor | None:
        if fusion.leads_with_concat(self.body):
            return self._concat(body, out)
        got = self._direct(body, out)
        if got is None:
            got = self._pointwise(body, out)
        return got if got is not None else self._split(body, out)

    def _split(self, body, out: torch.Tensor) -> torch.Tensor | None:
        """The body as cuDNN runs it whole, else as a convolution and a generated kernel after it."""
        got = self.whole_on_cudnn(body, out)
        return got if got is not None else self._generated(body, out)

    def _pointwise(self, body, out: torch.Tensor) -> torch.Tensor | None:
        """`out`, where a 1x1 convolution and the rest of its body ran as one generated matrix
        product (`pointwise_conv`, reading the input as it lies) and that was measured faster than
        `_split`; else None (on the call that chose, `_split` ran into `out` to be timed against,
        and the caller runs it again). Bodies that cuDNN's fused kernels take whole are no
        candidates (conv -> relu), or only where cuDNN launched two kernels for them on a small
        map (conv -> add -> relu, `_split_in_two`), which keeps the builds at load to
        efficientnet's and mobilenet's SiLU, ReLU6 and residual adds, and to resnets' split sums."""
        if not settings.current().standalone_pointwise or len(body) < 2 or self.pattern == "relu" \
                or not fusion.leads_with_convolution(self.body):
            return None
        operands, conv = self.operands(body)
        if conv is None or not isinstance(conv["input"], torch.Tensor):
            return None
        before = pointwise_conv.Before.alone(conv["input"])
        if not pointwise_conv.fits(conv, out, before):
            return None
        if self.pattern == "add_relu" and not self._split_in_two(body, out, operands):
            return None
        chosen = self._pointwise_chosen(body, out, operands, conv, before,
                                        lambda: self._into(body, out, self._split(body, out)), "")
        return out if chosen else None

    def _split_in_two(self, body, out: torch.Tensor, operands: list) -> bool:
        """Whether this call's body, one cuDNN kernel by its pattern, launched more than one
        (the `fused_candidate_rows` setting): counted once per call signature outside a capture, after a
        first run has made cuDNN's choices; False inside a capture where it was not counted, and
        where no temporary folder takes the capture's DOT file (the count is left out, not the load)."""
        if out.numel() // max(out.shape[1], 1) > settings.current().fused_candidate_rows:
            return False
        key = (layouts(out, *operands), body_signature(body, operands), self.cudnn_fusion,
               torch.backends.cudnn.allow_tf32)
        if key not in self._split_counts:
            if torch.cuda.is_current_stream_capturing():
                return False
            self._split(body, out)
            try:
                self._split_counts[key] = timing.kernels_in(lambda: self._split(body, out), out.device)
            except OSError as e:
                generated.STATS.fallbacks.append(f"op {self.op.id}: kernels not counted: {first_line(e)}")
                self._split_counts[key] = 1
        return self._split_counts[key] > 1

    def _pointwise_chosen(self, body, out: torch.Tensor, operands: list, conv: dict, before, otherwise,
                          what: str) -> bool:
        """Whether `pointwise_conv`'s kernel computed this body over `before` into `out`: with the
        tile chosen for this call against `otherwise()` (`pointwise_conv.Choices`), where one was."""
        w, bias = conv["weight"], conv["bias"] is not None
        key = ("pointwise", layouts(out, w, *operands), body_signature(body, operands), before.signature(),
               torch.backends.cudnn.allow_tf32)

        def fused(tile) -> bool:
            return self.launch(key + (tile,), lambda: pointwise_conv.launcher(generated.define(pointwise_conv.source(
                body, out, w, operands, bias, before, tile)), tile), (out, w, operands, before),
                f" as a 1x1 convolution{what}")

        def note(why: str) -> None:
            generated.STATS.fallbacks.append(f"op {self.op.id}: {why}")
        tile = self._tiles.tile(key, out, otherwise, fused, note)
        return tile is not None and fused(tile)

    def whole_on_cudnn(self, body, out: torch.Tensor) -> torch.Tensor | None:
        """The tensor holding the result where this call runs the whole body as one cuDNN kernel
        (see the module docstring); None, with nothing run, where it runs the generated way."""
        if self.cudnn_fusion and fusion.leads_with_convolution(self.body):
            return self._cudnn(body, out)
        return None

    # ---------------------------------------------------------------------------- cuDNN
    def _cudnn(self, body, out: torch.Tensor) -> torch.Tensor | None:
        """The body as one cuDNN kernel where it can be: a cuDNN graph that writes `out` where one
        was chosen for this call (`cudnn_graph`), else for conv -> relu and conv -> add -> relu
        PyTorch's fused kernel, which allocates its result. None: run the generated way."""
        p = fusion.conv_params(body[0][0], body[0][1])
        if p is None:  # a transposed or output-padded convolution
            return None
        x, w, bias = p["input"], p["weight"], p["bias"]
        if x.dtype not in FLOAT_KINDS or x.dim() != 4 or not on_cudnn(p):
            return None
        stride, padding, dilation = (list(p[k]) for k in ("stride", "padding", "dilation"))
        if w.dtype != x.dtype or (bias is not None and tuple(bias.shape) != (w.shape[0],)):
            return None
        fused = None
        if self.pattern == "relu":
            def fused() -> torch.Tensor:
                return torch.ops.aten.cudnn_convolution_relu(x, w, bias, stride, padding, dilation, p["groups"])
        elif self.pattern == "add_relu":
            add_args = body[1][1]
            z = add_args[1] if isinstance(add_args[0], Local) else add_args[0]
            if not isinstance(z, torch.Tensor) or tuple(z.shape) != conv_shape(p) or z.dtype != x.dtype:
                return None

            def fused() -> torch.Tensor:
                return torch.ops.aten.cudnn_convolution_add_relu(x, w, z, 1.0, bias, stride, padding, dilation,
                                                                 p["groups"])
        graph = self._cudnn_graph(body, p, out, fused)
        if graph is not None:
            return graph
        return fused() if fused is not None else None

    def _cudnn_graph(self, body, p: dict, out: torch.Tensor, fused) -> torch.Tensor | None:
        """`out`, written by this call's cuDNN graph (`cudnn_graph.choose` decides once per call
        signature, outside a capture); None where there is none. The reference is PyTorch's fused kernel, or this body's
        generated kernels into a buffer of their own."""
        if tuple(out.shape) != conv_shape(p) or out.dtype != p["input"].dtype:
            return None
        chain = cudnn_graph.epilogue(body, out)
        if chain is None:
            return None
        steps, tensors = chain
        operands = (p["input"], p["weight"], p["bias"], *tensors)

        def generated() -> torch.Tensor | None:
            return self._generated(body, scratch_like(out))
        graph = cudnn_graph.choose(p, steps, operands, out, fused or generated, self.workspaces,
                                   outside=fused is not None)
        return graph(operands, out) if graph is not None else None

    # ---------------------------------------------------------------------------- Triton
    def _generated(self, body, out: torch.Tensor) -> torch.Tensor | None:
        operands, conv = self.operands(body)
        key = (tuple(out.shape), tuple(out.stride()), out.dtype,
               layouts(*operands))
        if self.declined(key):
            return None
        if conv is not None and len(body) == 1:  # a convolution alone: nothing to generate
            return conv_into(conv, out, with_bias=True) if writes(conv, out) else None
        if not self.lead(conv, out):
            return None
        bias = conv is not None and conv["bias"] is not None
        built = self.launch(key, lambda: generated.elementwise_launcher(elementwise_source(body, out, operands, conv is not None, bias)),
                            (out, operands))
        return out if built else None

    def _concat(self, body, out: torch.Tensor) -> torch.Tensor | None:
        """`out`, written by one kernel that reads the leading cat's parts where they lie; None,
        with nothing run, where they or `out` do not fit `ConcatTiles` (it is interpreted)."""
        pieces, dim = list(body[0][1][0]), body[0][1][1]
        operands = pointwise_operands(body, skip_first=True)
        key = ("cat", dim, tuple(out.shape), tuple(out.stride()), out.dtype,
               layouts(*pieces, *operands))
        if self.declined(key) or out.dtype not in FLOAT_KINDS or overlaps(out, [*pieces, *operands]):
            return None
        tiles = ConcatTiles(out, pieces, dim)
        if not tiles.fits:
            self._built[key] = None
            generated.STATS.fallbacks.append(f"op {self.op.id}: a cat's parts or result are not dense in one order of dims")
            return None
        built = self.launch(key, lambda: generated.concat_launcher(concat_source(body, out, pieces, tiles, operands), tiles),
                            (out, pieces, operands), " as a cat's reader")
        return out if built else None

    def _direct(self, body, out: torch.Tensor, before: depthwise_conv.Prologue | None = None) -> torch.Tensor | None:
        """`out`, where the leading convolution and the rest of the body ran as one generated
        kernel that computes the convolution too: of a 1x1 map (`pooled_conv`), or depthwise
        (`depthwise_conv`, applying `before`, its producer's epilogue, to its input where given);
        None, with nothing run, where none leads or fits."""
        if not fusion.leads_with_convolution(self.body):
            return None
        operands, conv = self.operands(body)
        if conv is None:
            return None
        x, w, bias = conv["input"], conv["weight"], conv["bias"] is not None
        if before is None and pooled_conv.fits(conv, out):
            kind, build = "pooled", lambda: pooled_conv.launcher(generated.define(pooled_conv.source(body, out, x, w, operands,
                                                                                             bias)))
        elif depthwise_conv.fits(conv, out) and (before is None or depthwise_conv.prologue_fits(before, x)):
            kind, build = "depthwise", lambda: depthwise_conv.launcher(generated.define(depthwise_conv.source(
                body, out, x, w, operands, bias, conv, before)))
        else:
            return None
        key = (kind, tuple(out.shape), tuple(out.stride()), out.dtype, tuple(conv[k] for k in ("stride", "padding",
                                                                                                  "dilation")),
               layouts(x, w, *operands),
               before.signature() if before is not None else None)
        extra = list(before.operands) if before is not None else []
        what = " with its input's epilogue" if before is not None else ""

        def kernel() -> bool:
            return self.launch(key, build, (out, x, w, [*operands, *extra]), f" as a {kind} convolution{what}")
        if kind == "depthwise" and before is None and depthwise_conv.Wide.applies(w) and not self._wide.kernel_runs(
                key, out, kernel, lambda: self._into(body, out, self._generated(body, out))):
            return self._generated(body, out)  # cuDNN's convolution was faster
        return out if kernel() else None

    def operands(self, body) -> tuple[list[torch.Tensor], dict | None]:
        """The distinct tensors a generated kernel of `body` reads, in first-use order, with the
        leading convolution's bias last (shaped (1, C, 1, 1)) where it has one; and that
        convolution's parameters (`fusion.conv_params`), None where none leads."""
        leads = fusion.leads_with_convolution(self.body)
        conv = fusion.conv_params(body[0][0], body[0][1]) if leads else None
        operands = pointwise_operands(body, skip_first=leads)
        if conv is not None and conv["bias"] is not None:
            operands.append(conv["bias"].reshape(1, -1, 1, 1))
        return operands, conv

    def lead(self, conv: dict | None, out: torch.Tensor) -> bool:
        """The convolution leading a generated body (`operands`), without its bias, written into
        `out`, where the kernel then reads it; nothing where none leads. False, with nothing run,
        where the body broadcasts past its convolution (it is interpreted)."""
        if conv is None:
            return True
        if not writes(conv, out):
            return False
        self._convolution(conv, out)
        return True

    def declined(self, key: tuple) -> bool:
        """Whether the kernel for `key` failed to build: every later call is interpreted."""
        return key in self._built and self._built[key] is None

    def launch(self, key: tuple, build, args: tuple, what: str = "") -> bool:
        """`launch_once` for this op (`what` says in what form it ran)."""
        return generated.launch_once(self._built, key, build, args, f"op {self.op.id}{what}")

    def _convolution(self, p: dict, out: torch.Tensor) -> None:
        """The convolution that leads a generated body, without its bias (the kernel adds it),
        into `out`: as a cuDNN graph of the convolution alone where `cudnn_graph` chose one, else
        through cuDNN's out= kernel. The graph's workspace is its stream's (`Workspaces`); the
        out= kernel allocates its own during the capture, which then keeps a pool segment of 20
        MiB for as long as the graph lives. The split tuning candidate (`cudnn_fusion` False)
        keeps PyTorch's kernel, as eager runs it, and so do grouped convolutions: cuDNN's graph
        plans for mobilenet_v2's depthwise ones were so slow that timing them took minutes."""
        x = p["input"]
        if settings.current().bare_convolution_graphs \
                and self.cudnn_fusion and p["groups"] == 1 and x.dtype in FLOAT_KINDS \
                and x.dim() == 4 and out.dtype == x.dtype and p["weight"].dtype == x.dtype and on_cudnn(p):
            bare = {**p, "bias": None}
            operands = (x, p["weight"], None)

            graph = cudnn_graph.choose(bare, (), operands, out, lambda: conv_into(bare, scratch_like(out)),
                                       self.workspaces)
            if graph is not None:
                graph(operands, out)
                return
        conv_into(p, out)

    # ---------------------------------------------------------------------------- with a layer norm
    def with_norm(self, body, out: torch.Tensor, norm: NormAfter) -> bool:
        """The body and the layer norm that reads its result, as one kernel: each row of the
        result computed, stored where `norm.store` says others read it, then normalised into
        `norm.out`. The body is elementwise (`pairs.norm_pairs` pairs no other). False, with nothing
        written, where the tensors do not fit (see `NormAfter`)."""
        if not norm.fits(out):
            return False
        operands = pointwise_operands(body, skip_first=False)
        key = ("norm", tuple(out.shape), out.dtype, norm.store, norm.weight is not None, norm.bias is not None,
               layouts(*operands))
        return self.launch(key, lambda: generated.norm_launcher(norm_source(body, out, operands, norm)), (out, operands, norm),
                           " with its layer norm")
