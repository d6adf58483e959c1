"""The fused-body interpreter (beside the fusion rules, `fusion.py`): a body run node by node with
its aten overloads, on any device. The CPU, `--check` and the CUDA fallback all run it."""

from __future__ import annotations

import torch

from ..ir import Local
from . import shapes
from .targets import resolve


def run_fused(body) -> torch.Tensor:
    """A fused op's body (`ops/fusion.py`), interpreted node by node with its aten overloads.
    `body` is as `to_torch` gives it: its Refs are tensors already, its Locals still Locals. On
    the meta device, nodes with a shape rule are typed by it."""
    results: list[torch.Tensor] = []

    def local(a):
        if isinstance(a, Local):
            return results[a.index]
        return [local(x) for x in a] if isinstance(a, list) else a

    for target, args, kwargs in body:
        args, kwargs = [local(a) for a in args], {k: local(v) for k, v in kwargs}
        found = None
        if any(isinstance(a, torch.Tensor) and a.is_meta for a in args):
            found = shapes.infer(target, args, kwargs)
        results.append(found[0] if found is not None else resolve(target)(*args, **kwargs))
    return results[-1]
