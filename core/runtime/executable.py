"""Loading an artifact for execution: `nimble.load(path) -> Executable`.

Loading first runs the preflight (`preflight.py`): every op on the meta device, checked against its
declared spec and buffer, before any data moves. On CUDA, it then moves the weights to the device,
allocates one arena of the planned size and one static buffer per input, creates the planned
streams, runs the op list once eagerly on those streams (which validates every op and creates each
stream's cuBLAS and cuDNN handles and workspaces; the streams fork from the current stream, as in
capture, so they follow the weight and input copies), then captures it once into a CUDA graph in
issue order: each op on its stream, an event wait for each planned wait, every side stream forked
from the capturing stream and joined back to it. A call copies the inputs into their buffers and
replays the graph. Loading reads the schedule and the memory plan from the artifact; it never
computes them. What it does choose is how they run on this GPU (`tuning.py`): the layout, the
planned streams (or at most two, or one), cuDNN's convolution algorithms and its fused
convolutions, by building and timing a few candidates, or by reading the choice from the tuning
cache. Fused ops run as cuDNN fused convolutions or generated kernels (`kernels.py`).

The planned streams are folded onto as few CUDA streams as keep them all parallel
(`plan/capped.fold`), made once per load; a capped candidate is the one the artifact stores
(`capped.streams_under`). During the warm-up and the capture, a result outside the
arena is dropped once its last reader is issued, so the graph pool reuses its memory. What the
load holds on the GPU is reported by kind (`footprint.py`), and `close()` gives it back.

On the CPU, the same placed op list runs serially in issue order on each call.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import ArtifactError, ExecutionError, MismatchError, ShapeError, UsageError
from ..ir import WEIGHT
from ..ops import types
from ..ops.execute import run_ops
from ..plan import capped
from ..plan.schedule import Schedule
from ..plan.verify import check_plan
from ..specs import check_tune_mode
from ..stages import Stages
from .kernels import binaries, cudnn_graph, gemm
from .base import footprint, regions, streams, timing
from .placed import indices
from . import pairs
from .base.settings import Settings, using
from .base.settings import current as current_settings
from .kernels import fused, generated
from .tune import choices as tuning
from .base.compare import compare, default_tolerance, l2_tolerance
from .base.device import resolve_device
from .kernels.gemm import Gemm
from .placed.placement import BiasedGemm, PlacedOp, PlacedRun, arena_views, prepare
from .kernels.pooled_conv import SmallLinear
from .placed.preflight import preflight


# ops that multiply matrices through cuBLAS (by the name of the aten op)
GEMMS = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "linear", "matmul", "mv", "addmv", "dot", "einsum",
                   "tensordot"})


@dataclass
class LoadStats:
    seconds: dict[str, float] = field(default_factory=dict)  # stage -> seconds, each counted once; and "total"
    weight_bytes: int = 0
    arena_bytes: int = 0
    choice: str = ""  # the layout, streams, algorithms and convolution fusion it runs with (CUDA)
    tuning: str = ""  # how they were chosen: off, forced, cache hit, or timed
    tuning_ms: dict[str, float] = field(default_factory=dict)  # GPU-bound ms of each timed candidate
    tuning_pool_bytes: dict[str, int] = field(default_factory=dict)  # and the bytes of its graph pool
    kernels_generated: int = 0  # fused kernels built in this load
    kernel_source_hits: int = 0  # of which the source was already in the cache folder
    kernel_binaries_recalled: int = 0  # kernels launched from the binary of an earlier process, without Triton
    kernel_fallbacks: list[str] = field(default_factory=list)  # fused ops interpreted op by op instead
    footprint: footprint.Footprint | None = None  # CUDA: what the load holds on the GPU, by kind

    @property
    def scratch_bytes(self) -> int:
        """Graph-pool memory the capture kept (op workspaces, temporaries, results outside the
        arena), as the footprint counts it; 0 without a graph."""
        f = self.footprint
        return 0 if f is None else f.outside_arena + f.pool_free


class Executable:
    """A loaded artifact. Calling it runs one inference, as the module would: `y = exe(x)` gives a
    tensor when the model has one output and a tuple when it has several; `exe.run(x)` always
    gives a list.

    The rule on aliasing is `nimble.Nimble`'s: outputs are fresh tensors of your own. With
    `copy=False` they are views of nimble's buffers instead (no copy, for the lowest latency),
    which the next call overwrites."""

    def __init__(self, artifact, device: str = "auto", *, arena: bool = True, single_stream: bool = False,
                 graph_dump: str | None = None, name: str | None = None, tune: str = "cached",
                 choice: tuning.Choice | None = None, max_memory: int | None = None,
                 share: Executable | None = None, arena_bytes: int | None = None, group=None,
                 settings: Settings | None = None):
        """`arena=False` and `single_stream=True` build the baselines that `nimble bench` times:
        activations in PyTorch's graph pool, or every op on one stream in program order.
        `graph_dump` writes the captured CUDA graph as Graphviz DOT (for tests and debugging).
        `name` names the artifact in errors (its file's name; by default its model's).
        On CUDA, `tune` (off, cached or full) says how the layout, streams, convolution algorithms
        and convolution fusion are chosen (`tuning.py`), and `choice` forces them. `max_memory`
        (bytes) refuses a load whose planned tensors would exceed it before allocating anything,
        and on CUDA one whose device footprint (`footprint.py`) ends up above it. `share` (a
        loaded Executable of the same weights, on the same device) lends its weights and arena
        instead of allocating them, for the batch sizes of one artifact (`batched.py`); the arena
        must be large enough: `arena_bytes` sizes the lender's above its own plan. `group` (a
        `group.Group`, whose `load` passes it) lends its arena, streams and workspaces instead, to
        artifacts of different weights, and makes every call wait its turn (`group.py`).
        `settings` (`base/settings.py`; by default the current ones) say which of nimble's kernels
        and pairs it may use and the thresholds of its measured choices."""
        self.settings = settings if settings is not None else current_settings()
        with using(self.settings):
            self._load(artifact, device, arena, single_stream, graph_dump, name, tune, choice, max_memory, share,
                       arena_bytes, group)

    def _load(self, artifact, device, arena, single_stream, graph_dump, name, tune, choice, max_memory, share,
              arena_bytes, group) -> None:
        t0 = time.perf_counter()
        check_tune_mode(tune)
        if choice is not None and choice not in tuning.every_choice():
            raise UsageError(f"choice={choice!r} is no load-time choice; build it from the settings tuning.py "
                             "names (LAYOUTS, STREAMS, ALGORITHMS, CONVOLUTIONS, GEMM_BIAS, PROLOGUES)")
        self._stages = stages = Stages()  # each load stage timed once (stages.py)
        with stages.stage("prepare"):
            self.artifact = artifact
            self.graph, self.schedule, self.memory = artifact.graph, artifact.schedule, artifact.memory
            self.device, self.notice = resolve_device(device)
            self.stats = LoadStats()
            self._closed = False
            self._name = name or artifact.model
            self._mark = footprint.Mark.now(self.device) if self.device.type == "cuda" else None
            self._placed: list[PlacedOp] = prepare(self.graph)
            self._cuda_graph = None
            self._with_arena = arena
            self._single_stream = single_stream
            self._share = share
            self._group = group
            self._arena_added: int | None = None  # in a group: the bytes its load added to the group's arena
            self._arena_size = max(arena_bytes or 0, self.memory.arena_bytes)
            self._streams: list[torch.cuda.Stream] = []  # none on the CPU: ops run serially
            self._blas_ready: set[int] = set()  # the streams whose cuBLAS workspaces exist
            self._cudnn_workspaces = cudnn_graph.Workspaces()  # the cuDNN graphs' workspaces, per stream
            self.choice = tuning.Choice()  # on CUDA, replaced by what _choose picks
            self._set_order(self.choice)
        with stages.stage("preflight"):  # before any op touches real memory
            preflight(self.graph, self.memory, name or artifact.model)
            self._indices = indices.plan_indices(self.graph)
            names = {v.id: v.name for v in self.graph.values if v.kind == WEIGHT}
            indices.check_weights({vid: artifact.weights[n] for vid, n in names.items()}, self._indices, names,
                                  name or artifact.model)
            for p in self._placed:
                p.clamps = tuple(self._indices.clamps.get(p.op.id, ()))
        with stages.stage("allocate"):
            self._check_budget(max_memory, self._planned_bytes())
            self._allocate()
        if self.device.type == "cuda":
            built, hits, seconds, fallbacks, recalled = (generated.STATS.generated, generated.STATS.source_hits,
                                                         generated.STATS.seconds, len(generated.STATS.fallbacks),
                                                         binaries.STATS.recalled)
            self._choose(tune, choice, graph_dump)
            self._stored_weights = dict(self._weights)  # only the chosen layout's weights stay
            self._channels_last_weights = {}
            self.stats.kernels_generated = generated.STATS.generated - built
            self.stats.kernel_source_hits = generated.STATS.source_hits - hits
            self.stats.kernel_binaries_recalled = binaries.STATS.recalled - recalled
            stages.move("warmup", "kernels", generated.STATS.seconds - seconds)  # kernels build on first run
            self.stats.kernel_fallbacks = generated.STATS.fallbacks[fallbacks:]
            settle_footprint(self, max_memory, "compile with fewer streams (--streams) or a smaller batch")
        if group is not None:
            group._join(self)
        self.stats.seconds = {**stages.seconds, "total": time.perf_counter() - t0}

    def _planned_bytes(self) -> dict[str, int]:
        """Bytes of the tensors the plan names: weights, arena and inputs."""
        g = self.graph
        arena = self._arena_size
        if self._group is not None:  # in a group: what it grew the group's arena by (to grow, before it loads)
            shared = 0 if self._group.arena is None else self._group.arena.numel()
            arena = max(arena - shared, 0) if self._arena_added is None else self._arena_added
        return {"weights": sum(t.numel() * t.element_size() for t in self.artifact.weights.values()),
                "arena": arena if self._with_arena else 0,
                "inputs": sum(g.values[i].spec.nbytes for i in g.inputs)}

    def _check_budget(self, max_memory: int | None, planned: dict[str, int]) -> None:
        if max_memory is not None and (isinstance(max_memory, bool) or not isinstance(max_memory, int)
                                       or max_memory < 1):
            raise UsageError(f"max_memory must be a positive number of bytes, got {max_memory!r}")
        need = sum(planned.values())
        if max_memory is not None and need > max_memory:
            raise ExecutionError(f"{self._name} needs {_mib(need)} for its weights, arena and inputs alone, above "
                                 f"the memory budget of {_mib(max_memory)}; nothing was allocated. Raise the budget, "
                                 "or compile for a smaller batch")

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
        """Give back what the artifact holds: the captured graph, its pool, the arena, the weights
        and the input buffers (on CUDA, to the device). Calling it afterwards is refused. Also
        `with nimble.load(path) as exe: ...`."""
        if self._closed:
            return
        self._closed = True
        self._cuda_graph = self._tensors = self._outputs = self._env_after = None
        self._views, self._weights, self._stored_weights, self._inputs = {}, {}, {}, []
        self._channels_last_weights = {}
        # the cuDNN graphs' workspaces, given back here unless another holder (an executable of the
        # same multi-batch artifact) has them: the fused kernels held them too, and kept them after close
        self._cudnn_workspaces = cudnn_graph.Workspaces()
        for p in self._placed:
            if isinstance(p.substitute, fused.FusedKernel):
                p.substitute.workspaces = self._cudnn_workspaces
                p.substitute.forget_calls()
        self.arena = None
        self._streams = []
        if self._group is not None:
            self._group._leave(self)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def __enter__(self) -> Executable:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------ set-up
    def _choose(self, tune: str, forced, graph_dump) -> None:
        """Pick how to run (forced, from the tuning cache, or by timing the candidates greedily),
        then build the CUDA graph that runs it."""
        folded = capped.streams_under(self.schedule, None)
        # a candidate only where a pair survives the other pairs of the planned order, which `_set_order`
        # found (efficientnet's depthwise ops are all in mean pairs: the candidate would run the same kernels)
        prologues = self.settings.prologue_pairs and self._with_arena and bool(
            pairs.prologue_pairs(self.graph, self._placed, pairs.taken(self._pairs)))
        options = tuning.candidates(self.graph, max(folded, default=0) + 1, prologues)
        if self._single_stream or not self._with_arena:  # the baselines of `nimble bench`
            options = [tuning.Choice()]
        timed: dict[str, float] = {}
        held: dict[str, int] = {}  # bytes in each timed candidate's graph pool
        if forced is not None:
            best, how = forced, "forced"
        elif len(options) == 1 or tune == "off":
            best, how = options[0], "off" if tune == "off" and len(options) > 1 else "only one candidate"
        else:
            key = tuning.cache_key(self.artifact, self.device, self.settings)  # hashing: only where the cache is used
            best = tuning.cached(key) if tune == "cached" else None
            how = "cache hit"
            if best is None or best not in options:
                last = None
                with self._stages.stage("tuning"):  # its builds' warm-ups and captures count as those
                    for stage in tuning.stages(options, graphs=cudnn_graph.frontend() is not None):
                        for c in stage if isinstance(stage, list) else stage(best):
                            self._build(c)
                            timed[c.describe()] = timing.gpu_ms(self._cuda_graph.replay, self.device)
                            held[c.describe()] = footprint.pool_segments(self.device, self.pools())[0]
                            last = c
                        best = tuning.pick([c for c in options if c.describe() in timed], timed, held, self.settings)
                    tuning.store(key, best, timed)
                how = "timed"
                if best == last and not graph_dump:
                    self._record_choice(best, how, timed, held)
                    return
        self._build(best, graph_dump)
        self._record_choice(best, how, timed, held)

    def _record_choice(self, choice, how: str, timed: dict[str, float], held: dict[str, int]) -> None:
        self.choice = choice
        self.stats.choice, self.stats.tuning, self.stats.tuning_ms = choice.describe(), how, timed
        self.stats.tuning_pool_bytes = held

    def _set_order(self, choice) -> None:
        n = len(self.graph.ops)
        if self._single_stream:
            self._order, self._stream_of, self._waits = list(range(n)), [0] * n, [()] * n
        elif choice.streams == "serial":
            self._order, self._stream_of, self._waits = list(self.schedule.order), [0] * n, [()] * n
        else:  # the planned streams, folded onto as few CUDA streams as keep every one of them parallel,
            self._order = list(self.schedule.order)  # or the artifact's candidate capped as `choice` says
            self._stream_of = capped.streams_under(self.schedule, tuning.stream_cap(choice.streams))
            self._waits = list(capped.as_schedule(self.schedule, self._stream_of).waits)  # the rest: in order
        planned = not self._single_stream and choice.streams != "serial"
        self._planned_stream_of = list(self.schedule.stream) if planned else [0] * n  # the trace's tracks
        paired = self.device.type == "cuda" and self._with_arena  # kernels that write two ops' buffers
        prologues = choice.prologues == tuning.PROLOGUES[1] and choice.layout == "channels_last"
        self._pairs = pairs.find(self.graph, self._placed, self._order, self._stream_of, self._waits, prologues) \
            if paired else pairs.Pairs()
        if self._pairs.inputs and not self._holds(pairs.held_by(self.graph, self._pairs.inputs)):
            self._pairs.inputs = {}  # a plan from before `memory.held_inputs` held them may free them sooner

    def _holds(self, held: dict[int, list[int]]) -> bool:
        """Whether the memory plan stays safe, under this choice's issue order and streams, where
        each op in `held` also uses the values listed for it (`verify.check_plan`)."""
        n = len(self._order)
        position = [0] * n
        for k, op in enumerate(self._order):
            position[op] = k
        order = Schedule(tuple(self._stream_of), tuple(self._order), tuple(position),
                         tuple(tuple(w) for w in self._waits), 0, 0, 0, 0, "")
        try:
            check_plan(self.graph, order, self.memory, held)
        except ValueError:
            return False
        return True

    def _build(self, choice, graph_dump: str | None = None) -> None:
        """Lay out the buffers and weights for `choice`, warm up every stream, and capture."""
        self._cuda_graph = self._tensors = None
        self._set_order(choice)
        channels_last = choice.layout == "channels_last"
        self._views = arena_views(self.graph, self.memory, self.arena,
                                  tuning.channels_last_values(self.graph) if channels_last else ()) \
            if self._with_arena else {}
        self._weights = dict(self._stored_weights)
        if channels_last:
            self._weights.update(self._channels_last_weights)
        needed = max(self._stream_of, default=0) + 1  # made once per load: each stream costs workspaces
        self._streams += [torch.cuda.Stream(self.device) for _ in range(needed - len(self._streams))]
        self._make_blas_workspaces()
        if self._share is None and self._group is None:  # sized anew for this choice's plans (no graph is left)
            self._cudnn_workspaces = cudnn_graph.Workspaces()
        for p in self._placed:
            if isinstance(p.substitute, fused.FusedKernel):
                p.substitute.cudnn_fusion = choice.convolutions == "cudnn-fused"
                p.substitute.workspaces = self._cudnn_workspaces
                p.substitute.bare, p.substitute.after_bare = False, None
                p.substitute.deferred, p.substitute.reads_deferred = False, None
                p.substitute.forget_calls()
            else:
                biased = p.substitute
                while isinstance(biased, (SmallLinear, Gemm)):  # the substitutes a product falls back to
                    biased = biased.fallback
                if isinstance(biased, BiasedGemm):
                    biased.separate = choice.gemm_bias == "separate"
        for second, first in self._pairs.inputs.items():  # the 1x1 convolution computes its input
            self._placed[first].substitute.deferred = True
            self._placed[second].substitute.reads_deferred = self._placed[first].substitute
        if channels_last:  # the layout the depthwise kernel takes: it applies its producer's epilogue
            for consumer, producer in self._pairs.prologues.items():
                self._placed[producer].substitute.bare = True
                self._placed[consumer].substitute.after_bare = self._placed[producer].substitute
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

    def _make_blas_workspaces(self) -> None:
        """cuBLAS keeps a workspace per CUDA stream for the whole process (32 MiB on Hopper), made at
        the stream's first matrix product. Made in the middle of a warm-up, it is carved out of a
        segment that a convolution's workspace has just freed, and the rest of that segment can
        never go back to the device (it stayed reserved: 69 MiB for inception_v3). So each stream
        that will multiply matrices makes it here, before any op runs, in a segment of its own.
        Float32 products (`gemm.Gemm`) mostly run as nimble's kernel and time cuBLAS on
        `timing.stream`: their streams get none here (one that falls back to cuBLAS makes its
        workspace in the warm-up)."""
        streams_of = {self._stream_of[p.op.id] for p in self._placed
                      if p.op.target.split("::")[-1].split(".")[0] in GEMMS and not isinstance(p.substitute, Gemm)
                      and not (isinstance(p.substitute, SmallLinear) and not p.substitute.calls_cublas)}
        for k in sorted(streams_of - self._blas_ready):
            with torch.cuda.stream(self._streams[k]):
                one = torch.ones(2, 2, device=self.device)
                torch.mm(one, one)
                torch.addmm(one[0], one, one)  # cuBLASLt's, where PyTorch uses it for a bias
        self._blas_ready |= streams_of

    def _allocate(self) -> None:
        g = self.graph
        need = self._arena_size + sum(t.numel() * t.element_size() for t in self.artifact.weights.values())
        if self._share is not None:
            self._borrow(self._share)
        else:
            self._allocate_own(need)
        if self._group is not None:  # its arena and streams; the weights and input buffers stay its own
            held = 0 if self._group.arena is None else self._group.arena.numel()
            self.arena = self._group.reserve(self._arena_size)
            self._arena_added = self.arena.numel() - held
            self._share_streams(self._group)
        try:  # the warm-up and tuning run on the stored sample inputs, never on whatever memory held
            self._load_inputs(self.artifact.sample_inputs)
        except ShapeError as e:
            raise ArtifactError(f"{self.artifact.model}: the stored sample input does not fit the model "
                                f"({e})") from None
        self._weights = dict(self._stored_weights)
        self._views = arena_views(g, self.memory, self.arena) if self._with_arena else {}
        self.stats.weight_bytes = sum(t.numel() * t.element_size() for t in self._weights.values())
        self.stats.arena_bytes = self.memory.arena_bytes if self._with_arena else 0

    def _borrow(self, lender: Executable) -> None:
        """The lender's weights, as it runs them (its chosen layout), and its arena; own input buffers."""
        g = self.graph
        if lender.device != self.device or lender.arena.numel() < self.memory.arena_bytes:
            raise ExecutionError(f"{self._name}: the executable it shares with has another device or a smaller arena")
        self._stored_weights = {v.id: lender._weights_by_name[v.name] for v in g.values if v.kind == WEIGHT}
        self._channels_last_weights = {}
        self.arena = lender.arena
        self._share_streams(lender)
        try:
            self._inputs = [torch.zeros(g.values[i].spec.shape, dtype=types.DTYPES[g.values[i].spec.dtype],
                                        device=self.device) for i in g.inputs]
        except (torch.cuda.OutOfMemoryError, MemoryError, RuntimeError):
            raise ExecutionError(f"out of memory on {self.device} while loading the input buffers") from None

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

    def _allocate_own(self, need: int) -> None:
        g, dev = self.graph, self.device
        weights = {v.id: self.artifact.weights[v.name] for v in g.values if v.kind == WEIGHT}
        inputs = [torch.zeros(g.values[i].spec.shape, dtype=types.DTYPES[g.values[i].spec.dtype]) for i in g.inputs]
        try:
            if dev.type == "cuda":
                # three allocations (`regions.py`): the weights every layout reads, with the arena and
                # the input buffers; the convolution weights; and their channels_last copies (made
                # once, here, for every candidate that lays them out so). Whichever layout is chosen,
                # the convolution weights it does not keep are one whole allocation, which goes back
                # to the device
                convs = tuning.conv_weights(g)
                kept = regions.pack({**{k: t for k, t in weights.items() if k not in convs},
                                     **{("input", k): x for k, x in enumerate(inputs)}}, dev,
                                    blank={"arena": 1 if self._group else max(self._arena_size, 1)},
                                    strides={k: (1, weights[k].shape[0]) for k in gemm.k_major_weights(g)})
                self._stored_weights = {**{k: t for k, t in kept.items() if isinstance(k, int)},
                                        **regions.pack({k: t for k, t in weights.items() if k in convs}, dev)}
                self.arena, self._inputs = kept["arena"], [kept["input", k] for k in range(len(inputs))]
                self._channels_last_weights = regions.pack({k: self._stored_weights[k] for k in sorted(convs)}, dev,
                                                           torch.channels_last)
            else:  # the artifact's own tensors: nothing to copy
                self._stored_weights = {k: t.to(dev) for k, t in weights.items()}
                self.arena = torch.empty(1 if self._group else max(self._arena_size, 1), dtype=torch.uint8, device=dev)
                self._inputs, self._channels_last_weights = inputs, {}
        except (torch.cuda.OutOfMemoryError, MemoryError, RuntimeError):  # RuntimeError: the CPU allocator
            raise ExecutionError(f"out of {'GPU ' if dev.type == 'cuda' else ''}memory while loading: the weights "
                                 f"and arena need {need} bytes "
                                 f"({need / 2**20:.1f} MiB); free memory on {dev} or use a smaller batch") from None

    def _env(self) -> dict[int, torch.Tensor]:
        env = dict(self._weights)
        env.update(zip(self.graph.inputs, self._inputs))
        return env

    def _issue(self, validate: bool = False, around=None) -> dict[int, torch.Tensor]:
        """Issue every op in order on its stream, waiting on the planned events; `around(step)`,
        where given, wraps each op's step (the trace times them so). With `validate`, an op that
        fails is named with its source line. On CUDA, a result outside the arena is dropped once
        its last reader is issued (`streams.release_plan`), so that the allocator hands its
        memory to a later result on the same stream instead of holding every one of them; on the
        CPU the last call's results are kept for `tensors()`."""
        env = self._env()
        cuda = self.device.type == "cuda"
        run = PlacedRun(env, self._views, self.device, name_failures=validate,
                        release=streams.release_plan(self.graph, self._order, self._stream_of) if cuda else None,
                        kept=self._own_storages() if cuda else frozenset(), pairs=self._pairs)
        with using(self.settings):  # the kernels build and choose under this load's settings
            run_ops(self._placed, run, self._order,
                    lambda order, step: streams.issue(order, step if around is None else around(step), self.device,
                                                      self._streams, self._stream_of, self._waits))
        self._env_after = None if cuda else env
        return env

    def _capture(self, dump: str | None = None) -> None:
        graph = streams.new_graph(debug=bool(dump))
        pool = self._group.pool if self._group is not None else None  # a group's members share one graph pool
        with streams.capturing(graph, self._streams[0], self.device, "the op list",
                               "try an artifact compiled with --streams 1", pool):
            env = self._issue()
        torch.cuda.synchronize(self.device)
        if dump:
            streams.write_dot(graph, dump)
        self._cuda_graph = graph
        self._outputs = [env[o] for o in self.graph.outputs]
        self._tensors = env

    # ------------------------------------------------------------------------------ calls
    def __call__(self, *inputs: torch.Tensor, copy: bool = True) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """One inference: a tensor for a model with one output, else a tuple (fresh tensors; views
        of nimble's buffers until the next call with `copy=False`)."""
        outs = self.run(*inputs, copy=copy)
        return outs[0] if len(outs) == 1 else tuple(outs)

    def run(self, *inputs: torch.Tensor, copy: bool = True) -> list[torch.Tensor]:
        """One inference, its outputs always as a list (for code that handles any number of
        outputs); `copy` as for a call."""
        self._ensure_open()
        with self._turn():
            self._load_inputs(inputs)
            if self._cuda_graph is not None:
                self._cuda_graph.replay()
                outputs = self._outputs
            else:
                env = self._issue(validate=True)
                outputs = [env[o] for o in self.graph.outputs]
            return [t.clone() for t in outputs] if copy else list(outputs)

    def _turn(self):
        """The group's turn (its lock, and the GPU after its last call), else nothing."""
        return self._group.turn() if self._group is not None else contextlib.nullcontext()

    def __repr__(self) -> str:
        g = self.graph
        runs = self.choice.describe() if self.device.type == "cuda" else "the placed op list, serially"
        return (f"<nimble.Executable {self.artifact.model} on {self.device}: ({g.describe(g.inputs)}) -> "
                f"({g.describe(g.outputs)}); {len(g.ops)} ops on {self.schedule.num_streams} stream(s), runs as "
                f"{runs}; outputs are fresh tensors (copy=False: views of its buffers until the next call)>")

    def replay(self) -> None:
        """One inference on whatever the input buffers hold (for benchmarks)."""
        self._ensure_open()
        with self._turn():
            if self._cuda_graph is not None:
                self._cuda_graph.replay()
            else:
                self._issue(validate=True)

    def _load_inputs(self, inputs) -> None:
        self.check_inputs(inputs)
        for buf, x in zip(self._inputs, inputs):
            buf.copy_(x, non_blocking=True)

    def check_inputs(self, inputs) -> None:
        """Raise ShapeError, in one line, unless `inputs` are what a call takes: their count,
        shapes and dtypes, and index values inside their tables (`check_values`)."""
        g = self.graph
        if len(inputs) != len(g.inputs):
            raise ShapeError(f"the model takes {len(g.inputs)} input(s) "
                             f"({', '.join(g.values[i].name for i in g.inputs)}), got {len(inputs)}")
        for k, (vid, buf, x) in enumerate(zip(g.inputs, self._inputs, inputs)):  # all checked before any copy
            spec = g.values[vid].spec
            if not isinstance(x, torch.Tensor):
                raise ShapeError(f"input '{g.values[vid].name}' must be a tensor, got {type(x).__name__}")
            if tuple(x.shape) != spec.shape:
                raise ShapeError(f"input '{g.values[vid].name}' must be {spec.dtype}{list(spec.shape)}, got "
                                 f"{types.dtype_name(x.dtype)}{list(x.shape)}; the artifact was compiled for that "
                                 "shape alone: compile the model again for another")
            if x.dtype != buf.dtype:
                raise ShapeError(f"input '{g.values[vid].name}' must be {spec.dtype}, got "
                                 f"{types.dtype_name(x.dtype)}; convert it first (x.to(torch.{spec.dtype}))")
        self.check_values(inputs)

    def check_values(self, inputs) -> None:
        """Raise ShapeError unless every index input's values lie inside the table it indexes (on
        CUDA, one outside would trip a device-side assert and end the process)."""
        g = self.graph
        for k, (vid, x) in enumerate(zip(g.inputs, inputs)):
            indices.check_input(x, self._indices.inputs.get(k, ()), g.values[vid].name)

    def verify(self, rtol: float | None = None, atol: float | None = None):
        """Run the stored sample input and compare with the stored sample outputs (the load-time
        self-check `nimble.load(..., verify=True)` asks for). Returns the comparison."""
        rt, at = default_tolerance(self.device.type)
        result = compare(self.run(*self.artifact.sample_inputs), self.artifact.sample_outputs,
                         rt if rtol is None else rtol, at if atol is None else atol, l2_tolerance(self.artifact, rtol))
        if not result.passed:
            raise MismatchError(f"{self.artifact.model}: on the stored sample input the loaded artifact does not "
                                f"reproduce the stored outputs: {result.describe()}")
        return result

    @property
    def input_buffers(self) -> list[torch.Tensor]:
        """The static input buffers; what is written here directly is not range-checked, so write
        only values that passed a call (the stored sample inputs do)."""
        return list(self._inputs)

    def outside_arena(self) -> list[int]:
        """Planned values that the captured graph holds elsewhere than at their planned offset, or
        held there and released after their last reader: the results of fused ops that a cuDNN
        fused kernel computes (it allocates its own result)."""
        if self._cuda_graph is None or not self._with_arena:
            return []
        base, held = self.arena.data_ptr(), self._tensors
        return [vid for vid in sorted(self._views)  # a value the capture released is not held any more
                if vid not in held or held[vid].data_ptr() - base != self.memory.offset[vid]]

    def tensors(self) -> dict[int, torch.Tensor]:
        """Value id -> the tensor holding it in the captured graph (CUDA) or after the last call;
        on CUDA, not the results outside the arena released after their last reader, and under a
        choice with depthwise prologues a depthwise convolution's input holds its producer's
        convolution alone (the depthwise kernel applies the rest), and where a 1x1 convolution
        computes the elementwise op before it as it loads (`pairs.input_pairs`), that op's buffer
        holds nothing."""
        return dict(self._tensors if self._cuda_graph is not None else getattr(self, "_env_after", {}))


