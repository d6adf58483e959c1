"""Issuing placed ops with the load's pairs (`find`): before an op runs alone, the kinds whose
first op it is try to run it with its second (`norm`, `mean`, `product`, `scatter`); a writer or
a computed result goes through a copy pair's view (`copies`). A second op that its first's kernel
wrote is skipped."""

from __future__ import annotations

import torch

from ..placed.placement import PlacedOp
from ..placed.run import PlacedRun
from . import Pairs, copies, mean, norm, product, scatter


class PairedRun(PlacedRun):
    """`PlacedRun` with `pairs` (`Pairs`) run as one kernel each where the tensors fit, and as two
    ops where they do not."""

    def __init__(self, env: dict[int, torch.Tensor], views: dict[int, torch.Tensor], device,
                 name_failures: bool = True, release: dict[int, list[int]] | None = None,
                 kept: frozenset[int] = frozenset(), pairs: Pairs | None = None):
        super().__init__(env, views, device, name_failures, release, kept)
        self.pairs = pairs if pairs is not None else Pairs()
        self.written: set[int] = set()  # second ops their first's kernel has written

    def call(self, p: PlacedOp, args, kwargs) -> list[torch.Tensor]:
        planned = [self.views.get(o) for o in p.op.outputs]
        if p.op.id in self.written:
            self.written.discard(p.op.id)
            return planned
        if planned and all(t is not None for t in planned):
            found = self.pairs
            if p.op.id in found.norms and norm.run(self, p, args, kwargs, planned[0]):
                return planned
            if p.op.id in found.means:
                got = mean.run(self, p, args, planned[0])
                if got is not None:
                    return [got]
            if p.op.id in found.products and product.run(self, p, args, planned[0]):
                return planned
            if p.op.id in found.scatters and scatter.run(self, p, args, planned[0]):
                return planned
        return super().call(p, args, kwargs)

    def by_writer(self, p: PlacedOp, args, out: torch.Tensor) -> bool:
        if p.op.id in self.pairs.copies:
            return copies.by_writer(self, p, args, out)
        return p.writer(args, out)

    def copied_in(self, p: PlacedOp, results: list, planned: list) -> bool:
        return p.op.id in self.pairs.copies and len(results) == 1 and bool(planned) and planned[0] is not None \
            and copies.through_view(self, p, results[0])
