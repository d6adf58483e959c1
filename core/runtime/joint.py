"""A training step's joint graph (forward, loss and backward as one graph: `frontend/joint.py`),
run on tensors bound to its inputs: the module's own parameters and buffers, read in place, and
the step's inputs.

The ops run in the schedule's order, one after another on the current stream, with no autograd:
the backward is ops of the graph like any other. Each value is dropped once its last reader has
run, so what the step holds at any moment is what the graph still needs, as the memory plan
counts it. `ready(op, results)`, where given, hears of each op's results as they come: a
data-parallel step starts the all-reduce of a bucket of gradients while the rest of the backward
runs (`train.py`).
"""

from __future__ import annotations

from typing import Callable

import torch

from ..errors import ExecutionError, first_line
from ..ir import WEIGHT, Graph
from ..ops import arguments, fusion, targets
from ..ops.execute import Executor, run_ops
from ..ops.interpret import run_fused


class JointRunner:
    def __init__(self, graph: Graph, order: list[int], device: torch.device):
        self.graph, self.order, self.device = graph, list(order), device
        self._fns = [run_fused if op.target == fusion.FUSED else targets.resolve(op.target, training=True)
                     for op in graph.ops]
        outputs = set(graph.outputs)
        last: dict[int, int] = {}  # value id -> the position of the last op that reads it
        for position, i in enumerate(self.order):
            for r in graph.ops[i].refs():
                last[r] = position
        self._drop: list[list[int]] = [[] for _ in self.order]
        for position, i in enumerate(self.order):  # a result no op reads: dropped as it comes
            last.update({o: position for o in graph.ops[i].outputs if o not in last})
        for vid, position in last.items():
            if vid not in outputs and vid not in graph.inputs:
                self._drop[position].append(vid)
        self._weights: dict[str, torch.Tensor] = {}

    def __call__(self, inputs: list[torch.Tensor],
                 ready: Callable[[int, list[torch.Tensor]], None] | None = None) -> list[torch.Tensor]:
        """The graph's outputs for these inputs (bound as they are, never copied)."""
        env: dict[int, torch.Tensor] = {}
        for vid, v in enumerate(self.graph.values):
            if v.kind == WEIGHT:
                env[vid] = self._weights[v.name]
        env.update(zip(self.graph.inputs, inputs))
        with torch.no_grad():
            run_ops(self.graph.ops, _Step(self, env, ready), self.order)
        return [env[o] for o in self.graph.outputs]

    def bind_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """The graph's constants (tensors the model builds in its forward), on the step's device."""
        self._weights = {k: t.to(self.device) for k, t in weights.items()}


class _Step(Executor):
    def __init__(self, runner: JointRunner, env: dict[int, torch.Tensor], ready):
        self.runner, self.env, self.ready = runner, env, ready
        self.position = {i: k for k, i in enumerate(runner.order)}

    def arguments(self, op):
        return arguments.op_arguments(op, self.env, self.runner.device)

    def call(self, op, args, kwargs):
        return arguments.flatten_result(self.runner._fns[op.id](*args, **kwargs))

    def bind(self, op, results):
        self.env.update(zip(op.outputs, results))
        if self.ready is not None:
            self.ready(op.id, results)
        for vid in self.runner._drop[self.position[op.id]]:
            self.env.pop(vid, None)

    def failed(self, op, error):
        return ExecutionError(f"op {op.id} ({op.target}, from {op.source}) fails on {self.runner.device} in the "
                              f"training step: {first_line(error)}")
