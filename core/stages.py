"""One instrument around every stage of a compile or a load (as Hidet's pass instruments are).

- Each stage is timed once. A stage that runs inside another (a warm-up inside the tuning) is
  counted under the inner stage alone, so the stage times add up to the wall time, and no
  second is counted twice.
- Each pass is a stage of its own: the graph is linted after it, and a pass that breaks an
  invariant raises GraphError naming the pass. The op count after each pass is kept
  (`passes`), for `compile --json`, `inspect` and the manifest.
- `progress(label)` is told as each stage starts (the CLI's spinner).

Plain Python over the IR: no torch, so it serves both the builder and the runtime.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import time
from typing import Callable, Iterator

from .errors import GraphError
from .ir import Graph


class Stages:
    def __init__(self, progress: Callable[[str], None] | None = None):
        self.seconds: dict[str, float] = {}  # stage -> seconds spent in it, nested stages excluded
        self.passes: list[tuple[str, int]] = []  # (pass, ops after it), in the order they ran
        self._progress = progress or (lambda label: None)
        self._open: list[list] = []  # [stage name, seconds of the stages nested in it so far]

    @contextlib.contextmanager
    def stage(self, name: str, label: str | None = None) -> Iterator[None]:
        self._progress(label or name)
        frame = [name, 0.0]
        self._open.append(frame)
        start = time.perf_counter()
        try:
            yield
        finally:
            total = time.perf_counter() - start
            self._open.pop()
            self.add(name, total - frame[1])
            if self._open:
                self._open[-1][1] += total

    def progress(self, label: str) -> None:
        """Tell the progress display something inside a stage (a search's rounds)."""
        self._progress(label)

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def move(self, source: str, target: str, seconds: float) -> None:
        """Count `seconds` of `source` under `target` instead (time that a callee measured itself,
        such as kernel compilation inside a warm-up)."""
        seconds = min(seconds, self.seconds.get(source, 0.0))
        self.add(source, -seconds)
        self.add(target, seconds)

    def run_passes(self, graph: Graph, weights: dict, passes, rewrites_weights=frozenset(),
                   lowered_label: str | None = "lowered") -> tuple[Graph, dict]:
        """Run `passes` in order, each a stage named by its function, linting after each. A pass in
        `rewrites_weights` takes and returns the weights beside the graph. `lowered_label` names
        the graph they start from in `passes` (None: a run that continues an earlier one)."""
        if lowered_label is not None:
            self.passes.append((lowered_label, len(graph.ops)))
        linted = None  # the graph the last pass left, linted
        for run in passes:
            name = run.__name__
            with self.stage(name, f"pass {name}"):
                graph, weights = run(graph, weights) if run in rewrites_weights else (run(graph), weights)
            self.passed(name, graph, linted=graph is linted)
            linted = graph
        return graph, weights

    def passed(self, name: str, graph: Graph, linted: bool = False) -> None:
        """Record that pass `name` left `graph`, linting it first unless `linted` (the pass
        returned the very graph the pass before it left, linted then: graphs are immutable). A
        pass run outside `run_passes`, such as the precision search's conversion, reports here too."""
        if not linted:
            try:
                graph.lint()
            except GraphError as e:
                raise GraphError(f"pass {name} broke the graph: {e}") from None
        self.passes.append((name, len(graph.ops)))


def cycles_uncollected(compile_fn):
    """`compile_fn` with Python's cyclic garbage collector paused while it runs (as it was after).
    A compile makes millions of small objects that live until it ends, and every full collection
    walks all of them: on a 12,000-op chain the compile took 13.8 to 13.9 s with the collector and
    11.5 to 11.7 s without, alternated on the 2-core builder, with peak RSS 431 and 435 MB. What
    the compile leaves in cycles is collected after it, as usual."""

    @functools.wraps(compile_fn)
    def paused(*args, **kwargs):
        was = gc.isenabled()
        gc.disable()
        try:
            return compile_fn(*args, **kwargs)
        finally:
            if was:
                gc.enable()
    return paused
