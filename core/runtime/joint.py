"""A training step's joint graph (forward, loss and backward as one graph: `frontend/joint.py`),
run on tensors bound to its inputs: the module's own parameters and buffers, read in place, and
the step's inputs.

The ops run in the schedule's order with no autograd: the backward is ops of the graph like any
other. On CUDA each op runs on its planned stream after the ops it waits for (`base/streams.issue`,
the rules inference follows), and `capture` records one such run, with whatever the caller does
after it (`after`), into a CUDA graph that `replay` then runs with no Python per op; elsewhere
they run one after another. Every activation an op can write in place (`placed/`: by its out=
overload), the saved ones the backward reads included, is written into its buffer of the memory
plan, in one arena allocated once. The results of the other ops (`loose`: convolution_backward
asked for two of its three results, batch norm's training forward, a fused op's body, an op whose
only out= overload is one torch generates, which computes, then copies: `copies`) are bound
as they are computed rather than copied into a buffer, which would cost a pass over memory each:
their memory comes from torch's allocator (in a captured step, the graph's own pool). A value
outside the arena is dropped once its last reader has run. The graph's outputs (loss, gradients,
new buffers) are arena buffers or such results, which the next call overwrites or replaces (a
captured step's replays overwrite them in place). `ready(op, results)`, where given, hears of
each op's results as they come: a data-parallel step starts the all-reduce of a bucket of
gradients while the rest of the backward runs (`train.py`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from ..errors import ExecutionError, first_line
from ..ir import ACTIVATION, WEIGHT, Graph, contiguous_strides, dense_layout
from ..ops import add_norm, casts, fusion, norm_act, scatters, targets
from ..ops.arguments import flatten_result, masked, op_arguments, output_mask, to_torch
from ..ops.execute import run_ops
from ..ops.interpret import run_fused
from ..plan.memory import MemoryPlan
from ..plan.schedule import Schedule
from .assemble.choice import UNMARKED_VIEWS, channels_last_values, viewed
from .base import streams
from .kernels import batch_norm, reductions, step_attention, step_norms
from .kernels.cudnn_graph import Workspaces
from .kernels.fused import FusedKernel
from .placed import substitutes
from .placed.placement import (LAYOUT_BOUND, SAME_STRIDES_OUT, STRIDES_IGNORED, PlacedOp, arena_views, copies,
                               out_overload)
from .placed.run import PlacedRun


class JointRunner:
    def __init__(self, graph: Graph, schedule: Schedule, memory: MemoryPlan, weights: dict[str, torch.Tensor],
                 device: torch.device, placed: list[PlacedOp], unplanned: frozenset[int],
                 workspaces: Workspaces | None = None, channels_last: bool = False):
        """`weights`: the graph's constants (tensors the model builds in its forward); `placed`:
        `placed_ops(graph, device, workspaces)`; `unplanned`: `loose(graph, placed)`, the values
        the memory plan left out. `channels_last`: the planned 4-D buffers that no view shares
        (`assemble.choice.channels_last_values`, as inference's layout choice) get channels_last
        strides over their bytes; the ops that write them follow, and the results bound as
        computed follow their inputs."""
        self.workspaces = workspaces
        self.graph, self.order, self.device, self.schedule = graph, list(schedule.order), device, schedule
        self.streams = [torch.cuda.Stream(device) for _ in range(schedule.num_streams)] if device.type == "cuda" else []
        self.captured: torch.cuda.CUDAGraph | None = None
        self.placed, self.unplanned = placed, unplanned
        self.arena = torch.empty(memory.arena_bytes, dtype=torch.uint8, device=device)
        self.views = arena_views(graph, memory, self.arena,
                                 channels_last_values(graph, SAME_STRIDES, by_use=True) if channels_last else ())
        self.release = streams.release_plan(graph, self.order, schedule.stream, schedule.waits)
        self._constants = {vid: weights[v.name].to(device) for vid, v in enumerate(graph.values) if v.kind == WEIGHT}

    def __call__(self, inputs: list[torch.Tensor], ready: Callable[[int, list[torch.Tensor]], None] | None = None,
                 after: Callable[[list[torch.Tensor]], None] | None = None) -> list[torch.Tensor]:
        """The graph's outputs for these inputs (bound as they are, never copied): views of the
        arena, which the next call overwrites. `after(outputs)`, where given, runs once the ops
        are issued."""
        env = dict(self._constants)
        env.update(zip(self.graph.inputs, inputs))
        kept = frozenset(t.untyped_storage().data_ptr() for t in [self.arena, *env.values()])
        with torch.no_grad():
            run_ops(self.placed, _Step(env, self.views, self.device, self.release, kept, ready, self.arena,
                                       self.unplanned), self.order,
                    self._place if self.streams else None)
            outputs = [env[o] for o in self.graph.outputs]
            if after is not None:
                after(outputs)
        return outputs

    def _place(self, order, step) -> None:
        s = self.schedule
        streams.issue(order, step, self.device, self.streams, s.stream, s.waits)

    def capture(self, inputs: list[torch.Tensor], ready=None, after=None) -> list[torch.Tensor]:
        """Record a call (as `__call__`, which must have run eagerly once before, creating each
        stream's library handles) into a CUDA graph without running it: the outputs it returns are
        the tensors every `replay` writes, and `inputs` must keep their storage (a caller copies
        new data into them)."""
        if self.workspaces is not None:  # grown to full size by the eager call: one allocation of their own
            self.workspaces.settle(self.device)
        graph = streams.new_graph()
        with streams.capturing(graph, self.streams[0], self.device, "the training step",
                               "prepare the step with cuda_graphs=False"):
            outputs = self(inputs, ready, after)
        self.captured = graph
        return outputs

    def replay(self) -> None:
        self.captured.replay()


def placed_ops(graph: Graph, device: torch.device, workspaces: Workspaces | None = None) -> list[PlacedOp]:
    """Each op of `graph` resolved once, for `device`; on CUDA the generated kernels share
    `workspaces` (one cuDNN workspace per stream, as a loaded executable's kernels do: the ops of
    a stream run one after another)."""
    placed = [_placed(op, device.type == "cuda") for op in graph.ops]
    if device.type == "cuda":  # attention by cuDNN's kernels (or flash's) where they take it
        for op_id, pair in step_attention.pairs(graph).items():
            p = placed[op_id]
            placed[op_id] = replace(p, fn=pair.forward if p.op.target == step_attention.EFFICIENT else pair.backward)
    for p in placed:
        if isinstance(p.substitute, FusedKernel) and workspaces is not None:
            p.substitute.workspaces = workspaces
    # a result bound as computed takes its inputs' layout (channels_last in such a step); one that
    # a view reshapes is given the strides the trace gave it, where it is computed and its own do
    # not take every view of it (a view of a channels_last map to (N, C*H*W), as after VGG's
    # pooling, has no strides that fit; cuDNN's attention gradients, laid out as their inputs, do)
    shared, free = viewed(graph, SAME_STRIDES), loose(graph, placed)
    trees = _view_trees(graph)
    for k, p in enumerate(placed):
        traced = {i: (graph.values[v].spec, v, trees.get(v, ())) for i, v in enumerate(p.op.outputs)
                  if v in shared and v in free}
        if traced:
            placed[k] = replace(p, fn=_as_traced(p.fn, traced))
    return placed


def _as_traced(fn: Callable, traced: dict[int, tuple]) -> Callable:
    """`fn` with each result at a position of `traced` (its spec, value and `_view_trees` ops)
    copied into the strides of its spec (the trace's; contiguous where it gives none) where its
    own differ in a dimension longer than 1 and some view of it does not take them
    (`_views_hold`; decided once per geometry)."""
    held: dict[tuple, bool] = {}

    def run(*args, **kwargs):
        results = flatten_result(fn(*args, **kwargs))
        for k, (spec, value, views) in traced.items():
            t = results[k]
            strides = spec.strides or contiguous_strides(spec.shape)
            if isinstance(t, torch.Tensor) and any(n > 1 and a != b for n, a, b in zip(t.shape, t.stride(), strides)):
                key = (k, tuple(t.shape), tuple(t.stride()))
                if key not in held:
                    held[key] = _views_hold(t, value, views)
                if not held[key]:
                    results[k] = torch.empty_strided(t.shape, strides, dtype=t.dtype, device=t.device).copy_(t)
        return results
    run.__wrapped__ = fn  # `inspect.unwrap` finds the op's own function
    return run


# views whose result is a function of their input's elements alone, not of its strides: where each
# view of a result bound as computed is one of these and takes its strides, they need not be the
# trace's (as_strided, say, reads the strides themselves: its input keeps the trace's)
LOGICAL_VIEWS = frozenset(f"aten::{name}" for name in (
    "view.default", "_unsafe_view.default", "permute.default", "transpose.int", "t.default",
    "select.int", "slice.Tensor", "narrow.default", "unsqueeze.default", "squeeze.dim", "squeeze.dims",
    "squeeze.default", "expand.default", "detach.default", "alias.default", "unflatten.int", "flatten.using_ints",
    "split.Tensor", "split_with_sizes.default", "unbind.int", "chunk.default", "diagonal.default"))


def _view_trees(graph: Graph) -> dict[int, tuple]:
    """Root value -> the ops, in graph order, that make its views (and views of those), and the
    views by an op of UNMARKED_VIEWS of it or of them."""
    trees: dict[int, list] = {}
    for op in graph.ops:
        roots = {graph.root(r) for r in op.refs()}
        made = [graph.values[o].alias_of for o in op.outputs if graph.values[o].alias_of is not None]
        for root in set(made) | (roots if op.target in UNMARKED_VIEWS else set()):
            trees.setdefault(root, []).append(op)
    return {root: tuple(ops) for root, ops in trees.items()}


def _views_hold(t: torch.Tensor, value: int, views: tuple) -> bool:
    """Whether every op of `views` (`_view_trees`' for `value`) is a view of LOGICAL_VIEWS that
    takes its input as laid out when `value` has `t`'s strides: tried on the meta device."""
    meta = torch.device("meta")
    env = {value: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=meta)}
    for op in views:
        if op.target not in LOGICAL_VIEWS:
            return False
        try:
            args, kwargs = op_arguments(op, env, meta)
            env.update(zip(op.outputs, flatten_result(targets.resolve(op.target, training=True)(*args, **kwargs))))
        except Exception:  # noqa: BLE001 (a view these strides do not take, or a tensor from outside the tree)
            return False
    return True


# views that keep their input's strides: a value they share may still be laid out channels_last
# (the backward reads relu's result through a detach)
SAME_STRIDES = frozenset({"aten::detach.default", "aten::alias.default"})


def loose(graph: Graph, placed: list[PlacedOp]) -> frozenset[int]:
    """The activations the runtime binds as computed, with no buffer of the memory plan: every
    result of an op with neither an out= overload nor a kernel of nimble's (`placed_ops`) that
    owns its storage (views of other values have no buffer of their own anyway), but for ops
    that may return their input itself or a view of it (`reshape`, `contiguous`: their schema
    marks it; `UNMARKED_VIEWS`): bound as returned, such a result would hold an arena buffer past
    the end the plan gave it, so it is copied into a buffer of its own."""
    found = set()
    for p in placed:
        schema = getattr(p.fn, "_schema", None)  # a fused op's body (`run_fused`) has none: its ops compute
        if p.out_fn is None and p.substitute is None and p.op.target not in UNMARKED_VIEWS \
                and not (schema is not None and any(r.alias_info is not None for r in schema.returns)):
            found.update(v for v in p.op.outputs if graph.values[v].kind == ACTIVATION
                         and graph.values[v].alias_of is None)
    return frozenset(found)


def _placed(op, cuda: bool) -> PlacedOp:
    """`op` to run into its planned buffer: by its out= overload where it has one that gives
    every result it was asked for (`convolution_backward` asked for two of its three has none that
    fits), else computed and bound as it is (`loose`). A fused op runs on CUDA as inference's
    generated kernel (`kernels/fused.FusedKernel`) into its buffer, elsewhere its body op by op,
    bound as computed. Batch norm with its activation, each way, writes its buffers through
    `kernels/batch_norm` (aten's ops and copies where its kernels do not run); layer norm and its
    backward (every gradient asked for), alone or with an add (`ops/add_norm`), through
    `kernels/step_norms` on CUDA; a group of casts (`ops/casts`) into its buffers by
    `cast_group_into`, and slices' gradients (`ops/scatters`) into theirs by `slice_sum_into`, on
    any device. (The rare step whose gradients leave eager's by 1e-4 to 1e-2
    comes with them and without, on one stream too: a kink's flip, `tools/train_step_drift.py
    --smooth`.)"""
    if op.target == fusion.FUSED:
        return PlacedOp(op, run_fused, None, [], FusedKernel(op) if cuda else None)
    if op.target == norm_act.NORM_ACT:
        return PlacedOp(op, norm_act.forward, batch_norm.forward_into, list(NORM_ACT_OUTPUTS), None)
    if op.target == norm_act.NORM_ACT_BACKWARD:
        return PlacedOp(op, norm_act.backward, batch_norm.backward_into, list(NORM_ACT_BACKWARD_OUTPUTS), None)
    if op.target in add_norm.FUNCTIONS:  # elsewhere bound as computed
        return PlacedOp(op, add_norm.FUNCTIONS[op.target], step_norms.OUT_FUNCTIONS[op.target] if cuda else None,
                        list(step_norms.OUT_NAMES[op.target]) if cuda else [], None)
    if op.target == casts.CAST_GROUP:
        return PlacedOp(op, casts.cast_group, cast_group_into, [f"out{k}" for k in range(len(op.outputs))], None)
    if op.target == scatters.SLICE_SUM:
        return PlacedOp(op, scatters.slice_sum, slice_sum_into, ["out"], None)
    fn = targets.resolve(op.target, training=True)
    mask = output_mask(fn._schema, list(op.args))
    if mask is not None and not all(mask):  # as the frontend typed it: the left-out results are None
        return PlacedOp(op, lambda *args, **kwargs: masked(fn._schema, list(args), flatten_result(fn(*args, **kwargs),
                                                                                                 True)),
                        None, [], None)
    if cuda and op.target in step_norms.OUT_FUNCTIONS and len(op.outputs) == len(step_norms.OUT_NAMES[op.target]):
        return PlacedOp(op, fn, step_norms.OUT_FUNCTIONS[op.target], list(step_norms.OUT_NAMES[op.target]), None)
    found = out_overload(op.target, training=True)
    if found is not None and (len(found[1]) != len(op.outputs) or copies(found[0])
                              or op.target in STRIDES_IGNORED):
        found = None
    substitute = SUBSTITUTES.get(op.target)
    if found is not None and op.target in LAYOUT_BOUND and len(op.outputs) == 1:
        substitute = _LayoutBound(fn, op.kwargs, LAYOUT_BOUND[op.target] == SAME_STRIDES_OUT)
    return PlacedOp(op, fn, found[0] if found else None, list(found[1]) if found else [], substitute)


def cast_group_into(tensors, dtype: torch.dtype, **buffers) -> tuple[torch.Tensor, ...]:
    """`ops/casts.cast_group` into its buffers (`out0`, `out1`, ...; of `dtype`): the pairs whose
    source and buffer are dense with the same strides, per source dtype, in one
    `torch._foreach_copy_`, which copies a few dozen tensors a kernel on CUDA (a weight's gradient
    and its float32 buffer keep the trace's strides, both through the transpose a linear's backward
    leaves); any other pair by a copy of its own, as the cast ran alone."""
    outs = [buffers[f"out{k}"] for k in range(len(tensors))]
    twins: dict[torch.dtype, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for src, dst in zip(tensors, outs):
        if src.shape == dst.shape and src.stride() == dst.stride() and src.device == dst.device \
                and dense_layout(dst.shape, dst.stride()):
            twins.setdefault(src.dtype, []).append((src, dst))
        else:
            dst.copy_(src)
    for pairs in twins.values():
        torch._foreach_copy_([d for _, d in pairs], [s for s, _ in pairs])
    return tuple(outs)


def slice_sum_into(pieces, slices, sizes, covers: bool, out: torch.Tensor) -> torch.Tensor:
    """`ops/scatters.slice_sum` into its buffer: each piece copied into its place, after zeros where
    the pieces leave some of it out (they never share an element)."""
    return scatters.copied_in(out if covers else out.zero_(), pieces, slices)


class _LayoutBound:
    """The substitute of an op of `LAYOUT_BOUND`: none (its out= overload runs) where its buffer is one
    that overload writes right (contiguous; or, `same`, of its tensor inputs' strides), else the
    op computed and copied in."""

    def __init__(self, fn, kwargs, same: bool):
        # their keyword arguments are numbers, strings and dtypes (GELU's `approximate`): no tensor or device
        self.fn, self.same = fn, same
        self.kwargs = {k: to_torch(v, {}, torch.device("cpu")) for k, v in kwargs}

    def __call__(self, args, out: torch.Tensor) -> torch.Tensor | None:
        if out.is_contiguous() or self.same and all(t.stride() == out.stride() for t in args
                                                    if isinstance(t, torch.Tensor) and t.shape == out.shape):
            return None
        return out.copy_(self.fn(*args, **self.kwargs))


# the out= names of batch norm with its activation (`ops/norm_act.py`), which `kernels/batch_norm` writes
NORM_ACT_OUTPUTS = ("y", "mean", "rstd", "new_mean", "new_var")
NORM_ACT_BACKWARD_OUTPUTS = ("dx", "dweight", "dbias")

# ops whose out= overload computes, then copies (`copies`), but that write a given buffer another
# way: relu by clamp_min's out= kernel, a cast or clone by one copy into it, a roll by one generated
# kernel (`placed/substitutes`); and a sum over leading dimensions (a bias's gradient) by a generated
# kernel (`kernels/reductions`)
SUBSTITUTES = {**{t: substitutes.SUBSTITUTES[t] for t in ("aten::relu.default", "aten::_to_copy.default",
                                                          "aten::roll.default")},
               "aten::clone.default": substitutes.copy, "aten::sum.dim_IntList": reductions.leading_sum}


class _Step(PlacedRun):
    """A placed run that reports each op's results (`ready`) and names a failing op as a
    training step's."""

    def __init__(self, env, views, device, release, kept, ready, arena, unplanned):
        super().__init__(env, views, device, release=release, kept=kept)
        self.ready, self.arena, self.unplanned = ready, arena.untyped_storage().data_ptr(), unplanned

    def call(self, p: PlacedOp, args, kwargs) -> list[torch.Tensor]:
        results = super().call(p, args, kwargs)
        # a result bound as computed must own its memory: one inside the arena (an op that
        # returned a view of its input after all) would outlive its bytes' plan
        return [t.clone() if v in self.unplanned and isinstance(t, torch.Tensor) and t.numel()
                and t.untyped_storage().data_ptr() == self.arena else t for v, t in zip(p.op.outputs, results)]

    def bind(self, p: PlacedOp, results) -> None:
        if self.ready is not None:
            self.ready(p.op.id, results)
        super().bind(p, results)

    def failed(self, p: PlacedOp, error):
        return ExecutionError(f"op {p.op.id} ({p.op.target}, from {p.op.source}) fails on {self.device} in the "
                              f"training step: {first_line(error)}")
