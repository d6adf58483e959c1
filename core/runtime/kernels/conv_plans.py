"""cuDNN's plans for the convolutions a load runs through PyTorch, built ahead in threads.

PyTorch builds a cuDNN execution plan the first time a convolution (its shapes, strides, dtype,
alignment and flags) runs in a process, and keeps it for that process only. Some plans compile a
kernel as they are built: on the H200 each of efficientnet_b0's depthwise convolutions takes
about 53 ms the first time, 2.8 s of its warm load, one after another in the warm-up.

So a load records each convolution that it ran on cuDNN through `convolution.conv_into` with
heuristic algorithms (`recording`, `note`), and keeps the list in the cache folder under its
tuning key and the choice it built (`store`). The next load of the same artifact with that
choice, on the same GPU, torch and settings, first runs each recorded convolution once on scratch
tensors in a pool of threads (`prewarm`): PyTorch releases the interpreter lock while an op runs,
so the plans are built side by side, and the warm-up then finds them built. Benchmarked algorithms
are never built ahead: cuDNN times them as it builds, and timings taken side by side would be
wrong.

A record is data read from the cache folder: each entry is checked (`_checked`: four dimensions,
whole numbers in range, a known dtype, at most MAX_BYTES of scratch per tensor), at most
MAX_CONVOLUTIONS of them; anything else makes the record a miss. A convolution that fails to run
ahead is skipped: the warm-up then builds its plan as before.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from concurrent.futures import ThreadPoolExecutor

import torch

from ..base import cache

MAX_CONVOLUTIONS = 1024
MAX_BYTES = 2**28  # scratch per tensor of a recorded convolution
MAX_RECORD_BYTES = 2**22  # the whole table
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_recording: contextvars.ContextVar[set | None] = contextvars.ContextVar("nimble_conv_plans", default=None)


@contextlib.contextmanager
def recording():
    """Collect the convolutions `note` sees on this thread while the block runs (the set is yielded)."""
    seen: set = set()
    token = _recording.set(seen)
    try:
        yield seen
    finally:
        _recording.reset(token)


def note(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, padding, stride, dilation, groups: int,
         benchmark: bool, deterministic: bool, tf32: bool) -> None:
    """Record one cuDNN convolution where a recording is on and its plan is chosen by heuristics."""
    seen = _recording.get()
    if seen is None or benchmark or x.dtype not in DTYPES.values():
        return
    seen.add((tuple(x.shape), tuple(x.stride()), tuple(w.shape), tuple(w.stride()), tuple(out.shape),
                    tuple(out.stride()), str(x.dtype).removeprefix("torch."), tuple(padding), tuple(stride),
                    tuple(dilation), int(groups), bool(deterministic), bool(tf32)))


def path():
    folder = cache.cache_dir()
    return None if folder is None else folder / "conv_plans.json"


def recorded(key: str) -> list[tuple] | None:
    """The convolutions stored for `key`, each checked; None where there is no record or any entry fails."""
    entry = cache.read_table(path(), MAX_RECORD_BYTES).get(key)
    if not isinstance(entry, list) or len(entry) > MAX_CONVOLUTIONS:
        return None
    found = [_checked(e) for e in entry]
    return None if any(f is None for f in found) else found


def store(key: str, seen: set) -> None:
    """Keep `seen` (from `recording`) for `key`, unless it is what is already kept."""
    entries = sorted(seen)[:MAX_CONVOLUTIONS]
    if recorded(key) != entries:
        cache.write_entry(path(), key, [list(e) for e in entries], MAX_RECORD_BYTES)


def prewarm(entries: list[tuple], device: torch.device) -> int:
    """Run each convolution once on scratch tensors, on up to one thread per core; returns how many
    ran. Ends with the device synchronized, before any capture can start."""
    if not entries:
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    workers = min(len(entries), cores, 16)

    def one(e: tuple) -> bool:
        x_shape, x_stride, w_shape, w_stride, o_shape, o_stride, dtype, padding, stride, dilation, groups, det, tf32 = e
        kind = DTYPES[dtype]
        try:
            with torch.cuda.device(device):
                x = torch.empty_strided(x_shape, x_stride, dtype=kind, device=device)
                w = torch.empty_strided(w_shape, w_stride, dtype=kind, device=device)
                out = torch.empty_strided(o_shape, o_stride, dtype=kind, device=device)
                torch.ops.aten.cudnn_convolution.out(x, w, list(padding), list(stride), list(dilation), groups, False,
                                                     det, tf32, out=out)
            return True
        except RuntimeError:  # shapes cuDNN refuses, or out of memory: the warm-up builds it
            return False

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="nimble-conv-plans") as pool:
        ran = sum(pool.map(one, entries))
    torch.cuda.synchronize(device)
    return ran


def _checked(e) -> tuple | None:
    """A recorded convolution as `note` writes it, or None where any part is out of kind or range."""
    if not isinstance(e, list) or len(e) != 13:
        return None
    shapes, dtype, convs, groups, flags = e[:6], e[6], e[7:10], e[10], e[11:]
    if dtype not in DTYPES or type(groups) is not int or not 1 <= groups <= 2**20 \
            or any(type(f) is not bool for f in flags):
        return None
    if not all(isinstance(s, list) and len(s) == 4 and all(type(v) is int and 0 <= v < 2**31 for v in s) for s in shapes):
        return None
    if not all(isinstance(s, list) and len(s) == 2 and all(type(v) is int and 0 <= v <= 2**16 for v in s) for s in convs) \
            or min(convs[1] + convs[2]) < 1:
        return None
    itemsize = torch.empty((), dtype=DTYPES[dtype]).element_size()
    for shape, strides in zip(shapes[0::2], shapes[1::2]):
        span = 0 if 0 in shape else 1 + sum((n - 1) * s for n, s in zip(shape, strides))
        if span * itemsize > MAX_BYTES:
            return None
    return (*(tuple(s) for s in shapes), dtype, *(tuple(s) for s in convs), groups, *flags)
