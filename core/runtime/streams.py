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

import contextlib
import gc
from typing import Callable, Iterator, Sequence

import torch

from ..errors import CaptureError, ExecutionError, first_line
from ..ir import Graph


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


def fold(order: Sequence[int], stream_of: Sequence[int], waits: Sequence[Sequence[int]],
         cap: int | None = None) -> list[int]:
    """The CUDA stream each op is issued on, when the planned streams share as few CUDA streams as
    the schedule allows: a planned stream, at its first op, takes over a CUDA stream whose planned
    stream has issued its last op and whose last op already precedes this one (through the planned
    streams' order and waits), so capture records no ordering the schedule lacks and the captured
    graph keeps its parallelism. Fewer CUDA streams mean fewer per-stream segments in the graph's
    memory pool and fewer cuBLAS workspaces (one per stream that multiplies matrices).

    With `cap`, at most that many CUDA streams: a planned stream that finds none to take over
    once `cap` exist shares the one with the fewest planned streams still running (a finished one
    first), then the one whose last op was issued earliest. Sharing a stream only adds ordering,
    and every op still follows its waits' ops in issue order, so the memory plan, proved safe
    under the planned order, stays safe, and nothing can wait on an op issued after it."""
    last_on_planned: dict[int, int] = {}
    waiters: dict[int, int] = {}  # op -> how many ops wait on it
    for i in order:
        last_on_planned[stream_of[i]] = i
        for u in waits[i]:
            waiters[u] = waiters.get(u, 0) + 1
    before: dict[int, int] = {}  # op -> bitset of the ops that precede it, while a later op may read it
    previous: dict[int, int] = {}  # planned stream -> its latest op so far
    physical: dict[int, int] = {}  # planned stream -> CUDA stream
    tail: list[int] = []  # CUDA stream -> the last op issued on it
    running: list[int] = []  # CUDA stream -> how many of its planned streams have ops still to issue
    position = {op: k for k, op in enumerate(order)}
    out = [0] * len(stream_of)
    for i in order:
        planned = stream_of[i]
        preds = [*waits[i], *([previous[planned]] if planned in previous else [])]
        mask = 0
        for p in preds:
            mask |= before[p] | (1 << p)
        before[i] = mask
        if planned in previous and previous[planned] not in waiters:
            del before[previous[planned]]  # its stream has moved on and no one waits on it
        for u in waits[i]:
            waiters[u] -= 1
            if waiters[u] == 0:
                del waiters[u]
                if previous.get(stream_of[u]) != u:  # its own stream needs it no more either
                    before.pop(u, None)
        if planned not in physical:
            reuse = next((k for k, (n, last) in enumerate(zip(running, tail)) if not n and mask >> last & 1), None)
            if reuse is None and cap is not None and len(tail) >= cap:
                reuse = min(range(len(tail)), key=lambda k: (running[k], position[tail[k]]))
            if reuse is None:
                reuse = len(tail)
                tail.append(-1)
                running.append(0)
            physical[planned] = reuse
            running[reuse] += 1
        k = physical[planned]
        out[i], tail[k], previous[planned] = k, i, i
        if last_on_planned[planned] == i:
            running[k] -= 1
    return out


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


def release_plan(graph: Graph, order: Sequence[int], stream_of: Sequence[int]) -> dict[int, list[int]]:
    """op -> the values to drop once it is issued (`PlacedRun`'s `release`): each value after its
    last reader in issue `order` (after its producer, if nothing reads it), unless it is a graph
    output or shares storage with one, or a value sharing its storage is used on another CUDA
    stream than the one that made the storage (`stream_of`): its memory must then outlive reads
    the allocator cannot see."""
    position = {op: k for k, op in enumerate(order)}
    last: dict[int, int] = {}
    streams_of_root: dict[int, set[int]] = {}
    for op in graph.ops:
        for v in op.outputs:
            last.setdefault(v, op.id)
            streams_of_root.setdefault(graph.root(v), set()).add(stream_of[op.id])
        for r in op.refs():
            if r in last and position[op.id] > position[last[r]]:
                last[r] = op.id
            streams_of_root.setdefault(graph.root(r), set()).add(stream_of[op.id])
    outputs = {graph.root(o) for o in graph.outputs}
    plan: dict[int, list[int]] = {}
    for v, op in last.items():
        root = graph.root(v)
        if root not in outputs and graph.values[root].producer is not None and len(streams_of_root[root]) == 1:
            plan.setdefault(op, []).append(v)
    return plan
