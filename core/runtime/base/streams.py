"""Issuing an op list on its planned streams, and capturing that into a CUDA graph.

One helper issues for every executor that follows a schedule: inference loading (eager warm-up,
then capture) and training (warm-up steps, then the forward capture). Its rules are what the
platform requires (DESIGN.md, "Multi-stream capture"):

- every side stream is forked from the current stream before its first op, and joined back to it
  after its last, in eager runs as in capture. Eagerly this orders the ops after the inputs and
  weights written on the current stream; in capture it is what makes the side streams part of
  the graph at all;
- an op waits on the event of each op its schedule names, recorded right after that op.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
from typing import Callable, Iterator, Sequence

import torch

from ...errors import CaptureError, ExecutionError, first_line
from ...ir import Graph


@contextlib.contextmanager
def forked(streams: Sequence[torch.cuda.Stream], device: torch.device) -> Iterator[None]:
    """Fork every stream other than the current one from it on entry, and join them back on exit."""
    main = torch.cuda.current_stream(device)
    side = [s for s in streams if s != main]
    for s in side:
        s.wait_stream(main)
    yield
    for s in side:
        main.wait_stream(s)


def issue(order: Sequence[int], run: Callable[[int], None], device: torch.device,
          streams: Sequence[torch.cuda.Stream] = (), stream_of: Sequence[int] = (),
          waits: Sequence[Sequence[int]] = ()) -> None:
    """Call `run(i)` for each op `i` in `order`. On CUDA (`streams` given), each call runs on
    `streams[stream_of[i]]` after waiting on the events of the ops in `waits[i]`; without streams
    the ops run one after another on the current device."""
    if not streams:
        for i in order:
            run(i)
        return
    waited = {u for ws in waits for u in ws}
    events: dict[int, torch.cuda.Event] = {}
    with forked(streams, device):
        for i in order:
            stream = streams[stream_of[i]]
            with torch.cuda.stream(stream):
                for u in waits[i]:
                    stream.wait_event(events[u])
                run(i)
                if i in waited:
                    events[i] = torch.cuda.Event()
                    events[i].record(stream)


@contextlib.contextmanager
def capturing(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream, device: torch.device, what: str,
              advice: str, pool=None) -> Iterator[None]:
    """Capture the body into `graph` on `stream`, which first waits for the current stream. A
    failure other than an ExecutionError (an op that fails names itself) becomes a CaptureError:
    `what` names what was captured and `advice` what to try instead. Python's cyclic garbage
    collector stays off meanwhile: an unreachable executable it collected mid-capture could free
    CUDA objects (cuDNN plans, events), which the capture forbids (a test that failed while
    another load's executable waited for collection broke the next capture)."""
    stream.wait_stream(torch.cuda.current_stream(device))
    collecting = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            yield
    except ExecutionError:
        raise
    except Exception as e:
        raise CaptureError(f"CUDA graph capture of {what} failed ({first_line(e)}); this process cannot use "
                           f"CUDA reliably any more. Restart it, and {advice}") from e
    finally:
        if collecting:
            gc.enable()


def new_graph(debug: bool = False) -> torch.cuda.CUDAGraph:
    """A CUDA graph; with `debug`, one that keeps its cudaGraph_t so `debug_dump` can write DOT."""
    if not debug:
        return torch.cuda.CUDAGraph()
    try:
        graph = torch.cuda.CUDAGraph(keep_graph=True)
    except TypeError:  # older torch: debug mode alone keeps it
        graph = torch.cuda.CUDAGraph()
    graph.enable_debug_mode()
    return graph


def write_dot(graph: torch.cuda.CUDAGraph, path) -> None:
    """Write `graph` (made by `new_graph(debug=True)`) as Graphviz DOT to `path`, without the
    warning PyTorch gives on every dump ("DEBUG: calling cudaGraphDebugDotPrint() with ..."):
    `nimble bench` and a load's kernel counts dump unasked, and the user would see it each time."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*cudaGraphDebugDotPrint")
        graph.debug_dump(str(path))


def count_kernels(dot_path) -> int:
    """Kernel nodes in a CUDA graph written by `debug_dump` (Graphviz DOT): one per launch."""
    import re
    from pathlib import Path

    return len(re.findall(r"\bKERNEL\b", Path(dot_path).read_text(errors="replace")))


def release_plan(graph: Graph, order: Sequence[int], stream_of: Sequence[int],
                 waits: Sequence[Sequence[int]] | None = None) -> dict[int, list[int]]:
    """op -> the values to drop once it is issued (`PlacedRun`'s `release`): each value after its
    last reader in issue `order` (after its producer, if nothing reads it), unless it is a graph
    output or shares storage with one. Storage used on more than one CUDA stream (`stream_of`)
    is kept to the end, where its memory must outlive reads the allocator cannot see; with the
    schedule's `waits`, it is dropped instead at the first op of the stream that made it which
    has waited, directly or through other streams, for every use of it (`_joined`): the
    allocator hands a freed block only to later work of the stream it was allocated on, and that
    work then runs after every reader."""
    position = {op: k for k, op in enumerate(order)}
    last: dict[int, int] = {}
    users_of_root: dict[int, set[int]] = {}  # root -> the ops that make or read a value of its storage
    for op in graph.ops:
        for v in op.outputs:
            last.setdefault(v, op.id)
            users_of_root.setdefault(graph.root(v), set()).add(op.id)
        for r in op.refs():
            if r in last and position[op.id] > position[last[r]]:
                last[r] = op.id
            users_of_root.setdefault(graph.root(r), set()).add(op.id)
    outputs = {graph.root(o) for o in graph.outputs}
    plan: dict[int, list[int]] = {}
    shared: dict[int, list[int]] = {}  # root -> its values, where they span streams
    for v, op in last.items():
        root = graph.root(v)
        if root in outputs or graph.values[root].producer is None:
            continue
        if len({stream_of[u] for u in users_of_root[root]}) == 1:
            plan.setdefault(op, []).append(v)
        else:
            shared.setdefault(root, []).append(v)
    if waits is not None and shared:
        joined = _joined(order, stream_of, waits, position)
        for root, values in shared.items():
            at = joined(stream_of[graph.values[root].producer], users_of_root[root])
            if at is not None:
                plan.setdefault(at, []).extend(values)
    return plan


def _joined(order: Sequence[int], stream_of: Sequence[int], waits: Sequence[Sequence[int]],
            position: dict[int, int]) -> Callable[[int, set[int]], int | None]:
    """A function of (stream, ops) giving the first op on that stream, in issue `order`, that is
    ordered after every one of `ops` on the GPU (None if none is): on its own stream by issue
    order, on another by the events it waits for, or that an op before it on its stream waited
    for, transitively (a vector clock per op: for each stream, the position of the last op of that
    stream it is ordered after)."""
    clocks: dict[int, dict[int, int]] = {}
    latest: dict[int, dict[int, int]] = {}
    on_stream: dict[int, list[int]] = {}
    for op in order:
        s = stream_of[op]
        clock = dict(latest.get(s, {}))
        for w in waits[op]:
            for t, at in clocks[w].items():
                if clock.get(t, -1) < at:
                    clock[t] = at
        clock[s] = position[op]
        clocks[op] = latest[s] = clock
        on_stream.setdefault(s, []).append(op)
    places = {s: [position[op] for op in ops] for s, ops in on_stream.items()}

    def first(stream: int, ops: set[int]) -> int | None:
        need: dict[int, int] = {}
        for op in ops:
            t = stream_of[op]
            need[t] = max(need.get(t, -1), position[op])
        mine = on_stream.get(stream, [])
        for op in mine[bisect.bisect_left(places.get(stream, []), need.get(stream, -1)):]:
            clock = clocks[op]
            if all(clock.get(t, -1) >= at for t, at in need.items()):
                return op
        return None

    return first
