"""A loaded artifact of several batch sizes (`nimble compile --batch-sizes 1,2,4,8`).

One `Executable` per batch size, each with its own CUDA graph, input buffers and graph pool; they
share one copy of the weights and one arena, sized for the largest plan. The largest batch size
loads first and chooses, by tuning, how every batch size runs (layout, streams, algorithms,
convolution fusion): one choice keeps one weight layout and makes loading one tuning long. A call
with batch b runs the smallest compiled batch size of at least b: its inputs are padded with zero
rows and its outputs cut back to b rows (`compile` checked that each row's outputs come from that
row alone). The graphs replay one at a time on the caller's stream, so they can share the arena.
"""

from __future__ import annotations

import bisect
import time

import torch

from ..errors import ExecutionError, MismatchError, ShapeError, UsageError
from ..ops import batches, types
from .base import footprint
from .base.compare import compare, default_tolerance
from .executable import Executable
from .assemble.buffers import mib as _mib
from .loading import LoadStats, settle_footprint


class Batched:
    """A multi-batch artifact, loaded: call it as an `Executable` with any batch from 1 to the
    largest compiled; `executable(b)` is the one compiled for batch b exactly."""

    def __init__(self, artifact, device: str = "auto", *, name: str | None = None, tune: str = "cached",
                 max_memory: int | None = None, graph_dump: str | None = None, settings=None,
                 kernels: str | None = None, beside: str | None = None):
        """As `Executable`; `graph_dump` writes the largest batch size's graph."""
        t0 = time.perf_counter()
        self.artifact = artifact
        self.batch_sizes = artifact.batch_sizes
        self._name = name or artifact.model
        plans = {b: artifact.for_batch(b) for b in self.batch_sizes}
        arena = max(p.memory.arena_bytes for p in plans.values())
        weights = sum(t.numel() * t.element_size() for t in artifact.weights.values())
        inputs = sum(p.graph.values[i].spec.nbytes for p in plans.values() for i in p.graph.inputs)
        if max_memory is not None and weights + arena + inputs > max_memory:
            raise ExecutionError(f"{self._name} needs {_mib(weights + arena + inputs)} for its weights, arena and the "
                                 f"input buffers of its {len(plans)} batch sizes alone, above the memory budget of "
                                 f"{_mib(max_memory)}; nothing was allocated. Raise the budget, or compile fewer "
                                 "batch sizes")
        largest, *rest = sorted(self.batch_sizes, reverse=True)
        owner = Executable(plans[largest], device, name=self._name, tune=tune, arena_bytes=arena,
                           graph_dump=graph_dump, max_memory=max_memory, settings=settings, kernels=kernels,
                           beside=beside)
        self.device, self.notice = owner.device, owner.notice
        self._by_batch = {largest: owner}
        try:
            for b in rest:
                self._by_batch[b] = Executable(plans[b], self.device.type, name=f"{self._name} (batch {b})",
                                               choice=owner.choice if self.device.type == "cuda" else None,
                                               share=owner, settings=owner.settings, kernels=kernels, beside=beside)
        except BaseException:
            self.close()
            raise
        self.choice = owner.choice
        self.graph = self._by_batch[self.batch_sizes[0]].graph  # the artifact's top-level graph
        self._sizes = sorted(self._by_batch)
        self.stats: LoadStats = owner.stats
        seconds: dict[str, float] = {}
        for exe in self._by_batch.values():
            for key, secs in exe.stats.seconds.items():
                seconds[key] = seconds.get(key, 0.0) + secs
        self._mark = owner._mark  # None on the CPU; on CUDA, before anything was allocated
        self._closed = False
        if self.device.type == "cuda":
            settle_footprint(self, max_memory, "compile fewer batch sizes")
        self.stats.seconds = {**seconds, "total": time.perf_counter() - t0}

    # ------------------------------------------------------------------------------ the batch sizes
    def executable(self, batch: int) -> Executable:
        """The executable compiled for exactly `batch`."""
        if batch not in self._by_batch:
            raise UsageError(f"{self._name} holds no graph for batch {batch}; its batch sizes are "
                             f"{', '.join(map(str, self._sizes))}")
        return self._by_batch[batch]

    def executable_for(self, batch: int) -> Executable:
        """The smallest compiled batch size that holds `batch` rows."""
        k = bisect.bisect_left(self._sizes, batch)
        if batch < 1 or k == len(self._sizes):
            raise ShapeError(f"{self._name} runs batches of 1 to {self._sizes[-1]} rows (compiled for "
                             f"{', '.join(map(str, self._sizes))}), got {batch}; split the batch")
        return self._by_batch[self._sizes[k]]

    # ------------------------------------------------------------------------------ calls
    def __call__(self, *inputs: torch.Tensor, copy: bool = True) -> torch.Tensor | tuple[torch.Tensor, ...]:
        outs = self.run(*inputs, copy=copy)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def run(self, *inputs: torch.Tensor, copy: bool = True) -> list[torch.Tensor]:
        """One inference of b rows (the first dimension of every input), run by the smallest
        compiled batch size of at least b; the outputs have b rows. With `copy=False` they are
        views of nimble's buffers until the next call."""
        self._ensure_open()
        batch = self._rows(inputs)
        exe = self.executable_for(batch)
        size = exe.graph.values[exe.graph.inputs[0]].spec.shape[0]
        if size == batch:
            return exe.run(*inputs, copy=copy)
        padded = [torch.cat([x, x.new_zeros((size - batch, *x.shape[1:]))]) for x in inputs]
        outs = [o[:batch] for o in exe.run(*padded, copy=False)]
        return [o.clone() for o in outs] if copy else outs

    def run_rows(self, blocks: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        """As `Executable.run_rows`: blocks of checked rows, run by the smallest compiled batch size
        that holds them all; the outputs (views until the next call) have as many rows."""
        self._ensure_open()
        rows = sum(block[0].shape[0] for block in blocks)
        return [o[:rows] for o in self.executable_for(rows).run_rows(blocks)]

    def check_inputs(self, inputs) -> int:
        """Raise ShapeError, in one line, unless `inputs` are what a call takes (any batch from 1 to
        the largest, index values inside their tables); returns their batch."""
        rows = self._rows(inputs)
        self.executable_for(rows)
        for x, buf in zip(inputs, self.input_buffers):
            if x.dtype != buf.dtype:
                raise ShapeError(f"an input must be {types.dtype_name(buf.dtype)}, got {types.dtype_name(x.dtype)}; "
                                 "convert it first")
        self._by_batch[self._sizes[-1]].check_values(inputs)
        return rows

    def _rows(self, inputs) -> int:
        g = self.graph
        if len(inputs) != len(g.inputs):
            raise ShapeError(f"the model takes {len(g.inputs)} input(s) "
                             f"({', '.join(g.values[i].name for i in g.inputs)}), got {len(inputs)}")
        rows = set()
        for vid, x in zip(g.inputs, inputs):
            spec = g.values[vid].spec
            if not isinstance(x, torch.Tensor):
                raise ShapeError(f"input '{g.values[vid].name}' must be a tensor, got {type(x).__name__}")
            if x.dim() != len(spec.shape) or tuple(x.shape[1:]) != spec.shape[1:]:
                raise ShapeError(f"input '{g.values[vid].name}' must be {spec.dtype}[B, "
                                 f"{', '.join(map(str, spec.shape[1:]))}] with B from 1 to {self._sizes[-1]}, got "
                                 f"{types.dtype_name(x.dtype)}{list(x.shape)}")
            rows.add(x.shape[0])
        if len(rows) > 1:
            raise ShapeError(f"the inputs have different batch sizes ({', '.join(map(str, sorted(rows)))}); "
                             "give every input the same first dimension")
        return rows.pop()

    def replay(self) -> None:
        """One inference of the largest batch size on whatever its input buffers hold."""
        self._by_batch[self._sizes[-1]].replay()

    @property
    def input_buffers(self) -> list[torch.Tensor]:
        return self._by_batch[self._sizes[-1]].input_buffers

    def verify(self, rtol: float | None = None, atol: float | None = None):
        """`Executable.verify` at every batch size, on the stored sample rows repeated, then
        `check_rows`; returns the largest's comparison."""
        self._ensure_open()
        result = [self._by_batch[b].verify(rtol, atol) for b in self._sizes][-1]
        self.check_rows(rtol, atol)
        return result

    def check_rows(self, rtol: float | None = None, atol: float | None = None) -> None:
        """MismatchError unless every batch size, on inputs whose rows differ (`batches.distinct_rows`
        of the stored sample), gives each row what the smallest batch size gives that row alone."""
        self._ensure_open()
        small = self._sizes[0]
        rt, at = default_tolerance(self.device.type)
        rt, at = rt if rtol is None else rtol, at if atol is None else atol
        for b in self._sizes[1:]:
            xs = [x.to(self.device) for x in batches.distinct_rows(self.artifact.sample_inputs, b)]
            result = compare(self._by_batch[b].run(*xs), batches.each_row_alone(self._by_batch[small].run, xs, small),
                             rt, at)
            if not result.passed:
                raise MismatchError(f"{self._name}: at batch {b}, on rows that differ, the outputs are not batch "
                                    f"{small}'s for each row alone ({result.describe()}); the artifact's batch sizes "
                                    "compute different functions: recompile it")

    # ------------------------------------------------------------------------------ memory
    def footprint(self) -> footprint.Footprint | None:
        """What the artifact holds on its GPU now, every batch size together; None on the CPU."""
        if self._mark is None or self._closed:
            return None
        exes = list(self._by_batch.values())
        owner = self._by_batch[self._sizes[-1]]
        planned = owner._planned_bytes()
        planned["inputs"] = sum(b.nbytes for e in exes for b in e.input_buffers)
        return footprint.measure(self.device, self._mark, planned, [p for e in exes for p in e.pools()],
                                 sum(e.outside_bytes() for e in exes))

    def _ensure_open(self) -> None:
        if self._closed:
            raise UsageError(f"{self._name} was closed; load it again to run it")

    def close(self) -> None:
        """Give back what every batch size holds (see `Executable.close`)."""
        self._closed = True
        for exe in getattr(self, "_by_batch", {}).values():
            exe.close()

    def __enter__(self) -> Batched:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        g = self.graph
        return (f"<nimble.Batched {self.artifact.model} on {self.device}: batch sizes "
                f"{', '.join(map(str, self._sizes))}; ({g.describe(g.inputs)}) -> ({g.describe(g.outputs)}) at "
                f"batch {self._sizes[0]}; a call of b rows runs the smallest batch size of at least b, padded>")
