"""The fused-body interpreter (beside the fusion rules, `fusion.py`): a body run node by node with
its aten overloads, on any device. The CPU, `--check` and the CUDA fallback all run it."""

from __future__ import annotations

import torch

from ..ir import Local
from . import shapes
from .execute import Executor, run_ops
from . import fusion
from .targets import resolve


def run_fused(body) -> torch.Tensor:
    """A fused op's body (`ops/fusion.py`), interpreted node by node with its aten overloads.
    `body` is as `to_torch` gives it: its Refs are tensors already, its Locals still Locals. On
    the meta device, nodes with a shape rule are typed by it."""
    executor = _Body()
    run_ops(body, executor)
    return executor.results[-1]


class _Body(Executor):
    def __init__(self):
        self.results: list[torch.Tensor] = []

    def _local(self, a):
        if isinstance(a, Local):
            return self.results[a.index]
        return [self._local(x) for x in a] if isinstance(a, list) else a

    def arguments(self, node):
        _, args, kwargs = node
        return [self._local(a) for a in args], {k: self._local(v) for k, v in kwargs}

    def call(self, node, args, kwargs):
        target = node[0]
        found = shapes.infer(target, args, kwargs) if any(_meta(a) for a in args) else None
        return [found[0] if found is not None
                else resolve(target, training=target in fusion.TRAINING_POINTWISE)(*args, **kwargs)]

    def bind(self, node, results):
        self.results.append(results[0])


def _meta(a) -> bool:
    """A meta tensor, or a list holding one (cat's tensors)."""
    if isinstance(a, list):
        return any(_meta(x) for x in a)
    return isinstance(a, torch.Tensor) and a.is_meta


def function_of(target: str, training: bool = False):
    """What runs an op of `target`: a fused op's interpreter (`run_fused`), else the allowlisted
    overload (`targets.resolve`; `training`: of a training graph)."""
    return run_fused if target == fusion.FUSED else resolve(target, training)
