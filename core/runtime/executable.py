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
computes them.

On the CPU, the same placed op list runs serially in issue order on each call.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import ExecutionError, ShapeError, first_line
from ..ir import WEIGHT
from ..ops import bridge
from . import streams
from .placement import PlacedOp, arena_views, prepare, run_op
from .preflight import preflight


@dataclass
class LoadStats:
    seconds: dict[str, float] = field(default_factory=dict)
    weight_bytes: int = 0
    arena_bytes: int = 0
    scratch_bytes: int = 0  # graph-pool memory the capture kept: op workspaces and temporaries


class Executable:
    """A loaded artifact. Calling it runs one inference: `outputs = exe(x)` or `exe(x, y)`.

    Outputs are views of nimble's buffers, valid until the next call; pass `copy=True` for tensors
    of your own."""

    def __init__(self, artifact, device: str = "auto", *, arena: bool = True, single_stream: bool = False,
                 graph_dump: str | None = None, name: str | None = None):
        """`arena=False` and `single_stream=True` build the baselines that `nimble bench` times:
        activations in PyTorch's graph pool, or every op on one stream in program order.
        `graph_dump` writes the captured CUDA graph as Graphviz DOT (for tests and debugging).
        `name` names the artifact in errors (its file's name; by default its model's)."""
        t0 = time.perf_counter()
        self.artifact = artifact
        self.graph, self.schedule, self.memory = artifact.graph, artifact.schedule, artifact.memory
        self.device, self.notice = bridge.resolve_device(device)
        self.stats = LoadStats()
        self._placed: list[PlacedOp] = prepare(self.graph)
        self._cuda_graph = None
        self._with_arena = arena
        self._order = list(range(len(self.graph.ops))) if single_stream else list(self.schedule.order)
        self._stream_of = [0] * len(self.graph.ops) if single_stream else list(self.schedule.stream)
        self._waits = [()] * len(self.graph.ops) if single_stream else list(self.schedule.waits)
        self._streams: list[torch.cuda.Stream] = []  # none on the CPU: ops run serially
        t = time.perf_counter()
        preflight(self.graph, self.memory, name or artifact.model)  # before any op touches real memory
        self.stats.seconds["preflight"] = time.perf_counter() - t
        self._allocate()
        self.stats.seconds["allocate"] = time.perf_counter() - t0 - self.stats.seconds["preflight"]
        if self.device.type == "cuda":
            self._streams = [torch.cuda.Stream(self.device) for _ in range(max(self._stream_of, default=0) + 1)]
            t = time.perf_counter()
            self._issue(validate=True)  # eager warm-up on every stream: handles and workspaces exist
            torch.cuda.synchronize(self.device)
            self.stats.seconds["warmup"] = time.perf_counter() - t
            t = time.perf_counter()
            self._capture(graph_dump)
            self.stats.seconds["capture"] = time.perf_counter() - t
        self.stats.seconds["total"] = time.perf_counter() - t0

    # ------------------------------------------------------------------------------ set-up
    def _allocate(self) -> None:
        g, dev = self.graph, self.device
        need = self.memory.arena_bytes + sum(t.numel() * t.element_size() for t in self.artifact.weights.values())
        try:
            self._weights = {v.id: self.artifact.weights[v.name].to(dev) for v in g.values if v.kind == WEIGHT}
            self.arena = torch.empty(max(self.memory.arena_bytes, 1), dtype=torch.uint8, device=dev)
            self._inputs = [torch.empty(g.values[i].spec.shape, dtype=bridge.DTYPES[g.values[i].spec.dtype],
                                        device=dev) for i in g.inputs]
        except (torch.cuda.OutOfMemoryError, MemoryError, RuntimeError):  # RuntimeError: the CPU allocator
            raise ExecutionError(f"out of {'GPU ' if dev.type == 'cuda' else ''}memory while loading: the weights "
                                 f"and arena need {need} bytes "
                                 f"({need / 2**20:.1f} MiB); free memory on {dev} or use a smaller batch") from None
        self._views = arena_views(g, self.memory, self.arena) if self._with_arena else {}
        self.stats.weight_bytes = sum(t.numel() * t.element_size() for t in self._weights.values())
        self.stats.arena_bytes = self.memory.arena_bytes if self._with_arena else 0

    def _env(self) -> dict[int, torch.Tensor]:
        env = dict(self._weights)
        env.update(zip(self.graph.inputs, self._inputs))
        return env

    def _issue(self, validate: bool = False) -> dict[int, torch.Tensor]:
        """Issue every op in order on its stream, waiting on the planned events. With `validate`,
        an op that fails is named with its source line."""
        env = self._env()

        def run(i: int) -> None:
            p = self._placed[i]
            try:
                run_op(p, env, self._views, self.device)
            except Exception as e:
                if not validate:
                    raise
                raise ExecutionError(f"op {i} ({p.op.target}, from {p.op.source}) fails on {self.device}: "
                                     f"{first_line(e)}") from e

        streams.issue(self._order, run, self.device, self._streams, self._stream_of, self._waits)
        self._env_after = env
        return env

    def _capture(self, dump: str | None = None) -> None:
        before = torch.cuda.memory_reserved(self.device)
        graph = streams.new_graph(debug=bool(dump))
        with streams.capturing(graph, self._streams[0], self.device, "the op list",
                               "try an artifact compiled with --streams 1"):
            env = self._issue()
        torch.cuda.synchronize(self.device)
        if dump:
            graph.debug_dump(dump)
        self.stats.scratch_bytes = torch.cuda.memory_reserved(self.device) - before
        self._cuda_graph = graph
        self._outputs = [env[o] for o in self.graph.outputs]
        self._tensors = env

    # ------------------------------------------------------------------------------ calls
    def __call__(self, *inputs: torch.Tensor, copy: bool = False) -> list[torch.Tensor]:
        self._load_inputs(inputs)
        if self._cuda_graph is not None:
            self._cuda_graph.replay()
            outputs = self._outputs
        else:
            env = self._issue(validate=True)
            outputs = [env[o] for o in self.graph.outputs]
        return [t.clone() for t in outputs] if copy else list(outputs)

    def replay(self) -> None:
        """One inference on whatever the input buffers hold (for benchmarks)."""
        if self._cuda_graph is not None:
            self._cuda_graph.replay()
        else:
            self._issue(validate=True)

    def _load_inputs(self, inputs) -> None:
        g = self.graph
        if len(inputs) != len(g.inputs):
            raise ShapeError(f"the model takes {len(g.inputs)} input(s) "
                             f"({', '.join(g.values[i].name for i in g.inputs)}), got {len(inputs)}")
        for vid, buf, x in zip(g.inputs, self._inputs, inputs):
            spec = g.values[vid].spec
            if not isinstance(x, torch.Tensor):
                raise ShapeError(f"input '{g.values[vid].name}' must be a tensor, got {type(x).__name__}")
            if tuple(x.shape) != spec.shape or x.dtype != buf.dtype:
                raise ShapeError(f"input '{g.values[vid].name}' must be {spec.dtype}{list(spec.shape)}, got "
                                 f"{bridge.dtype_name(x.dtype)}{list(x.shape)}; recompile with --shape for "
                                 "other shapes")
            buf.copy_(x, non_blocking=True)

    @property
    def input_buffers(self) -> list[torch.Tensor]:
        return list(self._inputs)

    def tensors(self) -> dict[int, torch.Tensor]:
        """Value id -> the tensor holding it in the captured graph (CUDA) or after the last call."""
        return dict(self._tensors if self._cuda_graph is not None else getattr(self, "_env_after", {}))


def load(path: str | Path, device: str = "auto") -> Executable:
    """Read and validate an artifact, then prepare it for execution on `device`."""
    from nimble.formats import read_artifact

    t = time.perf_counter()
    art = read_artifact(path)
    read_s = time.perf_counter() - t
    exe = Executable(art, device, name=Path(path).name)
    exe.stats.seconds = {"read": read_s, **exe.stats.seconds, "total": read_s + exe.stats.seconds["total"]}
    return exe

