"""Issuing placed ops (`placement.prepare`) so that each writes its planned view (`arena_views`):
an op's substitute where it has one, else its out= overload, else computed and copied in. Views
and in-place results are bound as returned. `pairs/run.PairedRun` runs the load's pairs on top."""

from __future__ import annotations

import torch

from ...errors import ExecutionError, first_line
from ...ops import arguments
from ...ops.execute import Executor
from .indices import clamped
from .placement import PlacedOp


class PlacedRun(Executor):
    """One issue of the op list into `views` (value id -> planned tensor). With `name_failures`,
    an op that fails is named with its source line."""

    def __init__(self, env: dict[int, torch.Tensor], views: dict[int, torch.Tensor], device,
                 name_failures: bool = True, release: dict[int, list[int]] | None = None,
                 kept: frozenset[int] = frozenset()):
        """`release` (op -> values) drops each listed value once that op is issued, where its tensor
        lies outside the storages in `kept` (the arena, weights and inputs), so its memory goes
        back to the allocator."""
        self.env, self.views, self.device, self.name_failures = env, views, device, name_failures
        self.release, self.kept = release or {}, kept

    def arguments(self, p: PlacedOp):
        args, kwargs = arguments.op_arguments(p.op, self.env, self.device)
        if p.clamps and self.device.type == "cuda":  # computed indices: out of range would trip a device-side assert
            args = clamped(args, p.clamps)
        return args, kwargs

    def call(self, p: PlacedOp, args, kwargs) -> list[torch.Tensor]:
        planned = [self.views.get(o) for o in p.op.outputs]
        if planned and all(t is not None for t in planned):
            got = p.substitute(args, planned[0]) if p.substitute is not None and len(planned) == 1 else None
            if got is not None:
                return [got]
            if p.out_fn is not None:
                p.out_fn(*args, **kwargs, **dict(zip(p.out_names, planned)))
                return planned
        if p.writer is not None and len(planned) == 1 and planned[0] is not None \
                and self.by_writer(p, args, planned[0]):
            return planned
        results = arguments.flatten_result(p.fn(*args, **kwargs))
        if self.copied_in(p, results, planned):
            return planned
        for t, view in zip(results, planned):
            if view is not None:
                view.copy_(t)
        # a view or in-place result, or an output outside the arena, is bound as returned
        return [t if view is None else view for t, view in zip(results, planned)]

    def by_writer(self, p: PlacedOp, args, out: torch.Tensor) -> bool:
        """Whether `p`'s writer (generated attention) wrote its result into `out`."""
        return p.writer(args, out)

    def copied_in(self, p: PlacedOp, results: list, planned: list) -> bool:
        """Whether computed `results` reached their buffers some other way than a copy each (a
        pair's hook: here never)."""
        return False

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
