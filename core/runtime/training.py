"""Training on captured graphs: the forward on the planned streams and its backward, each one
CUDA graph, bound to a live module's own parameters, buffers and `.grad` tensors.

The forward issues the training-mode op list (see `pipeline.compile_training`) with autograd on,
each op on its planned stream with the planned event waits. Autograd records each op's stream,
and runs its backward op on that stream, so the backward capture inherits the forward's streams.
Activations come from the private memory pool the two graphs share: autograd keeps the saved ones
alive until the backward, so the inference arena plan does not apply.

A call copies the inputs into static buffers and replays the forward graph; `loss.backward()`
copies the incoming gradients into static buffers and replays the backward graph, which adds the
parameter gradients into static `.grad` tensors bound to the module's parameters. Batch norm
updates its running statistics inside the forward graph, and random ops (dropout) draw fresh
numbers on every replay: the default CUDA generator is graph-safe.

Without CUDA, a call issues the same op list serially with autograd, so the same API works (and
is tested) on the CPU.
"""

from __future__ import annotations

import torch

from ..errors import ExecutionError, ModelError, first_line
from ..ir import WEIGHT, Graph
from ..ops import arguments, targets, types
from ..ops.execute import Executor, run_ops
from ..plan.schedule import Schedule
from .base import streams

_WARMUP_STEPS = 2


class _Replay(torch.autograd.Function):
    """Autograd's view of one captured step: forward replays one graph, backward the other."""

    @staticmethod
    def forward(ctx, runner: TrainingGraph, anchor: torch.Tensor):
        runner.fwd_graph.replay()
        ctx.runner = runner
        outs = tuple(o.clone() for o in runner.static_outputs)  # user-owned, like an eager result
        ctx.mark_non_differentiable(*[o for o, d in zip(outs, runner.differentiable) if not d])
        return outs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        ctx.runner.backward([g for g, d in zip(grads, ctx.runner.differentiable) if d])
        return None, None


