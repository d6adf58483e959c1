"""A timeline of a loaded artifact as a Chrome/Perfetto trace: `nimble bench --trace FILE`.

Open the file in https://ui.perfetto.dev or chrome://tracing. It has two processes:

- "ops on their streams": the op list issued once, op by op, on the streams the artifact runs with
  (the planned ones, or one where the load-time choice serialised them), one track per stream.
  On CUDA a timing event on the op's stream brackets each op, so the times are GPU times and
  overlap where streams run at once; an op's slice names it and carries its id, target, source
  line, output shapes and the ops it waits for. The CUDA graph runs the same kernels without the
  host's launch gaps between them, so gaps here are an upper bound on the replay's.
- "CUDA graph replays": a few replays of the captured graph back to back, each one slice: the
  time an inference really takes.

On the CPU there is one track and the times are wall-clock (the op list runs serially there).
"""

from __future__ import annotations

import time

import torch

from ..ops import fusion

TRACE_REPLAYS = 10


def op_label(op) -> str:
    """`convolution`, or `fused(convolution+add+relu)` for a fused op."""
    def short(target: str) -> str:
        return target.split("::")[-1].split(".")[0]

    if fusion.is_fused(op):
        return "fused(" + "+".join(short(node[0]) for node in fusion.body_of(op)) + ")"
    return short(op.target)


def chrome_trace(exe, replays: int = TRACE_REPLAYS) -> dict:
    """The trace document (Chrome's JSON trace format) of `exe`, a loaded Executable."""
    g, schedule = exe.graph, exe.schedule
    spans = timeline(exe)
    events: list[dict] = [_meta("process_name", 1, 0, "ops on their streams"),
                          _meta("process_sort_index", 1, 0, 1)]
    for stream in sorted({s for _, s, _, _ in spans}):
        events.append(_meta("thread_name", 1, stream, f"stream {stream}"))
    for op_id, stream, start, end in spans:
        op = g.ops[op_id]
        events.append({"name": op_label(op), "cat": "op", "ph": "X", "pid": 1, "tid": stream,
                       "ts": round(start * 1000, 3), "dur": round(max(end - start, 0.0) * 1000, 3),
                       "args": {"op": op_id, "target": op.target, "source": op.source,
                                "outputs": ["x".join(map(str, g.values[o].spec.shape)) for o in op.outputs],
                                "waits for ops": list(schedule.waits[op_id])}})
    replay_spans = replay_timeline(exe, replays)
    if replay_spans:
        events += [_meta("process_name", 2, 0, "CUDA graph replays"), _meta("process_sort_index", 2, 0, 2),
                   _meta("thread_name", 2, 0, "replays, back to back")]
        events += [{"name": f"replay {k}", "cat": "replay", "ph": "X", "pid": 2, "tid": 0,
                    "ts": round(start * 1000, 3), "dur": round((end - start) * 1000, 3)}
                   for k, (start, end) in enumerate(replay_spans)]
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"model": exe.artifact.model, "device": str(exe.device),
                          "runs as": exe.stats.choice or "the placed op list, serially",
                          "ops": len(g.ops), "planned streams": schedule.num_streams,
                          "op list ms": round(max((e for *_, e in spans), default=0.0), 4),
                          "replay ms": [round(e - s, 4) for s, e in replay_spans]}}


def timeline(exe) -> list[tuple[int, int, float, float]]:
    """(op, planned stream, start ms, end ms) of each op of one inference of `exe` on its current
    input buffers, issued op by op as it runs: on CUDA on its stream, bracketed by timing events
    there (GPU times, from one origin); on the CPU serially, wall-clock."""
    marks: list = []
    cuda = exe.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(exe.device)
        origin = torch.cuda.Event(enable_timing=True)
        origin.record()

    def around(step):
        def timed(i: int) -> None:
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()  # on the op's stream: issue() made it current
                step(i)
                end.record()
            else:
                start = time.perf_counter()
                step(i)
                end = time.perf_counter()
            marks.append((i, start, end))

        return timed

    t0 = time.perf_counter()
    exe._issue(validate=True, around=around)
    if cuda:
        torch.cuda.synchronize(exe.device)
        return [(i, exe._planned_stream_of[i], origin.elapsed_time(a), origin.elapsed_time(b)) for i, a, b in marks]
    return [(i, 0, (a - t0) * 1000, (b - t0) * 1000) for i, a, b in marks]


def replay_timeline(exe, replays: int) -> list[tuple[float, float]]:
    """(start ms, end ms) of `replays` CUDA graph replays of `exe` back to back (GPU times); none
    without a graph (the CPU)."""
    graph = exe._cuda_graph
    if graph is None:
        return []
    torch.cuda.synchronize(exe.device)
    marks = [torch.cuda.Event(enable_timing=True) for _ in range(replays + 1)]
    marks[0].record()
    for k in range(replays):
        graph.replay()
        marks[k + 1].record()
    torch.cuda.synchronize(exe.device)
    return [(marks[0].elapsed_time(marks[k]), marks[0].elapsed_time(marks[k + 1])) for k in range(replays)]


def _meta(name: str, pid: int, tid: int, value) -> dict:
    key = "sort_index" if name.endswith("sort_index") else "name"
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": {key: value}}
