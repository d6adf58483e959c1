"""The tuning search of one load: each stage's candidates built and timed on this GPU
(`choices.stages`), the best picked (`choices.pick`) and kept in the tuning cache, or the choice
read from it, or taken as forced or as the only one. Building is the caller's (`build`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..base import footprint, timing
from ..base.settings import Settings
from ..kernels import cudnn_graph
from . import choices


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
    timed: dict[str, float] = {}
    held: dict[str, int] = {}
    seconds: dict[str, float] = {}
    last = None
    with stage_timer:  # its builds' warm-ups and captures count as those
        for stage in choices.stages(options, graphs=cudnn_graph.frontend() is not None):
            for c in stage if isinstance(stage, list) else stage(best):
                started = time.perf_counter()
                replay = build(c)
                timed[c.describe()] = timing.gpu_ms(replay, device)
                held[c.describe()] = footprint.pool_segments(device, pools())[0]
                seconds[c.describe()] = time.perf_counter() - started
                last = c
            best = choices.pick([c for c in options if c.describe() in timed], timed, held, settings)
        choices.store(key, best, timed)
    return Outcome(best, "timed", timed, held, seconds, built=best == last)
