"""A serving replica's call timeline (`nimble serve --timeline DIR`), and how busy it kept its GPU.

Each replica writes `DIR/replica-<pid>.jsonl`: a first line naming its device, then one line per
call: when its earliest request arrived, when the call began and ended on the host, and on a GPU
when its work began and ended there (CUDA events recorded around the call: copy in, replay, copy
out), all on the machine's monotonic clock (`time.perf_counter()`, one clock for every process of
a Linux machine), and its rows. A GPU event's time on that clock is the time a reference event
completed (`GpuClock`, taken when the replica started) plus the device time between the two.

Each request answered is a line too: when the replica's handler took it, when it was decoded,
when its call began and ended, and when its answer was encoded (`stages` gives their medians).

`busy(DIR, begin, end)` reads every replica's file and measures, per GPU, the union of its calls'
device intervals inside [begin, end] over the window: how much of the time some replica's work ran
on it. Replicas that share a GPU overlap; their sum would count the overlap twice.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from pathlib import Path

MAX_LINE = 4096  # a line of a timeline file longer than this is not one of ours: skipped


class GpuClock:
    """Maps a CUDA event of the current device to `time.perf_counter()` seconds."""

    def __init__(self):
        import torch

        self._reference = torch.cuda.Event(enable_timing=True)
        self._reference.record()
        self._reference.synchronize()
        self._at = time.perf_counter()

    def seconds(self, event) -> float:
        return self._at + self._reference.elapsed_time(event) / 1e3


class Writer:
    """One replica's timeline file: a line a call, written as the call ends, and a line a request,
    written once its answer is encoded (line-buffered: a replica killed outright loses at most the
    line it was writing)."""

    def __init__(self, folder: str | Path, device: str):
        path = Path(folder) / f"replica-{os.getpid()}.jsonl"
        # never through a link planted at that name: the file is the replica's own
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644)
        self._file = os.fdopen(fd, "w", buffering=1)
        self._lock = threading.Lock()  # a replica's calls end on its worker threads
        self._file.write(json.dumps({"device": device, "pid": os.getpid()}) + "\n")

    def call(self, received: float, host: tuple[float, float], gpu: tuple[float, float] | None, rows: int) -> None:
        line = {"received": round(received, 7), "host": [round(t, 7) for t in host], "rows": rows}
        if gpu is not None:
            line["gpu"] = [round(t, 7) for t in gpu]
        self._write(line)

    def request(self, arrived: float, decoded: float, ran: tuple[float, float], encoded: float) -> None:
        """One request's stages: taken by the replica's handler, decoded, its call's start and end,
        its answer encoded."""
        self._write({"request": [round(t, 7) for t in (arrived, decoded, *ran, encoded)]})

    def _write(self, line: dict) -> None:
        text = json.dumps(line) + "\n"
        with self._lock:
            self._file.write(text)


def device_name(index: int = 0) -> str:
    """The GPU a replica runs on, the same in every process whatever CUDA_VISIBLE_DEVICES says."""
    import torch

    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return f"GPU-{uuid}" if uuid is not None else f"cuda:{os.environ.get('CUDA_VISIBLE_DEVICES', index)}"


def _lines(folder: str | Path):
    """(device, line) for every line of every timeline file in `folder` after its first (lines
    that are not a JSON object, a last line cut short, and lines over MAX_LINE are skipped)."""
    for path in sorted(Path(folder).glob("replica-*.jsonl")):
        device = None
        with open(path, encoding="utf-8", errors="replace") as f:
            for text in f:
                if len(text) > MAX_LINE:
                    continue
                try:
                    line = json.loads(text)
                except ValueError:
                    continue
                if not isinstance(line, dict):
                    continue
                if device is None:
                    device = str(line.get("device", path.name))[:200]
                    continue
                yield device, line


def read(folder: str | Path) -> dict[str, list[dict]]:
    """device -> its replicas' call lines, from every timeline file in `folder` (lines that are not
    a call of ours are skipped)."""
    calls: dict[str, list[dict]] = {}
    for device, line in _lines(folder):
        if _times(line.get("gpu"), 2) is not None or _times(line.get("host"), 2) is not None:
            calls.setdefault(device, []).append(line)
    return calls


STAGES = ("taken to decoded", "decoded to call", "call", "call to encoded")


def stages(folder: str | Path, begin: float, end: float) -> dict[str, float] | None:
    """The medians, in ms, of where the requests that the replicas took within [begin, end] spent
    their time inside the replica (STAGES: the body read and decoded; waiting for a call, i.e.
    batch formation and the lock; the call: copy in, replay, copy out; the answer back on the
    event loop and encoded), their sum as "in the replica", and "requests"; None if there were none.
    What a client sees beyond "in the replica" is the proxy's and Ray Serve's."""
    spans = [t for t in (_times(line.get("request"), 5) for _, line in _lines(folder))
             if t is not None and begin <= t[0] and t[-1] <= end]
    if not spans:
        return None
    out = {name: statistics.median(t[k + 1] - t[k] for t in spans) * 1e3 for k, name in enumerate(STAGES)}
    return out | {"in the replica": statistics.median(t[-1] - t[0] for t in spans) * 1e3, "requests": len(spans)}


def _times(value, count: int) -> tuple[float, ...] | None:
    """`value` as `count` times that never run backwards, or None where it is anything else."""
    if isinstance(value, list) and len(value) == count and all(isinstance(t, (int, float)) for t in value) \
            and all(a <= b for a, b in zip(value, value[1:])):
        return tuple(float(t) for t in value)
    return None


def union_seconds(intervals: list[tuple[float, float]], begin: float, end: float) -> float:
    """The length of the union of `intervals`, each clipped to [begin, end]."""
    total, reach = 0.0, begin
    for a, b in sorted((max(a, begin), min(b, end)) for a, b in intervals):
        if b <= a or b <= reach:
            continue
        total += b - max(a, reach)
        reach = b
    return total


def busy(folder: str | Path, begin: float, end: float) -> dict[str, float]:
    """device -> the fraction of [begin, end] in which some replica's call ran on it (GPU
    intervals; on the CPU, the calls' host intervals)."""
    window = end - begin
    if window <= 0:
        raise ValueError(f"the window [{begin}, {end}] is empty")
    out = {}
    for device, lines in read(folder).items():
        spans = [_times(line.get("gpu"), 2) or _times(line.get("host"), 2) for line in lines]
        out[device] = union_seconds([s for s in spans if s is not None], begin, end) / window
    return out
