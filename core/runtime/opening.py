"""`load(path)`: an artifact read, validated and loaded, as an `Executable`, or for an artifact of
several batch sizes a `batched.Batched`, which is called the same way."""

from __future__ import annotations

import time
from pathlib import Path

from .base.settings import Settings
from .batched import Batched
from .executable import Executable


def open_artifact(artifact, device: str = "auto", **options) -> Executable:
    """An artifact read into memory, loaded: an `Executable`, or for an artifact of several batch
    sizes a `batched.Batched`, which is called the same way. `options` as `Executable` takes
    them (name, tune, graph_dump, max_memory, settings)."""
    if artifact.batches:
        return Batched(artifact, device, **options)
    return Executable(artifact, device, **options)


def load(path: str | Path, device: str = "auto", tune: str = "cached", graph_dump: str | None = None,
         verify: bool = False, max_memory: int | None = None, settings: Settings | None = None,
         kernels: str | Path | None = None) -> Executable:
    """Read and validate an artifact, then prepare it for execution on `device`, choosing its
    layout, streams and convolution algorithms as `tune` says (off, cached or full; see
    `tuning.py`). `graph_dump` writes the captured CUDA graph as Graphviz DOT. `verify` runs the
    stored sample input once and raises MismatchError unless the stored outputs come back (within
    the device's default tolerance): a self-check at load, one inference long. `max_memory`
    (bytes) refuses, in one line, a load that would hold more: before allocating, against the
    weights, arena and inputs; on CUDA also against the footprint once loaded (which is then freed).
    `exe.close()`, or `with nimble.load(path) as exe:`, gives the memory back. An artifact of
    several batch sizes loads as a `Batched`: one CUDA graph per batch size on shared weights and
    arena, called with any batch up to the largest. `settings` (`base/settings.py`) as `Executable` takes them."""
    from nimble.formats import read_artifact  # formats sits beside the runtime, imported when first loading

    t = time.perf_counter()
    art = read_artifact(path)
    read_s = time.perf_counter() - t
    exe = open_artifact(art, device, name=Path(path).name, tune=tune, graph_dump=graph_dump, max_memory=max_memory,
                        settings=settings, kernels=None if kernels is None else str(kernels), beside=str(path))
    exe.stats.seconds = {"read": read_s, **exe.stats.seconds, "total": read_s + exe.stats.seconds["total"]}
    if verify:
        exe.verify()
    return exe
