"""The tuning search of one load: each stage's candidates built and timed on this GPU
(`choices.stages`), the best picked (`choices.pick`) and kept in the tuning cache, or the choice
read from it, or taken as forced or as the only one. Building is the caller's (`build`).

Where cuDNN graphs can run, building a candidate times cuDNN's plans for each of its
convolutions, and a layout's convolutions are calls of their own: on a conv net that search is
most of what a cold load costs (on the H200 with empty caches, densenet121's contiguous
candidate took 3.0 s to build and time, its channels_last one 3.8 s, every later candidate 0.1
to 0.4 s). So the layouts are timed in this order (`_layouts`): channels_last with the search;
then contiguous provisionally, its convolutions as nimble runs them without cuDNN graphs
(`cudnn_graph.provisional`); and contiguous with the search only where the provisional one took
at most the `provisional_layout` setting (1.3) times channels_last's time. A provisional
candidate is never the choice; its time is reported under its name and " (provisional)"."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

from ..base import footprint, timing
from ..base.settings import Settings
from ..kernels import cudnn_graph
from . import choices

PROVISIONAL = " (provisional)"


@dataclass
class Outcome:
    choice: choices.Choice
    how: str  # off, forced, only one candidate, cache hit, or timed
    timed: dict[str, float] = field(default_factory=dict)  # GPU-bound ms of each timed candidate
    held: dict[str, int] = field(default_factory=dict)  # and the bytes of its graph pool
    seconds: dict[str, float] = field(default_factory=dict)  # and the wall seconds its build and timing took
    built: bool = False  # the last candidate built is the choice: it need not be built again


def search(artifact, device, options: list, tune: str, forced, settings: Settings, build, pools,
           stage_timer) -> Outcome:
    """The choice among `options` (`choices.candidates`) as `tune` says (off, cached or full), or
    `forced`. `build(choice)` builds and captures a candidate and returns its replay; `pools()` the
    graph pools it holds; `stage_timer` times the search as the load's "tuning" stage."""
    if forced is not None:
        return Outcome(forced, "forced")
    if len(options) == 1 or tune == "off":
        return Outcome(options[0], "off" if tune == "off" and len(options) > 1 else "only one candidate")
    key = choices.cache_key(artifact, device, settings)  # hashing: only where the cache is used
    best = choices.cached(key) if tune == "cached" else None
    if best is not None and best in options:
        return Outcome(best, "cache hit")
    found = Outcome(options[0], "timed")
    last = None

    def time_one(c: choices.Choice, provisional: bool = False) -> float:
        nonlocal last
        name = c.describe() + (PROVISIONAL if provisional else "")
        started = time.perf_counter()
        with cudnn_graph.provisional() if provisional else contextlib.nullcontext():
            replay = build(c)
        found.timed[name] = timing.gpu_ms(replay, device)
        found.held[name] = footprint.pool_segments(device, pools())[0]
        found.seconds[name] = time.perf_counter() - started
        last = None if provisional else c  # a provisional build is never kept
        return found.timed[name]

    graphs = cudnn_graph.frontend() is not None
    with stage_timer:  # its builds' warm-ups and captures count as those
        for stage in choices.stages(options, graphs=graphs):
            if isinstance(stage, list):
                _layouts(stage, graphs, time_one, settings)
            else:
                for c in stage(best):
                    time_one(c)
            best = choices.pick([c for c in options if c.describe() in found.timed], found.timed, found.held,
                                settings)
        choices.store(key, best, {k: v for k, v in found.timed.items() if not k.endswith(PROVISIONAL)})
    found.choice, found.built = best, best == last
    return found


def _layouts(candidates: list, graphs: bool, time_one, settings: Settings) -> None:
    """The first stage: every candidate timed, in the order the module docstring gives where
    cuDNN graphs can run and both layouts are candidates."""
    first = [c for c in candidates if c.layout == "channels_last"]
    rest = [c for c in candidates if c.layout != "channels_last"]
    if not graphs or not first or not rest:
        for c in candidates:
            time_one(c)
        return
    bar = min(time_one(c) for c in first) * settings.provisional_layout
    for c in rest:
        if time_one(c, provisional=True) <= bar:
            time_one(c)
