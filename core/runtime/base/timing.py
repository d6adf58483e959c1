"""Latency measurement in trtexec's vocabulary, for any runner with a `replay()` method.

Latency is host wall time from launching one inference until the GPU finished it (the inputs
already sit in the runner's buffers). GPU compute time comes from CUDA events around the launch,
host enqueue time from the host clock around it. Throughput is the timed inferences over the
timed run's wall time; `back_to_back_per_s` is a separate, short run with no synchronization
between launches (the GPU-bound rate). Every percentile, the median among them, is a nearest-rank
percentile of the same sorted latencies.

`gpu_ms` is the GPU-bound figure alone (back-to-back replays between CUDA events), which load-time
tuning, the cuDNN graph plans and the benchmarks time with; `graph_us` times one call of a function
captured in a CUDA graph, as a kernel choice made at load runs.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .claimed import walking
from .streams import count_kernels, forked, new_graph, write_dot


@dataclass
class Timing:
    latency_ms: list[float] = field(default_factory=list)
    gpu_ms: list[float] = field(default_factory=list)
    enqueue_ms: list[float] = field(default_factory=list)
    throughput: float = 0.0  # timed inferences per second of the timed run's wall time
    back_to_back: float = 0.0  # inferences per second, launched back to back with no sync between

    def summary(self, percentiles=(90, 95, 99)) -> dict:
        lat = sorted(self.latency_ms)
        mean = statistics.fmean(lat)
        out = {"iterations": len(lat), "min_ms": lat[0], "mean_ms": mean, "median_ms": percentile(lat, 50),
               "max_ms": lat[-1], "cv_percent": 100 * statistics.pstdev(lat) / mean if mean else 0.0,
               "gpu_mean_ms": statistics.fmean(self.gpu_ms) if self.gpu_ms else None,
               "enqueue_mean_ms": statistics.fmean(self.enqueue_ms), "throughput_per_s": self.throughput,
               "back_to_back_per_s": self.back_to_back}
        for p in percentiles:
            out[f"p{p:g}_ms"] = percentile(lat, p)
        return out


def percentile(ordered: list[float], p: float) -> float:
    """The nearest-rank percentile of sorted values: the smallest value with at least p % of the
    values at or below it."""
    return ordered[min(len(ordered) - 1, max(0, math.ceil(p / 100 * len(ordered)) - 1))]


def samples_behind(p: float, n: int) -> int:
    """How many measured values lie above the p-th percentile of n: none means it is the max."""
    return n - 1 - min(n - 1, max(0, math.ceil(p / 100 * n) - 1))


def measure(replay, *, cuda: bool, warmup_ms: float = 200, duration_s: float = 3.0, iterations: int = 10,
            until: float | None = None) -> Timing:
    """Time `replay()` as trtexec does: warm up for warmup_ms, then run for at least duration_s
    and at least `iterations` times (duration_s 0: exactly `iterations` times). `until` (a
    `time.perf_counter()` value) ends it all sooner, warm-up and back-to-back run included, once
    two inferences are timed: on a slow or busy machine the bench keeps to its time."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    end = time.perf_counter() + warmup_ms / 1000
    if until is not None:
        end = min(end, until - duration_s)
    while True:
        replay()
        sync()
        if time.perf_counter() >= end:
            break
    timing = Timing()
    start_ev, stop_ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda \
        else (None, None)
    began = time.perf_counter()
    deadline = began + duration_s
    while len(timing.latency_ms) < iterations or time.perf_counter() < deadline:
        if until is not None and len(timing.latency_ms) >= 2 and time.perf_counter() >= until:
            break
        t0 = time.perf_counter()
        if cuda:
            start_ev.record()
        replay()
        t1 = time.perf_counter()
        if cuda:
            stop_ev.record()
        sync()
        t2 = time.perf_counter()
        timing.latency_ms.append((t2 - t0) * 1000)
        timing.enqueue_ms.append((t1 - t0) * 1000)
        if cuda:
            timing.gpu_ms.append(start_ev.elapsed_time(stop_ev))
    timing.throughput = len(timing.latency_ms) / (time.perf_counter() - began)
    # the back-to-back rate: at most a tenth of the timed run's length, and at most 1000 launches
    n = max(1, min(len(timing.latency_ms) // 10, 1000))
    if until is not None:  # and within what is left of `until`
        left_s = until - time.perf_counter()
        n = max(1, min(n, int(left_s * 1000 / max(statistics.median(timing.latency_ms), 1e-6))))
    t0 = time.perf_counter()
    for _ in range(n):
        replay()
    sync()
    timing.back_to_back = n / (time.perf_counter() - t0)
    return timing


def gpu_ms(replay, device: torch.device, replays: int = 20, repeats: int = 5, warmup: int = 1) -> float:
    """Median time per replay over `repeats` runs of `replays` back-to-back replays, after
    `warmup` replays."""
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(warmup):
        replay()
    torch.cuda.synchronize(device)
    samples = []
    for _ in range(repeats):
        start.record()
        for _ in range(replays):
            replay()
        stop.record()
        torch.cuda.synchronize(device)
        samples.append(start.elapsed_time(stop) / replays)
    return statistics.median(samples)


_streams: dict[int, torch.cuda.Stream] = {}  # device index -> the stream load-time choices time on


def stream(device: torch.device) -> torch.cuda.Stream:
    """The one stream every load-time choice times on, per device, for the process: the stream
    current when it is first asked for, unless that is the default stream (which cannot capture),
    then one of its own. cuBLAS keeps a workspace (32 MiB on Hopper) for each stream it ever ran
    on, for the whole process, so timing on whichever stream an op runs on, or on a new stream
    each time, would leave one behind per stream."""
    if walking():
        return None
    current = torch.cuda.current_stream(device)
    if current.device_index not in _streams:
        _streams[current.device_index] = current if current != torch.cuda.default_stream(device) \
            else torch.cuda.Stream(device)
    return _streams[current.device_index]


@contextlib.contextmanager
def on_stream(device: torch.device) -> Iterator[torch.cuda.Stream]:
    """The block run on `stream(device)`, forked from the current stream and joined back."""
    side = stream(device)
    if side is None:  # a prebuild's walk: no stream to fork
        yield side
        return
    with forked([side], device), torch.cuda.stream(side):
        yield side


def kernels_in(fn, device: torch.device) -> int:
    """How many kernels one call of `fn` launches: the kernel nodes of a CUDA graph of it,
    captured on `on_stream`'s stream (call `fn` once outside a capture first, so that whatever it
    decides on its first call is decided). In a prebuild's walk, 2 (see below)."""
    import tempfile
    from pathlib import Path

    if walking():  # a prebuild's walk: `fn` noted, and counted as two kernels so its split way is walked too
        fn()
        return 2
    with torch.cuda.device(device):
        with on_stream(device) as side:
            graph = new_graph(debug=True)
            with torch.cuda.graph(graph, stream=side):
                fn()
        with tempfile.TemporaryDirectory() as folder:
            dump = Path(folder) / "graph.dot"
            write_dot(graph, dump)
            return count_kernels(dump)


def graph_us(fn, device: torch.device, runs: int = 10) -> float:
    """Microseconds of one call of `fn`: a CUDA graph of `runs` calls, replayed three times, the
    median. That is the GPU's time alone, as in the artifact's own graph (timed eagerly, a launch
    from Python takes longer than a small convolution). Warmed up and captured on `stream`. In a
    prebuild's walk, `fn` is called once and takes 1 us (every candidate ties)."""
    if walking():
        fn()
        return 1.0
    with torch.cuda.device(device):
        with on_stream(device) as side:
            fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            for _ in range(runs):
                fn()
        return gpu_ms(graph.replay, device, replays=1, repeats=3) * 1000 / runs