def settle_footprint(loaded, max_memory: int | None, advice: str) -> None:
    """At the end of a CUDA load: give what warm-ups and tuning freed back to the device, record
    the footprint in `loaded.stats`, and close and refuse a load above `max_memory`."""
    torch.cuda.empty_cache()
    loaded.stats.footprint = loaded.footprint()
    grown = loaded.stats.footprint.growth
    if max_memory is not None and grown > max_memory:
        loaded.close()
        raise ExecutionError(f"{loaded._name}: loaded, it holds {_mib(grown)} on {loaded.device}, above the memory "
                             f"budget of {_mib(max_memory)}; raise the budget, or {advice}")


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def open_artifact(artifact, device: str = "auto", **options) -> Executable:
    """An artifact read into memory, loaded: an `Executable`, or for an artifact of several batch
    sizes a `batched.Batched`, which is called the same way. `options` as `Executable` takes
    them (name, tune, graph_dump, max_memory, settings)."""
    if artifact.batches:
        from .batched import Batched

        return Batched(artifact, device, **options)
    return Executable(artifact, device, **options)


def load(path: str | Path, device: str = "auto", tune: str = "cached", graph_dump: str | None = None,
         verify: bool = False, max_memory: int | None = None, settings: Settings | None = None) -> Executable:
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
    from nimble.formats import read_artifact

    t = time.perf_counter()
    art = read_artifact(path)
    read_s = time.perf_counter() - t
    exe = open_artifact(art, device, name=Path(path).name, tune=tune, graph_dump=graph_dump, max_memory=max_memory,
                        settings=settings)
    exe.stats.seconds = {"read": read_s, **exe.stats.seconds, "total": read_s + exe.stats.seconds["total"]}
    if verify:
        exe.verify()
    return exe

