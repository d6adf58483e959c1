"""The reference executor: the op list run serially, one aten call per op, on any device.

This is the ground truth every faster runtime is compared against, and the CPU fallback.
"""

from __future__ import annotations

import contextlib

import torch

from ...errors import ExecutionError, ShapeError, first_line
from ...ir import WEIGHT, Graph
from ...ops import arguments, interpret, types
from ...ops.execute import Executor, run_ops


def run(graph: Graph, weights: dict[str, torch.Tensor], inputs: list[torch.Tensor],
        device: str | torch.device = "cpu") -> list[torch.Tensor]:
    """Run `graph` on `inputs` and return its outputs, in graph order."""
    tensors = run_values(graph, weights, inputs, device)
    return [tensors[o] for o in graph.outputs]


def run_values(graph: Graph, weights: dict[str, torch.Tensor], inputs: list[torch.Tensor],
               device: str | torch.device = "cpu", training: bool = False) -> dict[int, torch.Tensor]:
    """Run `graph` on `inputs` and return every value's tensor, by value id. `training`: a training
    step's joint graph (`TrainStep.graph`), whose ops come from the training list."""
    device = torch.device(device)
    tensors = bind(graph, weights, inputs, device)
    with torch.no_grad():
        run_ops(graph.ops, _Serial(tensors, device, training))
    return tensors


class _Serial(Executor):
    """One aten call per op, on `device`."""

    def __init__(self, tensors: dict[int, torch.Tensor], device: torch.device, training: bool = False):
        self.tensors, self.device, self.training = tensors, device, training

    def arguments(self, op):
        return arguments.op_arguments(op, self.tensors, self.device)

    def call(self, op, args, kwargs):
        return arguments.flatten_result(interpret.function_of(op.target, self.training)(*args, **kwargs))

    def bind(self, op, results):
        self.tensors.update(zip(op.outputs, results))

    def failed(self, op, error):
        return ExecutionError(f"op {op.id} ({op.target}, from {op.source}) fails on {self.device}: "
                              f"{first_line(error)}")


def bind(graph: Graph, weights: dict[str, torch.Tensor], inputs: list[torch.Tensor],
         device: torch.device) -> dict[int, torch.Tensor]:
    """Value id -> tensor for the graph's inputs and weights, checked against their specs."""
    if len(inputs) != len(graph.inputs):
        raise ShapeError(f"the model takes {len(graph.inputs)} input(s), got {len(inputs)}")
    tensors: dict[int, torch.Tensor] = {}
    for vid, t in zip(graph.inputs, inputs):
        v = graph.values[vid]
        if tuple(t.shape) != v.spec.shape or types.dtype_name(t.dtype) != v.spec.dtype:
            raise ShapeError(f"input '{v.name}' must be {v.spec.dtype}{list(v.spec.shape)}, "
                             f"got {types.dtype_name(t.dtype)}{list(t.shape)}")
        tensors[vid] = t.to(device)
    for v in graph.values:
        if v.kind == WEIGHT:
            tensors[v.id] = weights[v.name].to(device)
    return tensors


@contextlib.contextmanager
def one_thread():
    """Run the block on one CPU thread: reductions then add up in one order, so the sample outputs
    stored in an artifact, and so its bytes, do not depend on the machine's thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