class TrainingGraph:
    """One training-mode forward of `graph` over `module`'s tensors, replayable with backward."""

    def __init__(self, module: torch.nn.Module, graph: Graph, constants: dict[str, torch.Tensor],
                 schedule: Schedule, device: torch.device, graph_dump: str | None = None):
        """`graph_dump`: a path prefix; the captured graphs are written as Graphviz DOT to
        `<prefix>forward.dot` and `<prefix>backward.dot` (for tests and debugging)."""
        self.graph, self.schedule, self.device = graph, schedule, device
        named = dict(module.named_parameters())
        named.update(module.named_buffers())
        self.bound: dict[int, torch.Tensor] = {}
        for v in graph.values:
            if v.kind == WEIGHT:
                t = named.get(v.name)
                self.bound[v.id] = t if t is not None else constants[v.name].to(device)
        self.params = _unique([t for t in self.bound.values()
                               if isinstance(t, torch.nn.Parameter) and t.requires_grad])
        if not self.params:
            raise ModelError("the module has no parameters that require grad; prepare it with "
                             "training=False for inference")
        self._fns = [targets.resolve(op.target, training=True) for op in graph.ops]
        self._order = list(schedule.order)
        self._streams: list[torch.cuda.Stream] = []  # none on the CPU: ops run serially
        stream_of = schedule.stream
        # reads of a tensor allocated on another stream: recorded, so the allocator never hands
        # its memory out again until the reading stream is done with it (forward and backward)
        self._cross = [[r for r in op.refs() if graph.values[graph.root(r)].producer is not None
                        and stream_of[graph.values[graph.root(r)].producer] != stream_of[op.id]]
                       for op in graph.ops]
        self.inputs = [torch.zeros(graph.values[i].spec.shape, dtype=types.DTYPES[graph.values[i].spec.dtype],
                                   device=device) for i in graph.inputs]
        self.fwd_graph = self.bwd_graph = None
        if device.type == "cuda":
            self._streams = [torch.cuda.Stream(device) for _ in range(schedule.num_streams)]
            self._warm_up()
            self._capture(graph_dump)

    # ------------------------------------------------------------------------------ issuing
    def _issue(self) -> list[torch.Tensor]:
        """The forward, with autograd, each op on its planned stream; returns the graph outputs."""
        env = dict(self.bound)
        env.update(zip(self.graph.inputs, self.inputs))
        sched = self.schedule
        run_ops(self.graph.ops, _Forward(self, env), self._order,
                lambda order, step: streams.issue(order, step, self.device, self._streams, sched.stream, sched.waits))
        return [env[o] for o in self.graph.outputs]

    def _grads(self, outputs: list[torch.Tensor], grad_outputs: list[torch.Tensor]):
        return torch.autograd.grad(outputs, self.params, grad_outputs, allow_unused=True)

    # ------------------------------------------------------------------------------ capture
    def _warm_up(self) -> None:
        """Eager steps on the planned streams (creating each stream's library handles and the
        autograd engine's device thread), leaving the module's buffers and the RNG as they were."""
        buffers = _unique([t for t in self.bound.values() if not isinstance(t, torch.nn.Parameter)])
        saved = [b.clone() for b in buffers]
        with torch.random.fork_rng(devices=[self.device]):
            for _ in range(_WARMUP_STEPS):
                outs = [o for o in self._issue() if o.requires_grad]
                if not outs:
                    raise ModelError("no output of the module depends on a parameter that requires grad; "
                                     "prepare it with training=False for inference")
                self._grads(outs, [torch.ones_like(o) for o in outs])
        torch.cuda.synchronize(self.device)
        with torch.no_grad():
            for b, s in zip(buffers, saved):
                b.copy_(s)

    def _capture(self, dump: str | None) -> None:
        pool = torch.cuda.graph_pool_handle()
        what, advice = "the training step", "try streams=1, or train the module without nimble"
        fwd, bwd = streams.new_graph(bool(dump)), streams.new_graph(bool(dump))
        with streams.capturing(fwd, self._streams[0], self.device, what, advice, pool):
            outputs = self._issue()
        self.differentiable = [o.requires_grad for o in outputs]
        diff = [o for o in outputs if o.requires_grad]
        self.grad_outputs = [torch.zeros_like(o) for o in diff]
        self.grad_buffers = [torch.zeros_like(p) for p in self.params]
        with streams.capturing(bwd, self._streams[0], self.device, what, advice, pool):
            # every stream joins the capture before autograd runs: without this, autograd's
            # cross-stream syncs invalidate it (seen on torch 2.11)
            with streams.forked(self._streams, self.device):
                grads = self._grads(diff, self.grad_outputs)
            pairs = [(b, g) for b, g in zip(self.grad_buffers, grads) if g is not None]
            torch._foreach_add_([b for b, _ in pairs], [g for _, g in pairs])
        torch.cuda.synchronize(self.device)
        if dump:
            streams.write_dot(fwd, f"{dump}forward.dot")
            streams.write_dot(bwd, f"{dump}backward.dot")
        self.with_grad = [(p, b) for p, b, g in zip(self.params, self.grad_buffers, grads) if g is not None]
        self.static_outputs = [o.detach() for o in outputs]
        self.fwd_graph, self.bwd_graph = fwd, bwd
        self._anchor = torch.empty(0, device=self.device, requires_grad=True)

    # ------------------------------------------------------------------------------ calls
    def __call__(self, inputs) -> list[torch.Tensor]:
        for buf, x in zip(self.inputs, inputs):
            buf.copy_(x, non_blocking=True)
        if self.fwd_graph is None:
            return self._issue()
        return list(_Replay.apply(self, self._anchor))

    def backward(self, grads) -> None:
        """Replay the backward for these output gradients, adding into the parameters' `.grad`."""
        for buf, g in zip(self.grad_outputs, grads):
            if g is None:
                buf.zero_()
            else:
                buf.copy_(g)
        fresh = []
        for p, buf in self.with_grad:
            g = p.grad
            if g is buf:
                continue
            if g is None:
                fresh.append(buf)
            else:
                buf.copy_(g)  # a .grad the user set: carry its value into the bound tensor
            p.grad = buf
        if fresh:
            torch._foreach_zero_(fresh)
        self.bwd_graph.replay()


def _unique(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    seen, out = set(), []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


class _Forward(Executor):
    """The training forward, op by op with autograd. On CUDA, a tensor read on a stream other than
    the one that made it is recorded there, so the allocator never hands its memory out again
    until that stream is done with it (forward and backward)."""

    def __init__(self, runner: TrainingGraph, env: dict[int, torch.Tensor]):
        self.runner, self.env = runner, env

    def arguments(self, op):
        return arguments.op_arguments(op, self.env, self.runner.device)

    def call(self, op, args, kwargs):
        return arguments.flatten_result(self.runner._fns[op.id](*args, **kwargs))

    def bind(self, op, results):
        self.env.update(zip(op.outputs, results))
        if self.runner.device.type == "cuda":
            stream = torch.cuda.current_stream(self.runner.device)
            for r in self.runner._cross[op.id]:
                self.env[r].record_stream(stream)

    def failed(self, op, error):
        return ExecutionError(f"op {op.id} ({op.target}, from {op.source}) fails on {self.runner.device} in "
                              f"training mode: {first_line(error)}")
