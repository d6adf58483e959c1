"""What a fused op runs where its load pairs it with the op before it (`runtime/pairs/`): the
depthwise convolution that applies its producer's epilogue as it loads each tap (a prologue pair:
the producer writes its convolution bare), and the 1x1 convolution that computes the elementwise
op before it as it loads its input (an input pair: that op defers its call). `FusedKernel` takes
these from `OnLoad`; the fresh kernels of one tuning candidate (`FusedKernel.lowered`) say which
pair each op is in."""

from __future__ import annotations

import torch

from ...ops import fusion
from ...ops.interpret import run_fused
from ..base import settings, timing
from . import depthwise_conv, generated, pointwise_conv, recall
from .codegen import body_signature, layouts, pointwise_operands
from .convolution import writes


class OnLoad:
    """The pair runners of `FusedKernel` (a mixin: they call its `_run`, `_direct`, `operands`
    and `_convolution`)."""

    # ---------------------------------------------------------------------------- a producer's epilogue on load
    def _bare(self, body, out: torch.Tensor) -> list | None:
        """This op's convolution alone, without its bias, into `out`; `body`, or None with nothing
        run where the convolution does not compute `out` (the op then runs whole)."""
        conv = fusion.conv_params(body[0][0], body[0][1]) if fusion.leads_with_convolution(self.body) else None
        if conv is None or not writes(conv, out):
            return None
        self._convolution(conv, out)
        return body

    def _after_bare(self, body, out: torch.Tensor, producer: OnLoad) -> torch.Tensor:
        """This depthwise body over its input as `producer` left it (its bare convolution): as one
        kernel that applies the producer's epilogue to each tap it loads
        (`depthwise_conv.Prologue`, `_direct`); where that kernel does not fit or build, the
        epilogue interpreted into a buffer of its own first (counted once in `generated.STATS.fallbacks`),
        then this body as it runs otherwise."""
        before_operands, before_conv = producer.operands(producer.wrote_bare)
        before = depthwise_conv.Prologue(producer.wrote_bare, tuple(before_operands),
                                         before_conv is not None and before_conv["bias"] is not None)
        key = (layouts(out, producer.bare_out), before.signature())
        if self._prologue_chosen.get(key) is False:
            return self._whole_before(body, out, producer)
        if self._direct(body, out, before) is not None:
            if key not in self._prologue_chosen and not torch.cuda.is_current_stream_capturing():
                self._prologue_chosen[key] = self._prologue_kept(key, body, out, producer, before)
                if not self._prologue_chosen[key]:
                    return self._whole_before(body, out, producer)
            return out
        if "interpreted before" not in self._noted:
            self._noted.add("interpreted before")
            generated.STATS.fallbacks.append(f"op {self.op.id}: its input's epilogue interpreted before it")
        bare = body[0][1][0]
        first = ("aten::add.Tensor", (bare, before.operands[-1]), ()) if before.bias \
            else ("aten::alias.default", (bare,), ())
        activated = run_fused([first, *producer.wrote_bare[1:]])
        body = [(body[0][0], (activated, *body[0][1][1:]), body[0][2]), *body[1:]]
        got = self._run(body, out)
        if got is None:
            out.copy_(run_fused(body))
        return out

    def _prologue_kept(self, key: tuple, body, out: torch.Tensor, producer: OnLoad, before) -> bool:
        """Whether this pair runs as one: as an earlier load kept it (`recall`), else measured
        (`_pair_faster`) and kept. `key` names the producer's side; the kept choice's key adds
        this op's filter, operands and body."""
        operands, conv = self.operands(body)
        setting = (key, layouts(conv["weight"], *operands), body_signature(body, operands),
                   settings.current().prologue_slower)
        kept = (recall.recalled("prologue", setting, out.device) or {}).get("paired")
        if isinstance(kept, bool):
            return kept
        paired = self._pair_faster(body, out, producer, before)
        recall.keep("prologue", setting, out.device, {"paired": paired})
        return paired

    def _pair_faster(self, body, out: torch.Tensor, producer: OnLoad, before) -> bool:
        """Whether the producer's bare convolution and this kernel with its epilogue on load take
        at most the `prologue_slower` setting times the producer run whole and this body after
        it, both timed in a CUDA graph (`timing.graph_us`): depthwise prologues apply the epilogue
        once per tap, which does not always pay (mobilenet_v2 at batch 1 ran 3.2 % slower with all
        of them)."""
        wrote, into = producer.wrote_bare, producer.bare_out

        def paired() -> None:
            producer._bare(wrote, into)
            self._direct(body, out, before)
        with timing.on_stream(out.device):
            mine = timing.graph_us(paired, out.device)
            theirs = timing.graph_us(lambda: self._whole_before(body, out, producer, switch=False), out.device)
            paired()  # this call's result, as the pair computes it
        return mine <= settings.current().prologue_slower * theirs

    def _whole_before(self, body, out: torch.Tensor, producer: OnLoad, switch: bool = True) -> torch.Tensor:
        """The producer run whole into the buffer it wrote bare, then this body (`_after`); with
        `switch`, the producer runs whole from its next call on."""
        self._after(body, out, producer, producer.wrote_bare, producer.bare_out)
        if switch:
            producer.bare, producer.wrote_bare = False, None
        return out

    # ---------------------------------------------------------------------------- an elementwise input on load
    def _with_input(self, body, out: torch.Tensor, producer: OnLoad) -> torch.Tensor:
        """This 1x1 convolution's body over the result of `producer`, an elementwise op that
        deferred its call: as one kernel that applies the producer's body to each block of the
        input it loads (`pointwise_conv`), where that fits and was measured faster; else the
        producer's call first, into its own buffer, then this body as it runs otherwise."""
        before_body, before_out = producer.deferred_call
        operands, conv = self.operands(body)
        before = None
        if conv is not None:
            pieces = tuple(before_body[0][1][0]) if fusion.leads_with_concat(producer.body) else ()
            before = pointwise_conv.Before(tuple(before_body), before_out, pieces,
                                           tuple(pointwise_operands(before_body, skip_first=bool(pieces))))
        if before is None or not pointwise_conv.fits(conv, out, before):
            return self._apart(body, out, producer)
        if not self._pointwise_chosen(body, out, operands, conv, before, lambda: self._apart(body, out, producer),
                                      " with its input's elementwise op"):
            return self._apart(body, out, producer)
        return out

    def _apart(self, body, out: torch.Tensor, producer: OnLoad) -> torch.Tensor:
        """`producer`'s deferred call run into its buffer, then this body (`_after`)."""
        return self._after(body, out, producer, *producer.deferred_call)

    def _after(self, body, out: torch.Tensor, producer: OnLoad, first_body, first_out) -> torch.Tensor:
        """`producer` run on `first_body` into `first_out` (interpreted where no kernel takes it),
        then this body over the tensor that holds its result, as it runs otherwise, into `out`."""
        got = producer._run(first_body, first_out)
        if got is None:
            first_out.copy_(run_fused(list(first_body)))
            got = first_out
        body = [(body[0][0], (got, *body[0][1][1:]), body[0][2]), *body[1:]]
        return self._into(body, out, self._run(body, out))

    @staticmethod
    def _into(body, out: torch.Tensor, got: torch.Tensor | None) -> torch.Tensor:
        """`out` holding what a way of running `body` returned: `got` copied in where it lies
        elsewhere (cuDNN's fused kernels allocate), the body interpreted where it returned None."""
        if got is None:
            out.copy_(run_fused(body))
        elif got is not out:
            out.copy_(got)
        return out
