"""One loaded artifact answering batches of infer requests, and what it measured doing so.

A batch of requests (what Ray Serve's `serve.batch` hands over) is split into runs whose rows fit
the artifact's largest batch size; each run is one call, which the artifact pads to its nearest
compiled batch size. Each request is checked alone first (shape, dtype, index ranges), so one bad
request gets its own error and never fails the others, and no index outside its table reaches the
GPU. No Ray here: the deployment in `app.py` wraps this class.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import NimbleError
from . import timeline as timeline_mod
from .protocol import InferRequest, ModelInfo, ProtocolError, model_info


@dataclass
class Stats:
    """Counters in the shape of Triton's statistics extension (`GET /v2/models/<name>/stats`)."""

    requests: int = 0
    failures: int = 0
    rows: int = 0
    calls: int = 0
    queue_ns: int = 0
    compute_ns: int = 0
    device_ns: int = 0  # on a GPU: its calls' time there, from CUDA events (not in Triton's document)
    last_ms: int = 0
    by_rows: dict[int, list[int]] = field(default_factory=dict)  # rows in one call -> [calls, compute ns]

    def document(self, name: str) -> dict:
        def stat(count, ns):
            return {"count": count, "ns": ns}

        return {"model_stats": [{
            "name": name, "version": "1", "last_inference": self.last_ms, "inference_count": self.rows,
            "execution_count": self.calls,
            "inference_stats": {"success": stat(self.requests, self.queue_ns + self.compute_ns),
                                "fail": stat(self.failures, 0), "queue": stat(self.requests, self.queue_ns),
                                "compute_infer": stat(self.calls, self.compute_ns)},
            "batch_stats": [{"batch_size": b, "compute_infer": stat(n, ns)}
                            for b, (n, ns) in sorted(self.by_rows.items())]}]}


class Replica:
    """An artifact loaded for serving: `infer(requests)` answers each request with its outputs or
    a ProtocolError. `observe(rows, queue_s, compute_s, device_s)` is called once per call (the
    deployment's metrics); `device_s`, the GPU time of the call from CUDA events recorded around
    it (copy in, replay, copy out), is None on the CPU. With `timeline` (a folder), each call is
    also written to the replica's timeline file there (`timeline.py`)."""

    def __init__(self, path: str | Path, name: str, device: str = "auto", tune: str = "cached",
                 observe=lambda rows, queue_s, compute_s, device_s: None, kernels: str | None = None,
                 timeline: str | None = None):
        from ..runtime.opening import load

        self.exe = load(path, device, tune=tune, verify=True, kernels=kernels)
        sizes = getattr(self.exe, "batch_sizes", [])
        self.info: ModelInfo = model_info(name, self.exe.graph, sizes)
        self.stats = Stats()
        # the model's source lines that errors name stay in this process: a client sees none of its paths
        self._sources = sorted({op.source for op in self.exe.graph.ops if op.source}, key=len, reverse=True)
        self._observe = observe
        self._lock = threading.Lock()  # one call at a time: the batch sizes share one arena
        cuda = self.exe.device.type == "cuda"
        self._events = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if cuda else None
        self._clock = timeline_mod.GpuClock() if cuda and timeline else None
        self._timeline = timeline_mod.Writer(timeline, timeline_mod.device_name() if cuda else "cpu") \
            if timeline else None

    def check(self, request: InferRequest) -> None:
        """Raise ProtocolError (400) unless the request's tensors can run (index ranges included)."""
        try:
            self.exe.check_inputs(request.tensors)
        except NimbleError as e:
            raise ProtocolError(400, self.for_client(str(e))) from None

    def answered(self, request: InferRequest) -> None:
        """Called once a request's answer is encoded: its stages go to the timeline, if any."""
        if self._timeline is not None and request.ran is not None:
            self._timeline.request(request.arrived, request.received, request.ran, time.perf_counter())

    def for_client(self, message: str) -> str:
        """`message` without the artifact's recorded source paths."""
        for source in self._sources:
            message = message.replace(source, "the model's code")
        return message

    def infer(self, requests: list[InferRequest]) -> list[list[torch.Tensor] | ProtocolError]:
        """Outputs (CPU tensors) or a ProtocolError for each request, in order."""
        answers: list = [None] * len(requests)
        good = []
        for k, r in enumerate(requests):
            try:
                self.check(r)
                good.append(k)
            except ProtocolError as e:
                answers[k] = e
                self.stats.failures += 1
        for run in self._runs([requests[k] for k in good], good):
            self._call([requests[k] for k in run], run, answers)
        return answers

    def _runs(self, requests: list[InferRequest], ids: list[int]) -> list[list[int]]:
        """Consecutive requests grouped so that each group's rows fit one call."""
        runs, rows = [], 0
        for r, k in zip(requests, ids):
            if runs and rows + r.rows <= self.info.max_batch and self.info.batched:
                runs[-1].append(k)
                rows += r.rows
            else:
                runs.append([k])
                rows = r.rows
        return runs

    def _call(self, group: list[InferRequest], ids: list[int], answers: list) -> None:
        start = time.perf_counter()
        try:
            with self._lock:
                # each request's rows go straight into the input buffers, checked once as it arrived
                # (`check`); answers are encoded after the lock is gone: copies, never views of the
                # buffers the next call writes (from the GPU into pinned memory, waited for at the end
                # event; on the CPU, clone), which the encoder reads without another copy
                if self._events is None:
                    outs = [o.clone() for o in self.exe.run_rows([r.tensors for r in group])]
                    device = gpu = None
                else:  # the events are read before the next call (another thread's) records them again
                    begin, end = self._events
                    begin.record()
                    outs = [o.to("cpu", non_blocking=True) for o in self.exe.run_rows([r.tensors for r in group])]
                    end.record()
                    end.synchronize()
                    device = begin.elapsed_time(end) / 1e3
                    gpu = (self._clock.seconds(begin), self._clock.seconds(end)) if self._clock else None
        except NimbleError as e:
            for k in ids:
                answers[k] = ProtocolError(400, self.for_client(str(e)))
            self.stats.failures += len(ids)
            return
        compute = time.perf_counter() - start
        at = 0
        for r, k in zip(group, ids):
            answers[k] = [o[at:at + r.rows] for o in outs] if self.info.batched else outs
            at += r.rows
            r.ran = (start, start + compute)
        rows = sum(r.rows for r in group)
        queue = sum(start - r.received for r in group)
        s = self.stats
        s.requests += len(group)
        s.rows += rows
        s.calls += 1
        s.queue_ns += int(queue * 1e9)
        s.compute_ns += int(compute * 1e9)
        s.device_ns += int((device or 0.0) * 1e9)
        s.last_ms = int(time.time() * 1000)
        entry = s.by_rows.setdefault(rows, [0, 0])
        entry[0] += 1
        entry[1] += int(compute * 1e9)
        self._observe(rows, queue / len(group), compute, device)
        if self._timeline is not None:
            self._timeline.call(min(r.received for r in group), (start, start + compute), gpu, rows)
