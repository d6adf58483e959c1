"""Loading an artifact for execution: the set-up that `Executable` (the call path) stands on.

Loading first runs the preflight (`placed/preflight.py`): every op on the meta device, checked
against its declared spec and buffer, before any data moves. It then allocates the weights, one
arena of the planned size and one static buffer per input (`assemble/buffers.py`). On CUDA it
chooses how to run (`tune/search.py`): each candidate gets fresh kernels (`assemble/lower.py`), its
issue order, streams and pairs (`assemble/order.py`), an eager warm-up on its streams (which
validates every op and creates each stream's cuBLAS and cuDNN handles and workspaces) and a
capture into one CUDA graph (`assemble/capture.py`). What the load holds on the GPU is reported by
kind (`base/footprint.py`), and `close()` gives it back.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..errors import ArtifactError, ExecutionError, ShapeError, UsageError
from ..ir import WEIGHT
from ..plan import capped
from ..specs import check_tune_mode
from ..stages import Stages
from .base import footprint
from .base.device import resolve_device
from .base.settings import Settings, current as current_settings, using
from .assemble import buffers, capture, inputs, lower
from .assemble.choice import Choice, channels_last_values, every_choice
from .assemble.order import IssueOrder, issue_order
from .kernels import cudnn_graph, generated
from .kernels.fused import FusedKernel
from .kernels.binaries import STATS as BINARIES
from .pairs import prologue_pairs, taken
from .placed import indices
from .placed.placement import PlacedOp, arena_views, prepare
from .placed.preflight import preflight
from .tune import choices as tuning
from .tune.search import search
from . import prebuild


@dataclass
class LoadStats:
    seconds: dict[str, float] = field(default_factory=dict)  # stage -> seconds, each counted once; and "total"
    weight_bytes: int = 0
    arena_bytes: int = 0
    choice: str = ""  # the layout, streams, algorithms and convolution fusion it runs with (CUDA)
    tuning: str = ""  # how they were chosen: off, forced, cache hit, or timed
    tuning_ms: dict[str, float] = field(default_factory=dict)  # GPU-bound ms of each timed candidate
    tuning_pool_bytes: dict[str, int] = field(default_factory=dict)  # and the bytes of its graph pool
    tuning_seconds: dict[str, float] = field(default_factory=dict)  # and the seconds its build and timing took
    kernels_generated: int = 0  # fused kernels built in this load
    kernel_source_hits: int = 0  # of which the source was already in the cache folder
    kernel_binaries_recalled: int = 0  # kernels launched from the binary of an earlier process, without Triton
    kernel_fallbacks: list[str] = field(default_factory=list)  # fused ops interpreted op by op instead
    prebuilt: prebuild.Prebuilt | None = None  # CUDA: the kernels found before the first op ran, and where from
    footprint: footprint.Footprint | None = None  # CUDA: what the load holds on the GPU, by kind

    @property
    def scratch_bytes(self) -> int:
        """Graph-pool memory the capture kept (op workspaces, temporaries, results outside the
        arena), as the footprint counts it; 0 without a graph."""
        f = self.footprint
        return 0 if f is None else f.outside_arena + f.pool_free


class Loading:
    """The set-up of a loaded artifact (`Executable` is the call path on top): what it holds,
    how it chose to run, and the captured graph."""

    def __init__(self, artifact, device: str = "auto", *, arena: bool = True, single_stream: bool = False,
                 graph_dump: str | None = None, name: str | None = None, tune: str = "cached",
                 choice: Choice | None = None, max_memory: int | None = None,
                 share: Loading | None = None, arena_bytes: int | None = None, group=None,
                 settings: Settings | None = None, shape_advice: str = inputs.COMPILED_FOR,
                 kernels: str | None = None, beside: str | None = None):
        """`arena=False` and `single_stream=True` build the baselines that `nimble bench` times:
        activations in PyTorch's graph pool, or every op on one stream in program order.
        `graph_dump` writes the captured CUDA graph as Graphviz DOT (for tests and debugging).
        `name` names the artifact in errors (its file's name; by default its model's).
        On CUDA, `tune` (off, cached or full) says how the layout, streams, convolution algorithms
        and convolution fusion are chosen (`tune/`), and `choice` forces them. `max_memory`
        (bytes) refuses a load whose planned tensors would exceed it before allocating anything,
        and on CUDA one whose device footprint (`footprint.py`) ends up above it. `share` (a
        loaded Executable of the same weights, on the same device) lends its weights and arena
        instead of allocating them, for the batch sizes of one artifact (`batched.py`); the arena
        must be large enough: `arena_bytes` sizes the lender's above its own plan. `group` (a
        `group.Group`, whose `load` passes it) lends its arena, streams and workspaces instead, to
        artifacts of different weights, and makes every call wait its turn (`group.py`).
        `settings` (`base/settings.py`; by default the current ones) say which of nimble's kernels
        and pairs it may use and the thresholds of its measured choices. `shape_advice` ends the
        error a call of another shape gets (`nimble.Nimble` says to prepare that shape).
        `kernels` names a kernel pack the user trusts (`kernels/pack.py`); `beside` is the
        artifact's path, beside which a pack signed with the configured key is found."""
        check_tune_mode(tune)
        if choice is not None and choice not in every_choice():
            raise UsageError(f"choice={choice!r} is no load-time choice; build it from the settings assemble/choice.py "
                             "names (LAYOUTS, STREAMS, ALGORITHMS, CONVOLUTIONS, GEMM_BIAS, PROLOGUES)")
        self.settings = settings if settings is not None else current_settings()
        self.shape_advice = shape_advice
        self._kernels, self._beside = kernels, beside
        t0 = time.perf_counter()
        self._stages = stages = Stages()  # each load stage timed once (stages.py)
        with using(self.settings), stages.stage("prepare"):
            self.artifact = artifact
            self.graph, self.schedule, self.memory = artifact.graph, artifact.schedule, artifact.memory
            self.device, self.notice = resolve_device(device)
            self.stats = LoadStats()
            self._closed = False
            self._name = name or artifact.model
            self._mark = footprint.Mark.now(self.device) if self.device.type == "cuda" else None
            self._prepared: list[PlacedOp] = prepare(self.graph)  # each op resolved once
            self._placed = self._prepared  # on CUDA, the chosen candidate's fresh kernels (`assemble/lower.py`)
            self._cuda_graph = self._tensors = self._outputs = self._env_after = None
            self._with_arena, self._single_stream = arena, single_stream
            self._share, self._group = share, group
            self._arena_added: int | None = None  # in a group: the bytes its load added to the group's arena
            self._arena_size = max(arena_bytes or 0, self.memory.arena_bytes)
            self._streams: list[torch.cuda.Stream] = []  # none on the CPU: ops run serially
            self._blas_ready: set[int] = set()  # the streams whose cuBLAS workspaces exist
            self._cudnn_workspaces = cudnn_graph.Workspaces()  # the cuDNN graphs' workspaces, per stream
            self.choice = Choice()  # on CUDA, replaced by what _choose picks
            self._set_order(self.choice)
        with stages.stage("preflight"):  # before any op touches real memory
            preflight(self.graph, self.memory, self._name)
            self._indices = indices.plan_indices(self.graph)
            names = {v.id: v.name for v in self.graph.values if v.kind == WEIGHT}
            indices.check_weights({vid: artifact.weights[n] for vid, n in names.items()}, self._indices, names,
                                  self._name)
            for p in self._prepared:
                p.clamps = tuple(self._indices.clamps.get(p.op.id, ()))
        with stages.stage("allocate"):
            buffers.check_budget(self._name, max_memory, self._planned_bytes())
            self._allocate()
        if self.device.type == "cuda":
            with using(self.settings):
                self._load_on_cuda(tune, choice, graph_dump, max_memory)
        if group is not None:
            group._join(self)
        self.stats.seconds = {**stages.seconds, "total": time.perf_counter() - t0}

    def _load_on_cuda(self, tune: str, choice, graph_dump, max_memory) -> None:
        """Choose how to run, capture it, and record what the kernels and the footprint came to."""
        s, stats = generated.STATS, self.stats
        self._prebuild(tune, choice)  # its walk defines kernels too: counted apart, in `stats.prebuilt`
        built, hits, seconds, fallbacks, recalled = (s.generated, s.source_hits, s.seconds, len(s.fallbacks),
                                                     BINARIES.recalled)
        self._choose(tune, choice, graph_dump)
        prebuild.after_load(stats.prebuilt)
        self._stored_weights = dict(self._weights)  # only the chosen layout's weights stay
        self._channels_last_weights = {}
        stats.kernels_generated, stats.kernel_source_hits = s.generated - built, s.source_hits - hits
        stats.kernel_binaries_recalled = BINARIES.recalled - recalled
        self._stages.move("warmup", "kernels", s.seconds - seconds)  # kernels build on first run
        stats.kernel_fallbacks = s.fallbacks[fallbacks:]
        settle_footprint(self, max_memory, "compile with fewer streams (--streams) or a smaller batch")

    def _prebuild(self, tune: str, forced) -> None:
        """Every kernel this load will launch, ready before the first op runs (`prebuild.py`)."""
        if self._share is not None and self._share.stats.prebuilt is None:
            return  # another batch size of an artifact whose owner found its kernels here before
        if tune == "cached" and forced is None and self._share is None and tuning.cached(
                tuning.cache_key(self.artifact, self.device, self.settings)) is not None:
            return  # loaded here before (its tuning is cached): its kernels are too
        only = forced if forced is not None else (self.choice if self._single_stream or not self._with_arena else None)
        with self._stages.stage("prebuild"):
            self.stats.prebuilt = prebuild.for_load(self.artifact, self.device, only, self._kernels, self._beside)

    def _planned_bytes(self) -> dict[str, int]:
        """Bytes of the tensors the plan names: weights, arena and inputs."""
        arena = self._arena_size
        if self._group is not None:  # in a group: what it grew the group's arena by (to grow, before it loads)
            shared = 0 if self._group.arena is None else self._group.arena.numel()
            arena = max(arena - shared, 0) if self._arena_added is None else self._arena_added
        return buffers.planned_bytes(self.graph, self.artifact.weights, arena, self._with_arena)

    def footprint(self) -> footprint.Footprint | None:
        """What this artifact holds on its GPU now, by kind (`footprint.py`); None on the CPU."""
        if self._mark is None or self._closed:
            return None
        return footprint.measure(self.device, self._mark, self._planned_bytes(), self.pools(), self.outside_bytes())

    def pools(self) -> list:
        """The captured graph's memory pool, in a list (empty without a graph)."""
        return [self._cuda_graph.pool()] if self._cuda_graph is not None else []

    def outside_bytes(self) -> int:
        """Bytes of the results the captured graph holds outside the plan's own storages."""
        own = self._own_storages()
        outside: dict[int, int] = {}
        for t in (self._tensors or {}).values():
            storage = t.untyped_storage()
            if storage.data_ptr() not in own and t.is_cuda:
                outside[storage.data_ptr()] = storage.nbytes()
        return sum(outside.values())

    def _own_storages(self) -> frozenset[int]:
        """The storages a load allocates for the plan: the arena, the input buffers, the weights."""
        return frozenset(t.untyped_storage().data_ptr() for t in [self.arena, *self._inputs, *self._weights.values()])

    def _ensure_open(self) -> None:
        if self._closed:
            raise UsageError(f"{self._name} was closed; load it again to run it")

    def close(self) -> None:
        """Give back what the artifact holds: the captured graph, its pool, the arena, the weights,
        the input buffers and the chosen candidate's kernels (on CUDA, to the device). Calling it
        afterwards is refused. Also `with nimble.load(path) as exe: ...`."""
        if self._closed:
            return
        self._closed = True
        self._cuda_graph = self._tensors = self._outputs = self._env_after = None
        self._views, self._weights, self._stored_weights, self._inputs = {}, {}, {}, []
        self._channels_last_weights = {}
        # the lowered kernels held the cuDNN graphs' workspaces and their last calls' buffers: they go
        # (the prepared ones never ran); the workspaces too, unless another holder (an executable of
        # the same multi-batch artifact, a group) has them
        for p in [*self._placed, *self._prepared]:
            if isinstance(p.substitute, FusedKernel):
                p.substitute.forget_calls()
        self._placed, self._issue_order = self._prepared, IssueOrder([], [], [], [])
        self._cudnn_workspaces = cudnn_graph.Workspaces()
        self.arena = None
        self._streams = []
        if self._group is not None:
            self._group._leave(self)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------ set-up
    def _choose(self, tune: str, forced, graph_dump) -> None:
        """Pick how to run (`tune/search.py`), then build the CUDA graph that runs it."""
        folded = capped.streams_under(self.schedule, None)
        # a candidate only where a pair survives the other pairs of the planned order, which `_set_order`
        # found (efficientnet's depthwise ops are all in mean pairs: the candidate would run the same kernels)
        prologues = self.settings.prologue_pairs and self._with_arena and bool(
            prologue_pairs(self.graph, self._prepared, taken(self._pairs)))
        options = tuning.candidates(self.graph, max(folded, default=0) + 1, prologues)
        if self._single_stream or not self._with_arena:  # the baselines of `nimble bench`
            options = [Choice()]

        def build(candidate):
            self._build(candidate)
            return self._cuda_graph.replay

        found = search(self.artifact, self.device, options, tune, forced, self.settings, build, self.pools,
                       self._stages.stage("tuning"))
        if not found.built or graph_dump:
            self._build(found.choice, graph_dump)
        self.choice = found.choice
        self.stats.choice, self.stats.tuning, self.stats.tuning_ms = found.choice.describe(), found.how, found.timed
        self.stats.tuning_pool_bytes, self.stats.tuning_seconds = found.held, found.seconds

    def _set_order(self, choice, placed: list[PlacedOp] | None = None) -> None:
        """The issue order, streams, waits and pairs of `choice` (`assemble/order.py`), the pairs among
        `placed` (by default the prepared ops)."""
        self._issue_order = issue_order(self.graph, self.schedule, self.memory,
                                        self._prepared if placed is None else placed, choice,
                                        single_stream=self._single_stream,
                                        paired=self.device.type == "cuda" and self._with_arena,
                                        settings=self.settings)

    @property
    def _order(self) -> list[int]:
        return self._issue_order.order

    @property
    def _stream_of(self) -> list[int]:
        return self._issue_order.stream_of

    @property
    def _waits(self) -> list:
        return self._issue_order.waits

    @property
    def _planned_stream_of(self) -> list[int]:
        return self._issue_order.planned_stream_of

    @property
    def _pairs(self):
        return self._issue_order.pairs

    def _build(self, choice, graph_dump: str | None = None) -> None:
        """Lay out the buffers and weights for `choice`, make its kernels afresh (`assemble/lower.py`),
        warm up every stream, and capture."""
        self._cuda_graph = self._tensors = None
        channels_last = choice.layout == "channels_last"
        self._views = arena_views(self.graph, self.memory, self.arena,
                                  channels_last_values(self.graph, by_use=True) if channels_last else ()) \
            if self._with_arena else {}
        self._weights = dict(self._stored_weights)
        if channels_last:
            self._weights.update(self._channels_last_weights)
        if self._share is None and self._group is None:  # sized anew for this choice's plans (no graph is left)
            self._cudnn_workspaces = cudnn_graph.Workspaces()
        self._placed = lower.lower(self._prepared, choice, self._cudnn_workspaces)
        self._set_order(choice, self._placed)
        lower.pair(self._placed, self._pairs, choice)
        needed = max(self._stream_of, default=0) + 1  # made once per load: each stream costs workspaces
        self._streams += [torch.cuda.Stream(self.device) for _ in range(needed - len(self._streams))]
        self._blas_ready = capture.make_blas_workspaces(self._placed, self._stream_of, self._streams,
                                                        self._blas_ready, self.device)
        benchmark = torch.backends.cudnn.benchmark
        torch.backends.cudnn.benchmark = choice.algorithms == "benchmark"  # read when a convolution first runs
        try:
            with self._stages.stage("warmup"):
                self._issue(validate=True)  # eager warm-up on every stream: handles, workspaces and kernels exist
                torch.cuda.synchronize(self.device)
                self._cudnn_workspaces.settle(self.device)
            with self._stages.stage("capture"):
                self._capture(graph_dump)
        finally:
            torch.backends.cudnn.benchmark = benchmark

    def _allocate(self) -> None:
        g = self.graph
        if self._share is not None:
            lender = self._share
            if lender.device != self.device or lender.arena.numel() < self.memory.arena_bytes:
                raise ExecutionError(f"{self._name}: the executable it shares with has another device or a smaller "
                                     "arena")
            held = buffers.borrow(g, lender._weights_by_name, lender.arena, self.device)
            self._share_streams(lender)
        else:
            held = buffers.allocate(g, self.artifact.weights, self.device, 0 if self._group else self._arena_size)
        self._stored_weights, self._channels_last_weights = held.stored_weights, held.channels_last_weights
        self.arena, self._inputs = held.arena, held.inputs
        if self._group is not None:  # its arena and streams; the weights and input buffers stay its own
            before = 0 if self._group.arena is None else self._group.arena.numel()
            self.arena = self._group.reserve(self._arena_size)
            self._arena_added = self.arena.numel() - before
            self._share_streams(self._group)
        try:  # the warm-up and tuning run on the stored sample inputs, never on whatever memory held
            inputs.copy_in(g, self._inputs, self._indices, self.artifact.sample_inputs, self.shape_advice)
        except ShapeError as e:
            raise ArtifactError(f"{self.artifact.model}: the stored sample input does not fit the model "
                                f"({e})") from None
        self._weights = dict(self._stored_weights)
        self._views = arena_views(g, self.memory, self.arena) if self._with_arena else {}
        self.stats.weight_bytes = sum(t.numel() * t.element_size() for t in self._weights.values())
        self.stats.arena_bytes = self.memory.arena_bytes if self._with_arena else 0

    def _share_streams(self, lender) -> None:
        """The lender's (an Executable's or a Group's) CUDA streams, with the cuBLAS workspaces
        PyTorch keeps for each (32 MiB on Hopper), and its cuDNN graphs' workspaces: a multi-batch
        artifact's graphs, or a group's, replay one at a time, so they can run on the same ones."""
        self._streams, self._blas_ready, self._cudnn_workspaces = \
            lender._streams, lender._blas_ready, lender._cudnn_workspaces

    @property
    def _weights_by_name(self) -> dict[str, torch.Tensor]:
        return {self.graph.values[vid].name: t for vid, t in self._stored_weights.items()}

    def _rebase(self, arena: torch.Tensor) -> None:
        """Run on `arena` from now on (a group's, grown): the views into it made again and, on
        CUDA, the graph captured again under the same choice."""
        self.arena = arena
        self._env_after = None
        if self.device.type == "cuda" and not self._closed:
            with using(self.settings):
                self._build(self.choice)  # which lays out the views too
        elif self._with_arena:
            self._views = arena_views(self.graph, self.memory, arena)

    def _issue(self, validate: bool = False, around=None) -> dict[int, torch.Tensor]:
        """Issue every op in order on its stream (`assemble/capture.issue`), under this load's
        settings; on the CPU the last call's results are kept for `tensors()`."""
        env = dict(self._weights)
        env.update(zip(self.graph.inputs, self._inputs))
        cuda = self.device.type == "cuda"
        with using(self.settings):  # the kernels build and choose under this load's settings
            capture.issue(self.graph, self._placed, self._issue_order, env, self._views, self.device, self._streams,
                          self._own_storages() if cuda else frozenset(), validate, around)
        self._env_after = None if cuda else env
        return env

    def _capture(self, dump: str | None = None) -> None:
        pool = self._group.pool if self._group is not None else None  # a group's members share one graph pool
        self._cuda_graph, env = capture.capture(self._issue, self._streams[0], self.device, pool, dump)
        self._outputs = [env[o] for o in self.graph.outputs]
        self._tensors = env

def settle_footprint(loaded, max_memory: int | None, advice: str) -> None:
    """At the end of a CUDA load: give what warm-ups and tuning freed back to the device, record
    the footprint in `loaded.stats`, and close and refuse a load above `max_memory`."""
    torch.cuda.empty_cache()
    loaded.stats.footprint = loaded.footprint()
    grown = loaded.stats.footprint.growth
    if max_memory is not None and grown > max_memory:
        loaded.close()
        raise ExecutionError(f"{loaded._name}: loaded, it holds {buffers.mib(grown)} on {loaded.device}, above the "
                             f"memory budget of {buffers.mib(max_memory)}; raise the budget, or {advice}")
